"""Scheduler side of the connector: lookups, load plans and store plans, in vLLM's scheduler
process.

:class:`~.offload_scheduler.OffloadScheduler` asks the backends what they hold, decides what to
load (:mod:`.policy`, :mod:`.coverage`) and what to store (:mod:`.store_plan`), and keeps per
request state (:mod:`.request_state`, :mod:`.pending`, :mod:`.scope`).
"""
