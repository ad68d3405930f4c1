"""Imported by every Python process the tests start (tests/conftest.py puts this folder first on
``PYTHONPATH``): at exit the process skips the interpreter's last cyclic garbage collection.

With vLLM, torch and transformers loaded that collection takes 1.5-2.5 s in each of an engine's
processes (EngineCore, each worker), one after the other while the engine shuts down: ~3 s of
the ~4.6 s a multi-process engine took to stop (measured with ``py-spy dump``: the processes sat
in ``gc_collect_main`` during finalization; vLLM freezes the heap the same way on ROCm).
Registered first, the handler runs after every other ``atexit`` handler; everything it leaves
uncollected is memory the process frees by exiting. What users run is unchanged: engines still
stop through vLLM's own shutdown, which flushes the connector's stores before any of this.
pytest's own worker processes collect as usual (frozen, they would end the run's output with
nanobind's report of triton's objects left unfreed).
"""

import atexit
import gc
import sys


def _freeze_unless_pytest() -> None:
    if "_pytest" not in sys.modules:
        gc.freeze()


atexit.register(_freeze_unless_pytest)
