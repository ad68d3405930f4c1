"""Disk backend trust (issue 14, H2 and M7): which root it accepts, that nothing below the root
is followed out of it, that pages of others are never read, where shipped configs put pages,
and that capacity holds across writing processes.

We run as root: "another owner" is uid 65534 (nobody); "the process owner" is uid 0.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from disk_pages import make_disk, page_path

from hybrid_offload.backends import BackendConfigError, BackendUnavailableError, create_backend
from hybrid_offload.backends.disk import DiskBackend
from hybrid_offload.connector.config import parse_offload_config
from hybrid_offload.testing.backend_pages import key, page

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parents[1] / "configs"
NOBODY = 65534


def page_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*.page"))


# -- the root -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o1777])
def test_root_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(BackendConfigError, match=r"option 'path'.*writable by group or others"):
        make_disk(root)


def test_root_of_another_owner_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(BackendConfigError, match=r"option 'path'.*owned by uid 65534"):
        make_disk(root)


def test_root_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "store").symlink_to(real)
    with pytest.raises(BackendConfigError, match=r"option 'path'.*symbolic link"):
        make_disk(tmp_path / "store")


def test_root_made_unsafe_after_start_makes_the_backend_unavailable(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make_disk(root) as backend:
        assert backend.put_batch([(key(1), page(1, 100))]) == [True]
        root.chmod(0o777)
        with pytest.raises(BackendUnavailableError, match="writable by group or others"):
            backend.put_batch([(key(2), page(2, 100))])
        with pytest.raises(BackendUnavailableError, match="writable by group or others"):
            backend.get_batch([key(1)])
        root.chmod(0o700)
        assert backend.get_batch([key(1)]) == [page(1, 100)]


def test_missing_root_is_created_private(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with make_disk(tmp_path / "a" / "store"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "store").stat().st_mode) == 0o700


# -- below the root ---------------------------------------------------------------------------


def test_put_through_a_symlinked_directory_does_not_leave_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    with make_disk(root) as backend:
        k = key(1)
        namespace_dir = page_path(root, k).parent.parent
        namespace_dir.symlink_to(outside, target_is_directory=True)
        assert backend.put_batch([(k, page(1, 100))]) == [False]
        assert backend.stats.errors == 1
        assert list(outside.rglob("*")) == []
        namespace_dir.unlink()
        fanout = page_path(root, k).parent
        fanout.parent.mkdir(mode=0o700)
        fanout.symlink_to(outside, target_is_directory=True)
        assert backend.put_batch([(k, page(1, 100))]) == [False]
        assert list(outside.rglob("*")) == []


def test_page_behind_a_symlinked_directory_is_never_read(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    k = key(2)
    with make_disk(outside) as elsewhere:  # a real page, in a tree outside the root
        elsewhere.put_batch([(k, page(2, 100))])
    with make_disk(root) as backend:
        namespace = k.split("-")[0]
        (root / namespace).symlink_to(outside / namespace, target_is_directory=True)
        assert backend.contains_batch([k]) == [False]
        assert backend.get_batch([k]) == [None]
        assert backend.get_into([k], [memoryview(bytearray(200))]) == [None]
        assert list(backend.scan()) == []
        assert backend.used_bytes() == 0
    with make_disk(root) as reopened:  # the start-up scan does not follow it either
        assert reopened.used_bytes() == 0


def test_page_of_another_owner_is_a_miss_never_read(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make_disk(root) as backend:
        backend.put_batch([(key(1), page(1, 100)), (key(2), page(2, 100))])
        os.chown(page_path(root, key(1)), NOBODY, NOBODY)
        errors = backend.stats.errors
        assert backend.get_batch([key(1), key(2)]) == [None, page(2, 100)]
        assert backend.get_into([key(1)], [memoryview(bytearray(100))]) == [None]
        assert backend.stats.errors == errors + 2
        assert backend.contains_batch([key(1), key(2)]) == [False, True]
        assert [p.key for p in backend.scan()] == [key(2)]
        assert backend.delete_batch([key(1)]) == 0  # not ours: left alone
    assert page_path(root, key(1)).exists()
    with make_disk(root) as reopened:
        assert reopened.used_bytes() == 100


def test_page_writable_by_others_or_oversized_is_a_miss(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make_disk(root, capacity=1000) as backend:
        backend.put_batch([(key(1), page(1, 100)), (key(2), page(2, 100))])
        page_path(root, key(1)).chmod(0o666)
        with open(page_path(root, key(2)), "ab") as grow:  # larger than the capacity
            grow.write(b"\0" * 2000)
        errors = backend.stats.errors
        assert backend.get_batch([key(1), key(2)]) == [None, None]
        assert backend.stats.errors == errors + 2


def test_fifo_in_place_of_a_page_is_a_miss_without_blocking(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with make_disk(root) as backend:
        path = page_path(root, key(3))
        path.parent.mkdir(parents=True, mode=0o700)
        os.mkfifo(path, 0o600)
        assert backend.get_batch([key(3)]) == [None]
        assert backend.contains_batch([key(3)]) == [False]


# -- the path option and the shipped configs --------------------------------------------------


def test_path_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    assert DiskBackend.validate_options({"path": "~/pages"})["path"] == str(tmp_path / "home" / "pages")
    with make_disk("~/pages") as backend:
        backend.put_batch([(key(1), page(1, 10))])
    assert page_path(tmp_path / "home" / "pages", key(1)).is_file()


@pytest.mark.parametrize("xdg", ["set", "unset", "empty", "relative"])
def test_path_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, xdg: str) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    values = {"set": str(tmp_path / "xdg"), "empty": "", "relative": "rel/cache"}
    if xdg == "unset":
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", values[xdg])
    want = (tmp_path / "xdg" if xdg == "set" else home / ".cache") / "hybrid-offload"
    for spelling in ("$XDG_CACHE_HOME/hybrid-offload", "${XDG_CACHE_HOME}/hybrid-offload"):
        assert DiskBackend.validate_options({"path": spelling})["path"] == str(want)


@pytest.mark.parametrize("path", ["$HOME/cache", "/var/$USER/cache", "~nosuchuser-hybrid/cache"])
def test_path_other_expansions_refused(path: str) -> None:
    with pytest.raises(BackendConfigError, match="option 'path'"):
        DiskBackend.validate_options({"path": path})


def _disk_entries(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    cfg = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return [b for b in cfg["kv_connector_extra_config"]["backends"] if b["type"] == "disk"]


@pytest.mark.parametrize("name", ["disk.json", "disk.yaml", "cpu_disk.json", "cpu_disk.yaml"])
def test_shipped_disk_configs_use_a_private_per_user_directory(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    (entry,) = _disk_entries(CONFIGS / name)
    assert not entry["path"].startswith(("/tmp", "/var/tmp", "/dev/shm")), entry["path"]
    parsed = parse_offload_config({"backends": [entry]}).backends[0].backend
    root = tmp_path / "home" / ".cache" / "hybrid-offload"
    assert parsed.options["path"] == str(root)
    with create_backend(parsed):
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert parse_offload_config({"backends": [entry]}).backends[0].backend.options["path"] == str(
        tmp_path / "xdg" / "hybrid-offload"
    )


# -- capacity across writing processes (M7) ---------------------------------------------------

# Waits for a line on stdin (so both writers have opened the directory before either puts),
# then puts ``count`` pages of ``size`` bytes, ``batch`` at a time, checking nothing.
_WRITER = """
import sys
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.backends import BackendConfig, create_backend
root, capacity, first, count, size, batch = sys.argv[1], *map(int, sys.argv[2:7])
backend = create_backend(BackendConfig("disk", "writer", capacity, options={"path": root}))
print("ready", flush=True)
sys.stdin.readline()
for start in range(first, first + count, batch):
    ids = range(start, min(start + batch, first + count))
    assert backend.put_batch([(key(i), page(i, size)) for i in ids]) == [True] * len(ids)
