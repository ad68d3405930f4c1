"""What GPUDirect Storage the machine offers: cuFile's driver, the nvidia-fs module, and a
file read through cuFile into GPU memory against the path we use (read into pinned memory,
one copy to the device). Torch and ctypes only; prints one JSON object. Run by
``scripts/gpu_check.sh`` on the GPU machine."""

from __future__ import annotations

import ctypes
import glob
import json
import os
import sys
import time


def _libcufile() -> str | None:
    for root in sys.path:
        found = glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libcufile.so*"))
        found += glob.glob(os.path.join(root, "nvidia", "cufile", "lib", "libcufile.so*"))
        if found:
            return sorted(found)[0]
    for pattern in ("/usr/local/cuda*/lib64/libcufile.so*", "/usr/lib/x86_64-linux-gnu/libcufile.so*"):
        found = glob.glob(pattern)
        if found:
            return sorted(found)[0]
    return None


class _Error(ctypes.Structure):
    _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]


def main() -> None:
    out: dict[str, object] = {
        "nvidia_fs_devices": sorted(glob.glob("/dev/nvidia-fs*")),
        "nvidia_fs_proc": os.path.exists("/proc/driver/nvidia-fs"),
        "gdscheck": sorted(glob.glob("/usr/local/cuda*/gds/tools/gdscheck*")),
    }
    path = _libcufile()
    out["libcufile"] = path
    if path is None:
        print(json.dumps(out))
        return
    lib = ctypes.CDLL(path)
    lib.cuFileDriverOpen.restype = _Error
    err = lib.cuFileDriverOpen()
    out["driver_open"] = {"err": err.err, "cu_err": err.cu_err}
    import torch

    nbytes = 256 << 20
    name = os.path.join(os.environ.get("GDS_PROBE_DIR", "/var/tmp"), "gds_probe.bin")
    with open(name, "wb") as f:
        f.write(os.urandom(1 << 20) * (nbytes >> 20))
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with open(name, "rb", buffering=0) as f:  # the path we use: read (page cache) -> pinned -> device
        start = time.perf_counter()
        f.readinto(memoryview(host.numpy()))
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        out["posix_pinned_h2d_gbps"] = nbytes / (time.perf_counter() - start) / 1e9
    if err.err == 0:
        out.update(_cufile_read(lib, name, dev, nbytes))
    print(json.dumps(out))


def _cufile_read(lib: ctypes.CDLL, name: str, dev: object, nbytes: int) -> dict[str, object]:
    """cuFileRead of the file into ``dev`` (compat mode where nvidia-fs is absent)."""
    import torch

    class Descr(ctypes.Structure):  # CUfileDescr_t: type, union {int fd; void *handle}, fs_ops
        _fields_ = [("type", ctypes.c_int), ("_pad", ctypes.c_int), ("fd", ctypes.c_int),
                    ("_pad2", ctypes.c_int), ("fs_ops", ctypes.c_void_p)]  # fmt: skip

    result: dict[str, object] = {}
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError as exc:  # a file system without direct I/O: cuFile's compat mode may still read
        result["open_o_direct"] = str(exc)
        fd = os.open(name, os.O_RDONLY)
    descr = Descr(type=1, fd=fd)  # CU_FILE_HANDLE_TYPE_OPAQUE_FD
    handle = ctypes.c_void_p()
    lib.cuFileHandleRegister.restype = _Error
    reg = lib.cuFileHandleRegister(ctypes.byref(handle), ctypes.byref(descr))
    result["handle_register"] = {"err": reg.err, "cu_err": reg.cu_err}
    if reg.err != 0:
        os.close(fd)
        return result
    lib.cuFileRead.restype = ctypes.c_ssize_t
    lib.cuFileRead.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long,
                               ctypes.c_long]  # fmt: skip
    start = time.perf_counter()
    got = lib.cuFileRead(handle, ctypes.c_void_p(dev.data_ptr()), nbytes, 0, 0)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    result["cufile_read_bytes"] = got
    result["cufile_read_gbps"] = nbytes / (time.perf_counter() - start) / 1e9 if got > 0 else None
    lib.cuFileHandleDeregister(handle)
    os.close(fd)
    return result


if __name__ == "__main__":
    main()
