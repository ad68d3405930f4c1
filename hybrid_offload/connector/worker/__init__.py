"""Worker side of the connector: moves bytes between vLLM's KV cache and the backends.

:class:`~.offload_worker.OffloadWorker` coordinates a load pipeline (:mod:`.load_pipeline`) and a
store pipeline (:mod:`.store_pipeline`) that share a :mod:`.context`; :mod:`.device` is where
CPU and CUDA differ; :mod:`.page_codec`, :mod:`.staging` and :mod:`.state_maps` are the copies
between pages and vLLM's KV cache.
"""