print(backend.stats.evictions, flush=True)
backend.close()
"""


def _writers(root: Path, capacity: int, count: int, size: int, batch: int, n: int = 2) -> list[str]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(root),
             *map(str, (capacity, w * count, count, size, batch))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for w in range(n)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.communicate()[1]
    for proc in procs:  # go: both at once
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outs.append(out)
    return outs


def test_capacity_holds_across_two_writing_processes(tmp_path: Path) -> None:
    """Bound: page files never exceed ``capacity_bytes`` (renames and evictions of all writers
    are serialized by one lock); only unfinished temp files of in-flight batches come on top."""
    root, size, capacity = tmp_path / "store", 1000, 10_000
    make_disk(root, capacity).close()
    _writers(root, capacity, count=60, size=size, batch=3)
    assert page_bytes(root) <= capacity
    assert usage_record(root) == page_bytes(root)
    assert list(root.rglob(".*.tmp")) == []
    with make_disk(root, capacity) as reader:
        assert reader.used_bytes() == page_bytes(root) >= capacity - 3 * size


def test_single_writer_puts_rescan_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One writer in a full cache evicts from its own index: the tree is walked once (start)."""
    walks: list[str] = []
    real_walk = DiskBackend._walk

    def counting_walk(self: DiskBackend, prefix: str, *args: Any, **kwargs: Any) -> Any:
        walks.append(prefix)
        return real_walk(self, prefix, *args, **kwargs)

    monkeypatch.setattr(DiskBackend, "_walk", counting_walk)
    with make_disk(tmp_path / "store", 10_000) as backend:
        for i in range(100):
            assert backend.put_batch([(key(i), page(i, 1000))]) == [True]
        assert backend.stats.evictions == 90
        assert backend.used_bytes() == 10_000 == page_bytes(tmp_path / "store")
    assert len(walks) == 1


