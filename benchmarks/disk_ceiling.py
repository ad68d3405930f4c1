"""Disk reads against the raw read ceiling of the same files, in one run (issue 41, part 5).

For each page size (128 KiB, 786 KiB, 2 MiB, 12 MiB, each plus a 256-byte page header as real
pages have, so page lengths are 64-byte but not 512-byte multiples), one batch of pages is
stored in a ``layout: segments`` store and in a ``layout: files`` store; then, warm (page
cache) and cold (``drop_tree_cache`` of the contender's tree before each call), these read the
batch, interleaved call by call (the order reversed every other round; medians):

* ``ceiling``: the segment store's segment files read raw, whole, into one preallocated,
  4 KiB-aligned buffer by parallel ``preadv`` of large pieces: each of a few configurations
  (buffered and, cold, ``O_DIRECT``; piece size x threads) is timed, and the ceiling is the
  best median (the most the medium and page cache give);
* ``files raw x4``: the files store's page files, each opened, read whole with one ``preadv``
  and closed, by 4 threads into one buffer (what one file per page can give);
* ``disk[segments] get_into`` and ``disk[files] get_into``: our backend reading the batch into
  caller-owned rows laid out as the engine's staging block (one block, rows back to back, the
  block 64-byte aligned and deliberately not 4 KiB aligned); cold, each is read a second time
  right after (``cold, again``: what the cold read left in the page cache; against the warm
  ceiling);
* with ``--baseline DIR`` (the ``backends/`` folder of an earlier commit, e.g. from
  ``git archive HEAD backends | tar -x -C /tmp/base``): that code's two layouts on the same
  stores, ``before: ...``.

``--aligned``: pages of whole 4 KiB blocks (no header) into 4 KiB-aligned rows, where the
backend reads cold pages with ``O_DIRECT``. Prints whether GPUDirect Storage could run here,
a table (GB/s; ratio to the ceiling of the same mode; for the files layout also to ``files
raw``; with a baseline, ours against it) and writes ``benchmarks/results/<name>.json``.

Usage: ``.venv/bin/python benchmarks/disk_ceiling.py [--out DIR] [--repeats N]
[--sizes 128KiB,...] [--aligned] [--baseline DIR] [--name NAME]`` (about 2 minutes)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybrid_offload.backends import Backend, BackendConfig, create_backend
from hybrid_offload.tools.bench.ceilings import drop_tree_cache
from hybrid_offload.tools.bench.common import format_table, machine

HEADER = 256  # a real page's header rounds it off 512-byte multiples (``--aligned``: none)
SIZES = {"128KiB": 128 << 10, "786KiB": 786 << 10, "2MiB": 2 << 20, "12MiB": 12 << 20}
CALL_BYTES = 192 << 20  # about this many bytes per call (at least 16 pages, at most 256)
#: ceiling configurations: (O_DIRECT, piece bytes (0: the files cut in ``threads`` equal pieces), threads)
CEILINGS = [
    (False, 0, 2),
    (False, 0, 4),
    (False, 4 << 20, 4),
    (True, 0, 4),
    (True, 4 << 20, 4),
    (True, 16 << 20, 8),
]
_ALIGN = 4096


def aligned(nbytes: int) -> memoryview:
    """A page-aligned anonymous buffer of ``nbytes`` (at least one page), faulted in."""
    buf = mmap.mmap(-1, max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN))
    view = memoryview(buf)
    for i in range(0, len(buf), _ALIGN):
        view[i] = 0
    return view


def read_pieces(paths: list[str], into: memoryview, direct: bool, piece: int, threads: int) -> int:
    """Read the files ``paths`` whole, back to back, into ``into`` (4 KiB aligned) with
    ``preadv`` of at most ``piece`` bytes on ``threads`` threads; the bytes read."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(p, flags) for p in paths]
    if not piece:
        piece = -(-sum(os.fstat(fd).st_size for fd in fds) // threads // _ALIGN) * _ALIGN
    try:
        jobs, at = [], 0
        for fd in fds:
            size = os.fstat(fd).st_size
            for off in range(0, size, piece):
                n = min(piece, size - off)
                # O_DIRECT lengths are whole blocks: the last piece reads into the slack after it
                span = -(-n // _ALIGN) * _ALIGN if direct else n
                jobs.append((fd, off, at, n, span))
                at += span
        assert at <= into.nbytes

        def one(job: tuple[int, int, int, int, int]) -> int:
            fd, off, at, n, span = job
            got = 0
            while got < n:
                k = os.preadv(fd, [into[at + got : at + span]], off + got)
                if k == 0:
                    break
                got += k
            return min(got, n)

        if threads == 1:
            return sum(map(one, jobs))
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(one, jobs))
    finally:
        for fd in fds:
            os.close(fd)


def read_files(paths: list[str], into: memoryview, offsets: list[int], threads: int) -> int:
    """Each page file opened, read whole with one ``preadv`` into ``into[offset:]``, closed."""

    def one(i: int) -> int:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return os.preadv(fd, [into[offsets[i] : offsets[i] + size]], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, range(len(paths))))


