"""The processes the tests start skip the last garbage collection at exit
(``tests/exit_without_gc``): its ``sitecustomize`` is the one a child imports, and the heap is
frozen by the time the child's own ``atexit`` handlers have run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = """
import atexit, gc, sitecustomize
print(sitecustomize.__file__)
atexit.register(lambda: print("frozen before" if gc.get_freeze_count() else "not frozen before"))
"""


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=60).stdout  # fmt: skip


def test_a_child_process_freezes_its_heap_at_exit_after_its_own_handlers() -> None:
    where, when = run(CHILD).split("\n")[:2]
    assert Path(where) == Path(__file__).parents[1] / "exit_without_gc" / "sitecustomize.py"
    assert when == "not frozen before"  # the child's own handlers run first, on a live heap


def test_the_handler_freezes_the_heap() -> None:
    check = "import atexit, gc, sitecustomize\natexit._run_exitfuncs()\nprint(gc.get_freeze_count() > 0)"
    assert run(check).strip() == "True"
