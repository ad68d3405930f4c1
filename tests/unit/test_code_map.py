"""The code map (docs/code-map.md) is current, and every docstring cross-reference resolves
(issue 46: the map drifted, references named modules that no longer existed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _code_map() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_map", ROOT / "scripts" / "code_map.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("code_map", module)
    spec.loader.exec_module(module)
    return module


def test_the_committed_map_is_current_and_lists_every_module() -> None:
    code_map = _code_map()
    mods = code_map.modules()
    text = code_map.code_map(mods)
    for name, module in mods.items():
        heading = f"## `{name}`" if module.is_package else f"- `{name.rsplit('.', 1)[1]}`:"
        assert heading in text, name
    committed = (ROOT / "docs" / "code-map.md").read_text()
    assert committed == text, "docs/code-map.md is stale: python scripts/code_map.py > docs/code-map.md"


def test_every_docstring_reference_resolves() -> None:
    code_map = _code_map()
    assert code_map.broken_references(code_map.modules()) == []


def test_the_reference_check_catches_stale_names(tmp_path: Path) -> None:
    code_map = _code_map()
    mods = code_map.modules()
    stale = tmp_path / "stale.py"
    stale.write_text(
        '"""See :mod:`.pool`, :class:`~.worker.OffloadWorker`, :func:`~hybrid_offload.core.planner.'
        'interval_stop`, :class:`~.offload_worker.OffloadWorker`, :meth:`StorePlanner.nope` and '
        ':class:`OSError`."""\n'
    )
    name = "hybrid_offload.connector.worker.stale"
    mods[name] = code_map.parse(name, stale)
    broken = [line.split(": ", 1)[1] for line in code_map.broken_references(mods) if "stale.py" in line]
    assert broken == [
        ":class:`~.worker.OffloadWorker`",
        ":func:`~hybrid_offload.core.planner.interval_stop`",
        ":meth:`StorePlanner.nope`",
        ":mod:`.pool`",
    ]