class Case:
    """One page size: both stores, the buffers, the contenders."""

    def __init__(
        self, work: Path, label: str, size: int, aligned_rows: bool = False, baseline: Any = None
    ) -> None:
        self.label, self.size = label, size + (0 if aligned_rows else HEADER)
        self.batch = max(16, min(256, CALL_BYTES // self.size))
        self.nbytes = self.size * self.batch
        self.keys = [f"5eed0041-{i:032x}" for i in range(self.batch)]
        pages = [os.urandom(self.size) for _ in range(self.batch)]
        self.backends: dict[str, Backend] = {}
        self.roots: dict[str, str] = {}
        for layout in ("segments", "files"):
            root = work / f"{label}-{layout}"
            config = BackendConfig(
                "disk", f"ceiling-{layout}", 1 << 40, options={"path": str(root), "layout": layout}
            )
            backend = create_backend(config)
            assert backend.put_batch(list(zip(self.keys, pages, strict=True))) == [True] * self.batch
            self.backends[layout], self.roots[layout] = backend, str(root)
        self.before: dict[str, Any] = {}
        if baseline is not None:  # the earlier code on the same stores
            for layout, cls in (("segments", baseline.SegmentDiskBackend), ("files", baseline.DiskBackend)):
                options = {"path": self.roots[layout], "layout": layout}
                self.before[layout] = cls(
                    baseline.BackendConfig("disk", f"before-{layout}", 1 << 40, options=options)
                )
        seg_dir = Path(self.roots["segments"]) / "segments"
        self.segments = sorted(str(p) for p in seg_dir.glob("*.seg"))
        self.page_files = [
            str(Path(self.roots["files"]) / k.split("-")[0] / k.split("-")[1][:2] / f"{k.split('-')[1]}.page")
            for k in self.keys
        ]
        seg_bytes = sum(os.path.getsize(p) for p in self.segments)
        assert seg_bytes == self.nbytes, (seg_bytes, self.nbytes)
        # the raw buffer: room for every piece rounded up to whole blocks
        self.raw = aligned(self.nbytes + (len(self.segments) * (self.nbytes // (4 << 20) + 2)) * _ALIGN)
        # staging block as the engine lays it out: 64-byte aligned, not 4 KiB aligned (or, with
        # ``aligned_rows``, 4 KiB aligned rows of whole blocks: what O_DIRECT needs)
        self.block = aligned(self.nbytes + _ALIGN)
        start = 0 if aligned_rows else 64
        rows = self.block[start : start + self.nbytes]
        self.rows = [rows[i * self.size : (i + 1) * self.size] for i in range(self.batch)]
        self.expected = pages

    def contenders(self, cold: bool) -> dict[str, tuple[Callable[[], int], str]]:
        out: dict[str, tuple[Callable[[], int], str]] = {}
        seg_root, files_root = self.roots["segments"], self.roots["files"]
        for direct, piece, threads in CEILINGS:
            if direct and not cold:
                continue  # O_DIRECT bypasses the page cache: no warm ceiling
            cut = f"{piece >> 20}MiB" if piece else f"1/{threads}"
            name = f"raw {'O_DIRECT' if direct else 'buffered'} {cut} x{threads}"
            out[name] = (
                lambda d=direct, p=piece, t=threads: read_pieces(self.segments, self.raw, d, p, t),
                seg_root,
            )
        offsets = [i * self.size for i in range(self.batch)]
        out["files raw x4"] = (lambda: read_files(self.page_files, self.raw, offsets, 4), files_root)
        for layout in ("segments", "files"):
            for prefix, backends in (("", self.backends), ("before: ", self.before)):
                if layout in backends:
                    out[f"{prefix}disk[{layout}] get_into"] = (
                        lambda b=backends[layout]: sum(n or 0 for n in b.get_into(self.keys, self.rows)),
                        self.roots[layout],
                    )
        return out

    def check(self) -> None:
        """Both layouts' get_into read back exactly the bytes stored."""
        for layout, backend in [*self.backends.items(), *self.before.items()]:
            got = backend.get_into(self.keys, self.rows)
            assert got == [self.size] * self.batch, (layout, got)
            for row, page in zip(self.rows, self.expected, strict=True):
                assert row == page, layout

    def close(self) -> None:
        for backend in [*self.backends.values(), *self.before.values()]:
            backend.close()


def timed(case: Case, name: str, run: Callable[[], int]) -> float:
    """GB/s of one call."""
    began = time.perf_counter()
    got = run()
    took = time.perf_counter() - began
    if got < case.nbytes:
        raise RuntimeError(f"{name}: read {got} of {case.nbytes} bytes")
    return case.nbytes / took / 1e9


def measure(case: Case, repeats: int, cold: bool) -> dict[str, list[float]]:
    """GB/s of every contender, ``repeats`` rounds, contenders interleaved within each round
    (the order reversed every other round). Cold: the contender's tree dropped from the page
    cache before its call, and our get_into read again right after (``<name> again``: what a
    cold read left in the page cache)."""
    contenders = case.contenders(cold)
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(repeats + (0 if cold else 1)):
        order = list(contenders.items())
        if r % 2:
            order.reverse()
        for name, (run, where) in order:
            if cold:
                drop_tree_cache(where)
            rate = timed(case, name, run)
            if cold or r:  # the first warm round only warms
                rates[name].append(rate)
            if cold and name.endswith("get_into"):
                rates.setdefault(f"{name} again", []).append(timed(case, name, run))
    return rates


def rows_of(case: Case, mode: str, rates: dict[str, list[float]]) -> list[dict[str, Any]]:
    medians = {name: statistics.median(v) for name, v in rates.items()}
    raw = {name: m for name, m in medians.items() if name.startswith("raw ")}
    best = max(raw, key=lambda n: raw[n])
    ceiling = raw[best]
    out = [
        {"page": case.label, "page_bytes": case.size, "batch": case.batch, "mode": mode,
         "engine": f"ceiling ({best[4:]})", "gbps": ceiling, "vs_ceiling": 1.0,
         "samples": rates[best]}
    ]  # fmt: skip
    for name in raw:
        if name != best:
            out.append({"page": case.label, "page_bytes": case.size, "batch": case.batch, "mode": mode,
                        "engine": name, "gbps": raw[name], "vs_ceiling": raw[name] / ceiling,
                        "samples": rates[name]})  # fmt: skip
    files_raw = medians["files raw x4"]
    ours = [name for name in rates if name.endswith("get_into")]
    for name in ["files raw x4", *ours]:
        row = {"page": case.label, "page_bytes": case.size, "batch": case.batch, "mode": mode,
               "engine": name, "gbps": medians[name], "vs_ceiling": medians[name] / ceiling,
               "samples": rates[name]}  # fmt: skip
        if name.endswith("disk[files] get_into"):
            row["vs_files_raw"] = medians[name] / files_raw
        if f"before: {name}" in medians:
            row["vs_before"] = medians[name] / medians[f"before: {name}"]
        out.append(row)
    for name in ours:
        if f"{name} again" in rates:  # vs_ceiling: against the warm ceiling (main adds it)
            again = f"{name} again"
            row = {"page": case.label, "page_bytes": case.size, "batch": case.batch, "mode": "cold, again",
                   "engine": name, "gbps": medians[again], "samples": rates[again]}  # fmt: skip
            if f"before: {name} again" in medians:
                row["vs_before"] = medians[f"{name} again"] / medians[f"before: {name} again"]
            out.append(row)
    return out


def load_baseline(path: Path) -> Any:
    """The ``backends`` package at ``path`` (an earlier commit's), as ``baseline_backends``,
    with its disk classes and ``BackendConfig`` (its registry would import ours)."""
    spec = importlib.util.spec_from_file_location(
        "baseline_backends", path / "__init__.py", submodule_search_locations=[str(path)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["baseline_backends"] = package
    spec.loader.exec_module(package)
    from baseline_backends.disk import DiskBackend  # type: ignore[import-not-found]

    # the segment layout's class, wherever that commit kept its module (a folder since issue 46)
    package.DiskBackend = DiskBackend
    package.SegmentDiskBackend = DiskBackend.implementation({"layout": "segments"})
    return package


def gds() -> dict[str, Any]:
    """What GPUDirect Storage would need here: a GPU, the nvidia-fs driver, libcufile."""
    import ctypes.util
    import glob

    found = {
        "gpus": sorted(glob.glob("/dev/nvidia[0-9]*")),
        "nvidia_fs_driver": os.path.exists("/proc/driver/nvidia-fs")
        or os.path.exists("/sys/module/nvidia_fs"),
        "libcufile": ctypes.util.find_library("cufile"),
    }
    found["available"] = bool(found["gpus"] and found["nvidia_fs_driver"] and found["libcufile"])
    return found


def gds_line() -> str:
    found = gds()
    if found["available"]:
        return "GPUDirect Storage: nvidia-fs, libcufile and a GPU are here (not measured by this script)"
    needs = [("a GPU", "gpus"), ("the nvidia-fs driver", "nvidia_fs_driver"), ("libcufile", "libcufile")]
    missing = [what for what, name in needs if not found[name]]
    return f"GPUDirect Storage: not on this machine (missing: {', '.join(missing)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per mode (default 5)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"page sizes, of {', '.join(SIZES)}")
    parser.add_argument("--name", default="disk_ceiling", help="results file name (without .json)")
    parser.add_argument(
        "--aligned",
        action="store_true",
        help="pages of whole 4 KiB blocks (no header) into 4 KiB-aligned rows",
    )
    parser.add_argument(
        "--baseline", type=Path, help="an earlier commit's backends/ folder, read side by side"
    )
    args = parser.parse_args()
    baseline = load_baseline(args.baseline.resolve()) if args.baseline else None
    print(gds_line(), flush=True)
    load_before = os.getloadavg()
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp")) as work:
        for label in args.sizes.split(","):
            case = Case(Path(work), label, SIZES[label], args.aligned, baseline)
            try:
                case.check()
                for mode in ("warm", "cold"):
                    rows += rows_of(case, mode, measure(case, args.repeats, mode == "cold"))
                warm = next(r["gbps"] for r in rows if r["page"] == label and r["mode"] == "warm")
                for row in rows:
                    if row["page"] == label and row["mode"] == "cold, again":
                        row["vs_ceiling"] = row["gbps"] / warm
            finally:
                case.close()
            columns = ["page", "batch", "mode", "engine", "gbps", "vs_ceiling", "vs_files_raw", "vs_before"]
            print(format_table([r for r in rows if r["page"] == label], columns), flush=True)
    load_after = os.getloadavg()
    doc = {
        "bench": "disk_ceiling",
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "repeats": args.repeats,
        "wall_s": time.monotonic() - began,
        "aligned": args.aligned,
        "baseline": str(args.baseline) if args.baseline else None,
        "gpudirect_storage": gds(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path} (load average {load_before[0]:.2f} -> {load_after[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
