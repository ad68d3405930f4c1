"""``--dist loadgroup`` that groups (importable as ``xdist_groups``; tests/conftest.py uses it).

The Makefile runs ``pytest -n 2 --dist loadgroup``: tests marked ``xdist_group(name)`` go to one
worker, so that a module fixture they share (an engine run) runs once. pytest-xdist 3.8 tells
its scheduler a test's group by appending ``@name`` to the test's node id in the worker, writing
``item._nodeid``; pytest 9.2 keeps node ids in ``item._id`` (a ``NodeId``) and no longer reads
``_nodeid``, so the suffix is lost and grouped tests are spread one by one as under ``--dist
load``, each worker running the shared fixture again (pytest-dev/pytest-xdist#1386).
:func:`pytest_collection_modifyitems` writes the suffix where pytest reads it; where xdist's own
suffix took effect (older pytest, a fixed xdist), it leaves the node id alone.
``tests/unit/test_xdist_groups.py`` checks that a group runs on one worker.
"""

from __future__ import annotations

from typing import Any

import pytest

try:  # pytest >= 9.2: structured node ids
    from _pytest.nodeid import NodeId
except ImportError:  # pragma: no cover - older pytest reads xdist's ``_nodeid``
    NodeId = None  # type: ignore[assignment,misc]


def group_of(item: pytest.Item) -> str | None:
    """The scope name xdist's loadgroup gives ``item`` (its groups joined), None without one."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
             for m in item.iter_markers("xdist_group")}  # fmt: skip
    return "_".join(sorted(names)) or None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if NodeId is None or not getattr(config.option, "loadgroup", False):
        return  # not an xdist worker of --dist loadgroup
    for item in items:
        group, nodeid = group_of(item), item.nodeid
        if group is None or nodeid.rfind("@") > nodeid.rfind("]"):
            continue  # no group, or xdist's suffix is there
        if isinstance(getattr(item, "_id", None), NodeId):
            item_any: Any = item
            item_any._id = NodeId.parse(f"{nodeid}@{group}")
