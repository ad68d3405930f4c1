"""Multimodal items (images, audio, video) and prompt embeddings as vLLM's scheduler holds them.

:func:`item_digest` names an item by what the model reads of it: the processed tensors vLLM's
scheduler-side ``Request`` keeps in ``mm_features[i].data`` (for Qwen-VL: ``pixel_values`` and
``image_grid_thw``), field by field with dtype and shape, so two images are one item only when
the model sees the same thing. vLLM's own ``identifier`` is not that: a client may choose it
(``multi_modal_uuids``, the ``uuid`` of a chat content part), and where vLLM's prefix cache and
processor cache are both off it is a per-process counter (:func:`identifiers_name_content`).
:func:`tensor_digest` names rows of a prompt given as embeddings the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import weakref
from collections.abc import Mapping
from typing import Any

#: digests already taken, by item object identity while it lives (vLLM's processor cache hands
#: the same object to every request carrying that image: a conversation does not hash its images
#: again each turn); items are mappings, unhashable, so not a WeakKeyDictionary
_DIGESTS: dict[int, tuple[weakref.ref[Any], str]] = {}
DIGEST_SIZE = 16
logger = logging.getLogger(__name__)


def item_digest(item: Any) -> str | None:
    """Hex digest of one ``MultiModalKwargsItem`` (a mapping of field name to an element with
    ``.data``: a tensor, or nested lists/tuples of tensors); None where the scheduler holds no
    tensors for it (``mm_processor_cache_type: shm`` passes shared-memory addresses instead)."""
    if not isinstance(item, Mapping) or not item or "address" in item:
        return None
    known = _DIGESTS.get(id(item))
    if known is not None and known[0]() is item:
        return known[1]
    h = hashlib.sha256(b"hybrid-offload multimodal item v1\0")  # SHA-NI where CPUs have it
    try:
        for name in sorted(item):
            _feed(h, str(name).encode())
            if not _feed_nested(h, getattr(item[name], "data", None)):
                return None
    except Exception:  # a field this module cannot read: the item is not named, never a failure
        logger.warning("a multimodal item could not be digested: its request skips the cache", exc_info=True)
        return None
    digest = h.hexdigest()[: 2 * DIGEST_SIZE]
    with contextlib.suppress(TypeError):  # no weak references to it: digested again next time
        key = id(item)
        _DIGESTS[key] = (weakref.ref(item, lambda _ref: _DIGESTS.pop(key, None)), digest)
    return digest


def tensor_digest(tensor: Any) -> str:
    """Hex digest of one tensor (dtype, shape and bytes; read in place where contiguous)."""
    h = hashlib.sha256(b"hybrid-offload tensor v1\0")
    if not _feed_nested(h, tensor):
        raise TypeError(f"tensor_digest: not a tensor: {type(tensor).__name__}")
    return h.hexdigest()[: 2 * DIGEST_SIZE]


def _feed(h: Any, data: Any) -> None:
    """``data`` (bytes, or a contiguous byte array, not copied) with its length in front."""
    h.update(memoryview(data).nbytes.to_bytes(8, "little"))
    h.update(data)


def _feed_nested(h: Any, data: Any) -> bool:
    """Feed a tensor, or a list/tuple of them (nested), with its structure; False for anything
    else (not content this module can name)."""
    import torch

    if isinstance(data, torch.Tensor):
        t = data.detach().to("cpu").contiguous()
        _feed(h, f"T{t.dtype}{tuple(t.shape)}".encode())
        _feed(h, t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # 0-dim too
        return True
    if isinstance(data, list | tuple):
        _feed(h, f"L{len(data)}".encode())
        return all(_feed_nested(h, part) for part in data)
    return False


def identifiers_name_content(vllm_config: Any) -> bool:
    """Whether vLLM's item identifiers are content hashes (or a client's ids): False where
    vLLM's prefix cache and processor cache are both off, when it names items
    ``renderer<n>-mm-<count>-...`` per process, names a restart gives to other images."""
    model = getattr(vllm_config, "model_config", None)
    mm = getattr(model, "multimodal_config", None)
    prefix_caching = bool(getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False))
    return prefix_caching or mm is None or getattr(mm, "mm_processor_cache_gb", 0) != 0
