"""Type-check the package with mypy (`make test` runs it; `make typecheck` alone).

``backends/`` is installed as ``hybrid_offload.backends`` (pyproject's package-dir), which mypy
cannot map from the source tree: this builds a tree of links where it sits inside the package,
runs mypy there with pyproject's ``[tool.mypy]`` on the packages listed in ``CHECKED``, and
prints findings under their paths in the repository. Exit status: mypy's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the packages type-checked (each with its subpackages)
CHECKED = ("core", "router", "compat", "backends", "engine", "connector", "testing", "tools")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="hybrid-offload-typecheck-") as tmp:
        package = Path(tmp) / "hybrid_offload"
        package.mkdir()
        for entry in (ROOT / "hybrid_offload").iterdir():
            if entry.name != "__pycache__":
                (package / entry.name).symlink_to(entry)
        (package / "backends").symlink_to(ROOT / "backends")
        modules = []
        for name in CHECKED:  # compat is a module, the others packages
            modules += ["-m" if name == "compat" else "-p", f"hybrid_offload.{name}"]
        command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                   "--cache-dir", str(ROOT / ".mypy_cache"), *modules]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": ""}
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, env=env)
    out = done.stdout.replace("hybrid_offload/backends/", "backends/") + done.stderr
    sys.stdout.write(out)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