def test_a_writer_evicts_pages_another_process_wrote(tmp_path: Path) -> None:
    """A process that opened the directory before another filled it still keeps the bound."""
    root, capacity = tmp_path / "store", 10_000
    with make_disk(root, capacity) as early:
        _writers(root, capacity, count=10, size=1000, batch=5, n=1)  # fills it
        assert early.put_batch([(key(100), page(100, 3000))]) == [True]
        assert page_bytes(root) <= capacity
        assert early.contains_batch([key(100)]) == [True]
        assert early.stats.evictions >= 3


def test_usage_record_reset_at_start_after_pages_vanish(tmp_path: Path) -> None:
    """Pages removed behind the backends' back (rm) leave the shared record too high; the
    start-up scan of the next process resets it, so it does not evict more than needed."""
    root, capacity = tmp_path / "store", 10_000
    with make_disk(root, capacity) as backend:
        backend.put_batch([(key(i), page(i, 1000)) for i in range(10)])
    for path in list(root.rglob("*.page"))[:5]:
        path.unlink()
    with make_disk(root, capacity) as writer:  # the start-up scan resets the record
        assert writer.put_batch([(key(i), page(i, 1000)) for i in range(20, 25)]) == [True] * 5
        assert writer.stats.evictions == 0
    assert page_bytes(root) == 10_000


def test_usage_record_kept_exact_by_puts_evictions_and_deletes(tmp_path: Path) -> None:
    """``.usage`` holds the page bytes under the root after every put, eviction and delete;
    a root that never held a page has none."""
    root, capacity = tmp_path / "store", 10_000
    with make_disk(root, capacity) as backend:
        assert not (root / ".usage").exists()
        backend.put_batch([(key(i), page(i, 1000 + i)) for i in range(12)])
        assert usage_record(root) == page_bytes(root) <= capacity
        backend.put_batch([(key(3), page(3, 10))])  # a re-put replaces the old page's bytes
        assert usage_record(root) == page_bytes(root)
        backend.delete_batch([key(3), key(11), key(99)])
        assert usage_record(root) == page_bytes(root)
        assert len(list(backend.scan())) == len(list(root.rglob("*.page")))  # not a page


def usage_record(root: Path) -> int:
    text = (root / ".usage").read_text()
    assert text.endswith("\n") and len(text) == 21, text
    return int(text)


