"""The code map (docs/code-map.md) from the package's own docstrings, and a check that every
docstring cross-reference resolves.

``python scripts/code_map.py`` prints the map; ``tests/unit/test_code_map.py`` checks that the
committed map is the one printed (so every module is listed, with what its docstring says now)
and that every ``:mod:`` / ``:class:`` / ``:func:`` / ``:meth:`` / ``:data:`` / ``:attr:`` /
``:exc:`` reference in a docstring names something that exists. Static: nothing is imported.

Resolution, as Sphinx reads the roles: ``~`` is dropped; a leading ``.`` is relative to the
module's package (then to each package above it); a bare name is looked up in the module
(its definitions and imports), then as an absolute name. A name outside ``hybrid_offload``
(``torch.Tensor``, ``vllm....``) is not checked.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hybrid_offload"
ROLE = re.compile(r":(mod|class|func|meth|data|attr|exc|obj):`([^`]+)`")
MAP_PATH = ROOT / "docs" / "code-map.md"
#: packages we name in docstrings but do not check
EXTERNAL = frozenset(
    {
        "torch",
        "vllm",
        "numpy",
        "np",
        "redis",
        "nixl",
        "lmcache",
        "transformers",
        "msgspec",
        "zmq",
        "prometheus_client",
    }
)


@dataclass
class Module:
    """One module's docstring and the names it defines or imports (class -> its members)."""

    name: str
    path: Path
    is_package: bool
    doc: str
    defined: dict[str, set[str]] = field(default_factory=dict)  # name -> members (classes)
    bases: dict[str, list[str]] = field(default_factory=dict)  # class -> its bases' names
    imported: dict[str, str] = field(default_factory=dict)  # local name -> absolute target


def sources() -> dict[str, Path]:
    """Module name -> file (``backends/`` under its installed name)."""
    out = {}
    for folder, prefix in ((ROOT / PACKAGE, PACKAGE), (ROOT / "backends", f"{PACKAGE}.backends")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def _members(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign | ast.AnnAssign):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Attribute) and ast.unparse(sub.value) == "self":
                        names.add(sub.attr)
    return names


def parse(name: str, path: Path) -> Module:
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    module = Module(name, path, is_package, ast.get_docstring(tree) or "")
    package = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            module.defined.setdefault(node.name, set()).update(_members(node))
            module.bases[node.name] = [ast.unparse(base).split("[")[0] for base in node.bases]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            module.defined.setdefault(node.name, set())
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        module.defined.setdefault(sub.id, set())
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module.imported[(alias.asname or alias.name).split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                module.imported[alias.asname or alias.name] = f"{base}.{alias.name}"
    return module


def modules() -> dict[str, Module]:
    return {name: parse(name, path) for name, path in sources().items()}


class Resolver:
    """Resolves dotted names against the parsed package."""

    def __init__(self, mods: dict[str, Module]) -> None:
        self.mods = mods

    def absolute(self, dotted: str, depth: int = 0) -> bool:
        """Whether ``dotted`` (absolute) names a module, or something in one."""
        if not dotted.startswith(PACKAGE + ".") and dotted != PACKAGE:
            return True  # outside the package: not checked
        if dotted in self.mods:
            return True
        if depth > 8:
            return False
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = self.mods.get(".".join(parts[:cut]))
            if module is not None:
                return self.inside(module, parts[cut:], depth)
        return False

    def inside(self, module: Module, names: list[str], depth: int = 0) -> bool:
        """Whether ``names`` (a name, then its members) are found in ``module``."""
        head, rest = names[0], names[1:]
        if head in module.defined:
            if not rest or rest[0] in module.defined[head] or len(rest) > 1:
                return True
            ours = [b for b in module.bases.get(head, ()) if b in module.defined or self._ours(module, b)]
            return any(self.reference(module, f"{base}.{rest[0]}") for base in ours)
        if not rest and any(head in members for members in module.defined.values()):
            return True  # a member named in its class's docstring
        if head in module.imported:
            return self.absolute(".".join([module.imported[head], *rest]), depth + 1)
        sub = self.mods.get(f"{module.name}.{head}") if module.is_package else None
        if sub is not None:
            return not rest or self.inside(sub, rest, depth + 1)
        return False

    @staticmethod
    def _ours(module: Module, name: str) -> bool:
        return module.imported.get(name.split(".")[0], "").startswith(PACKAGE + ".")

    def reference(self, module: Module, target: str) -> bool:
        target = target.lstrip("~").removesuffix("()")
        if target.startswith("."):
            package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
            for cut in range(len(package), 0, -1):
                if self.absolute(".".join([*package[:cut], target.lstrip(".")])):
                    return True
            return self.inside(module, target.lstrip(".").split("."))
        if self.inside(module, target.split(".")):
            return True
        return (self.absolute(target) and target.startswith(PACKAGE)) or self._anywhere(target)

    def _anywhere(self, target: str) -> bool:
        """A bare ``Name`` or ``Name.member`` defined in some module of the package (Sphinx
        finds such names by searching), or a name outside it."""
        head = target.split(".")[0]
        if head in dir(builtins) or head in sys.stdlib_module_names or head in EXTERNAL:
            return True
        return any(self.inside(m, target.split(".")) for m in self.mods.values())


def broken_references(mods: dict[str, Module]) -> list[str]:
    """``path:role:`target``` for every docstring reference that does not resolve."""
    resolver = Resolver(mods)
    out = []
    for module in mods.values():
        text = module.path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node) or ""
            for role, target in ROLE.findall(doc):
                if not resolver.reference(module, target):
                    where = module.path.relative_to(ROOT) if module.path.is_relative_to(ROOT) else module.path
                    out.append(f"{where}: :{role}:`{target}`")
    return sorted(set(out))


def _first_paragraph(doc: str) -> str:
    paragraph = doc.strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def code_map(mods: dict[str, Module]) -> str:
    """The map: per package, its docstring's first paragraph, then each module's."""
    lines = [
        "# Code map",
        "",
        "Generated by `python scripts/code_map.py > docs/code-map.md` from each package's and",
        "module's docstring (first paragraph); `tests/unit/test_code_map.py` fails when it is stale.",
        "`backends/` is installed as `hybrid_offload.backends`. Layers and words:",
        "[design.md](design.md#glossary).",
        "",
    ]
    packages = sorted(name for name, m in mods.items() if m.is_package)
    for package in packages:
        members = sorted(
            name for name, m in mods.items()
            if not m.is_package and name.rsplit(".", 1)[0] == package
        )  # fmt: skip
        path = mods[package].path.parent.relative_to(ROOT)
        about = _first_paragraph(mods[package].doc) or "(no docstring)"
        lines += [f"## `{package}` (`{path}/`)", "", about, ""]
        for name in members:
            lines.append(
                f"- `{name.rsplit('.', 1)[1]}`: {_first_paragraph(mods[name].doc) or '(no docstring)'}"
            )
        if members:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    mods = modules()
    if "--check-references" in sys.argv:
        broken = broken_references(mods)
        print("\n".join(broken))
        return 1 if broken else 0
    sys.stdout.write(code_map(mods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
