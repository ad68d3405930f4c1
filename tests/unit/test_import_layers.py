"""The import contract: each layer of hybrid-offload imports only the layers below it.

    core < router < compat < backends < engine < connector < testing < tools

plus the external packages a layer must not touch: the core and the router neither vLLM nor
torch (nor the Hugging Face libraries), backends not vLLM; in the connector only the modules in
:data:`VLLM_AT_RUN_TIME` import vLLM outside ``TYPE_CHECKING``. Private names of vLLM, NIXL and
prometheus_client (:data:`PRIVATE_NAMES`) appear only in ``hybrid_offload/compat.py``, the one gate to them.
Every import statement counts, also inside a function or under ``TYPE_CHECKING``.
``backends/`` lives at the top of the repository and is installed as ``hybrid_offload.backends``
(``pyproject.toml``).

No two modules import each other, directly or round a circle (imports of a package's
``__init__`` aside: they name a namespace, not a module's code).

Under ``tests/`` no module imports a test module (``test_*``): what tests share lives in a plain
helper module or in the folder's ``conftest.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGE = "hybrid_offload"
#: lowest first; a module may import its own layer and the ones before it
LAYERS = ("core", "router", "compat", "backends", "engine", "connector", "testing", "tools")
FORBIDDEN_EXTERNAL = {
    "core": {"vllm", "torch", "transformers", "huggingface_hub"},
    "router": {"vllm", "torch", "transformers", "huggingface_hub"},
    "backends": {"vllm"},
}
#: private names of other packages we use; only the compat module may name them
PRIVATE_NAMES = frozenset(
    {
        "_custom_ops",
        "_get_attn_isa",
        "_collector_to_names",
        "nixlBind",
        "nixl_meta_utils",
        "_torch_cuda_version_from_disk",
    }
)
GATE = f"{PACKAGE}.compat"
#: connector modules that import vLLM at run time: what vLLM loads or subclasses (the connector
#: classes, foreign children), vLLM's metrics and its KV event classes
VLLM_AT_RUN_TIME = frozenset(
    f"{PACKAGE}.connector.{name}"
    for name in ("facade", "composite", "children", "prometheus", "scheduler.events")
)


def _sources() -> dict[str, Path]:
    """Module name -> file, for every module of the package (backends/ under its install name)."""
    out = {}
    for folder, prefix in ((ROOT / PACKAGE, PACKAGE), (ROOT / "backends", f"{PACKAGE}.backends")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports (absolute names; ``from a import b`` gives ``a`` and ``a.b``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return parts[1]


def violations(graph: dict[str, set[str]]) -> list[str]:
    """What breaks the contract in ``graph`` (module -> the modules it imports)."""
    out = []
    for module, imported in sorted(graph.items()):
        layer = layer_of(module)
        if layer is None:
            if module not in (PACKAGE, f"{PACKAGE}.__main__"):  # the package and its command line
                out.append(f"{module}: in no layer (put it in one of {LAYERS})")
            continue
        rank = LAYERS.index(layer)
        for target in sorted(imported):
            top = target.split(".")[0]
            if top in FORBIDDEN_EXTERNAL.get(layer, ()):
                out.append(f"{module} ({layer}) imports {target}")
            target_layer = layer_of(target)
            if target_layer is not None and LAYERS.index(target_layer) > rank:
                out.append(f"{module} ({layer}) imports {target} ({target_layer}, a higher layer)")
    return out


def package_graph() -> dict[str, set[str]]:
    return {name: imports_of(name, path) for name, path in _sources().items()}


def graph_of_tests() -> dict[str, set[str]]:
    """Every module under tests/ (named by its path) -> the modules it imports."""
    return {str(path.relative_to(ROOT)): imports_of(path.stem, path) for path in TESTS.rglob("*.py")}


def imported_test_modules(graph: dict[str, set[str]]) -> list[str]:
    """Where a module of ``graph`` imports a test module (one named ``test_*``)."""
    out = []
    for module, imported in sorted(graph.items()):
        for top in sorted({target.split(".")[0] for target in imported}):
            if top.startswith("test_"):
                out.append(f"{module} imports {top}")
    return out


def test_every_module_imports_only_lower_layers() -> None:
    graph = package_graph()
    assert f"{PACKAGE}.core.planner" in graph and f"{PACKAGE}.backends.disk" in graph
    assert violations(graph) == []


def test_the_contract_catches_an_upward_or_forbidden_import() -> None:
    graph = package_graph()
    graph[f"{PACKAGE}.core.planner"] |= {"vllm.config", f"{PACKAGE}.connector.scheduler"}
    graph[f"{PACKAGE}.backends.cpu"] |= {f"{PACKAGE}.engine.translate", "vllm"}
    graph[f"{PACKAGE}.engine.kv_layout"] |= {f"{PACKAGE}.tools.cli.main"}
    graph[f"{PACKAGE}.stray"] = set()
    assert violations(graph) == [
        f"{PACKAGE}.backends.cpu (backends) imports {PACKAGE}.engine.translate (engine, a higher layer)",
        f"{PACKAGE}.backends.cpu (backends) imports vllm",
        f"{PACKAGE}.core.planner (core) imports {PACKAGE}.connector.scheduler (connector, a higher layer)",
        f"{PACKAGE}.core.planner (core) imports vllm.config",
        f"{PACKAGE}.engine.kv_layout (engine) imports {PACKAGE}.tools.cli.main (tools, a higher layer)",
        f"{PACKAGE}.stray: in no layer (put it in one of {LAYERS})",
    ]


def circles(graph: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    """The import circles of ``graph`` (each sorted), edges into ``packages`` left out."""
    edges = {
        m: sorted(t for t in imported if t in graph and t not in packages and t != m)
        for m, imported in graph.items()
    }
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in edges[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for module in sorted(edges):
        if module not in order:
            visit(module)
    return sorted(out)


def run_time_imports(path: Path) -> set[str]:
    """The absolute modules ``path`` imports outside ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit_one(other)
            else:
                visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def vllm_at_run_time(sources: dict[str, Path]) -> list[str]:
    """Connector modules outside :data:`VLLM_AT_RUN_TIME` that import vLLM at run time."""
    out = []
    for module, path in sorted(sources.items()):
        if layer_of(module) == "connector" and module not in VLLM_AT_RUN_TIME:
            out += [
                f"{module} imports {t}" for t in sorted(run_time_imports(path)) if t.split(".")[0] == "vllm"
            ]
    return out