@pytest.mark.parametrize("damage", ["garbage", "negative", "empty", "removed", "too_low", "too_high"])
def test_damaged_usage_record_is_recounted_or_reset_at_start(tmp_path: Path, damage: str) -> None:
    root, capacity = tmp_path / "store", 10_000
    with make_disk(root, capacity) as backend:
        backend.put_batch([(key(i), page(i, 1000)) for i in range(8)])
        record = root / ".usage"
        if damage == "removed":
            record.unlink()
        elif damage in ("garbage", "negative", "empty"):
            record.write_text({"garbage": "x" * 500, "negative": "-5\n", "empty": ""}[damage])
        if damage in ("garbage", "negative", "empty", "removed"):  # recounted by the next put
            assert backend.put_batch([(key(i), page(i, 1000)) for i in range(8, 12)]) == [True] * 4
            assert page_bytes(root) == usage_record(root) == capacity
            assert backend.stats.evictions == 2
            return
    record.write_text(f"{0 if damage == 'too_low' else 10**9:020d}\n")
    with make_disk(root, capacity) as reopened:  # the start-up scan resets it
        assert usage_record(root) == 8000
        assert reopened.put_batch([(key(i), page(i, 1000)) for i in range(8, 12)]) == [True] * 4
        assert reopened.stats.evictions == 2
        assert page_bytes(root) == usage_record(root) == capacity


def test_crash_between_record_and_rename_leaves_the_record_high_not_low(tmp_path: Path) -> None:
    """The record is raised before the rename: a writer dying in between leaves it too high
    (the bound still holds); the next start recounts it."""
    root = tmp_path / "store"
    with make_disk(root) as backend:
        backend.put_batch([(key(0), page(0, 1000))])
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHER, str(root)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    assert page_bytes(root) == 1000
    assert usage_record(root) == 3000  # 1000 + the page that never arrived
    with make_disk(root):
        assert usage_record(root) == 1000


_CRASHER = """
import os, sys
from hybrid_offload.testing.backend_pages import key, page
from hybrid_offload.backends import BackendConfig, create_backend
backend = create_backend(BackendConfig("disk", "crasher", 1 << 30, options={"path": sys.argv[1]}))
os.replace = lambda *args, **kwargs: os._exit(3)  # die after the record is raised
backend.put_batch([(key(1), page(1, 2000))])
"""


@pytest.mark.parametrize(
    "kind", ["symlink", "other_owner", "group_writable", "fifo", "directory", "hardlink"]
)
def test_untrusted_usage_record_refused(tmp_path: Path, kind: str) -> None:
    """A ``.usage`` this process cannot trust: refused at start (naming ``path``), and makes a
    running backend unavailable for puts and deletes; it is never written through."""
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    record, target = root / ".usage", tmp_path / "target"
    target.write_text("keep me")

    def plant() -> None:
        if kind == "symlink":
            record.symlink_to(target)
        elif kind == "hardlink":
            os.link(target, record)
        elif kind == "fifo":
            os.mkfifo(record, 0o600)
        elif kind == "directory":
            record.mkdir()
        else:
            record.write_text(f"{0:020d}\n")
            if kind == "other_owner":
                os.chown(record, NOBODY, NOBODY)
            else:
                record.chmod(0o660)

    plant()
    with pytest.raises(BackendConfigError, match=r"option 'path'.*\.usage"):
        make_disk(root)
    (record.rmdir if kind == "directory" else record.unlink)()
    with make_disk(root) as backend:
        assert backend.put_batch([(key(1), page(1, 100))]) == [True]
        record.unlink()
        plant()
        with pytest.raises(BackendUnavailableError, match=r"\.usage"):
            backend.put_batch([(key(2), page(2, 100))])
        with pytest.raises(BackendUnavailableError, match=r"\.usage"):
            backend.delete_batch([key(1)])
        assert backend.get_batch([key(1)]) == [page(1, 100)]  # reads go on
    assert target.read_text() == "keep me"
    assert list(root.rglob(".*.tmp")) == []
