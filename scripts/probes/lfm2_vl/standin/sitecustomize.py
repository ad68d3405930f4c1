"""Probe-only: install the LFM2-VL torchvision stand-in in every process (engine, registry
inspection subprocess) started with this folder on PYTHONPATH; keeps the system sitecustomize."""

try:
    import apport_python_hook  # what /usr/lib/python3.11/sitecustomize.py does
except ImportError:
    pass
else:
    apport_python_hook.install()
try:
    import tv_standin

    tv_standin.install()
except Exception as exc:  # never break interpreter start-up
    import sys

    print(f"lfm2_vl probe stand-in not installed: {exc!r}", file=sys.stderr)

import os as _os

if _os.environ.get("LFM2_PROBE_DIGEST_FIX") == "1":
    # Probe-only workaround for a product bug (hybrid_offload/engine/multimodal.py, _feed_nested):
    # ``t.view(torch.uint8)`` raises "self.dim() cannot be 0 to view Long as Byte (different
    # element sizes)" on a 0-dim tensor; LFM2-VL's per-image ``num_patches`` (a batched field) is one.
    # Fix: view the flattened tensor (shape is fed just before, so the digest stays unambiguous).
    try:
        from hybrid_offload.engine import multimodal as _mm

        def _feed_nested(h, data):
            import torch

            if isinstance(data, torch.Tensor):
                t = data.detach().to("cpu").contiguous()
                _mm._feed(h, f"T{t.dtype}{tuple(t.shape)}".encode())
                _mm._feed(h, t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
                return True
            if isinstance(data, list | tuple):
                _mm._feed(h, f"L{len(data)}".encode())
                return all(_feed_nested(h, part) for part in data)
            return False

        _mm._feed_nested = _feed_nested
    except Exception as exc:
        import sys

        print(f"lfm2_vl probe digest fix not installed: {exc!r}", file=sys.stderr)