def test_the_connector_imports_vllm_at_run_time_only_where_listed() -> None:
    assert vllm_at_run_time(_sources()) == []


def test_the_run_time_vllm_check_catches_an_import(tmp_path: Path) -> None:
    module = tmp_path / "offload_scheduler.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vllm.v1.request import Request\n"
        "def f():\n    import vllm.config\n"
    )
    sources = {**_sources(), f"{PACKAGE}.connector.scheduler.offload_scheduler": module}
    assert vllm_at_run_time(sources) == [
        f"{PACKAGE}.connector.scheduler.offload_scheduler imports vllm.config"
    ]


def _packages() -> set[str]:
    return {name for name, path in _sources().items() if path.name == "__init__.py"}


def test_no_import_circles() -> None:
    assert circles(package_graph(), _packages()) == []


def test_the_circle_check_catches_a_circle() -> None:
    graph = package_graph()
    plan, sched = (
        f"{PACKAGE}.connector.scheduler.store_plan",
        f"{PACKAGE}.connector.scheduler.offload_scheduler",
    )
    graph[plan] = graph[plan] | {sched}  # as it was before issue 46 (under TYPE_CHECKING)
    assert circles(graph, _packages()) == [[sched, plan]]


def test_relative_imports_resolve_inside_their_package(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text("from . import ring\nfrom ..core import spec\n")
    assert imports_of(f"{PACKAGE}.backends.nixl_peer.mod", module) >= {
        f"{PACKAGE}.backends.nixl_peer.ring",
        f"{PACKAGE}.backends.core.spec",
    }


def test_no_module_under_tests_imports_a_test_module() -> None:
    graph = graph_of_tests()
    assert "tests/conftest.py" in graph and "tests/unit/test_page_decoder_fuzz.py" in graph
    assert imported_test_modules(graph) == []


def test_the_tests_check_catches_an_imported_test_module(tmp_path: Path) -> None:
    module = tmp_path / "helpers.py"
    module.write_text("import test_a\n\ndef f():\n    from test_b.sub import c\nfrom pytest import test_c\n")
    graph = graph_of_tests()
    graph["tests/unit/helpers.py"] = imports_of("helpers", module)
    graph["tests/unit/test_planner.py"] |= {"test_page_format", "test_page_format.make_page"}
    assert imported_test_modules(graph) == [
        "tests/unit/helpers.py imports test_a",
        "tests/unit/helpers.py imports test_b",
        "tests/unit/test_planner.py imports test_page_format",
    ]


@pytest.mark.parametrize(
    "module",
    [
        f"{PACKAGE}.tools.cli.cache",  # `hybrid-offload cache ...` runs where no engine does
        f"{PACKAGE}.connector.config",  # the cache CLI reads connector configs
        f"{PACKAGE}.connector.scheduler.policy",
    ],
)
def test_modules_that_need_no_vllm_import_none(module: str) -> None:
    """The import contract sees module-level imports; this one what importing really loads (the
    connector package's facade imports vLLM: importing a sibling must not pull it in)."""
    probe = f"import sys, {module}; print(sorted({{'vllm', 'torch'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", module


def test_the_cli_starts_without_vllm_or_torch() -> None:
    """Every ``hybrid-offload`` command builds the whole parser, each benchmark registering its
    flags: ``bench gpu`` importing the data-path harness at module level made every ``cache``
    command import vLLM and torch (10.6 s instead of 0.3 s a call; the cache CLI tests make
    hundreds of calls)."""
    probe = ("import sys; from hybrid_offload.tools.cli.main import build_parser; build_parser(); "
             "print(sorted({'vllm', 'torch'} & set(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def private_names_used(name: str, source: str) -> set[str]:
    """The :data:`PRIVATE_NAMES` a module's source names: as a name, an attribute, an import or
    a string (``getattr(x, "_private")``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(node.module.split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found & PRIVATE_NAMES


def test_private_apis_only_through_the_compat_module() -> None:
    sources = {name: path.read_text() for name, path in _sources().items()}
    assert private_names_used(GATE, sources[GATE]) >= {"_custom_ops", "_collector_to_names", "nixlBind"}
    leaks = {
        name: used
        for name, source in sources.items()
        if name != GATE
        if (used := private_names_used(name, source))
    }
    assert leaks == {}


@pytest.mark.parametrize(
    "source",
    [
        "from vllm import _custom_ops as ops\n",
        "import nixl_meta_utils\n",
        "x = REGISTRY._collector_to_names\n",
        "x = getattr(REGISTRY, '_collector_to_names', {})\n",
        "def f(api):\n    return api.nixlBind.nixlAgentConfig\n",
        "from vllm.v1.attention.backends.cpu_attn import _get_attn_isa\n",
    ],
)
def test_the_private_api_check_catches_a_direct_use(source: str) -> None:
    assert private_names_used("mod", source)
