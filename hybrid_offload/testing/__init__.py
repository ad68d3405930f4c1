"""Test harness shared by the tests, benchmarks and the demo: tiny models, the engine session
runner and the service processes (redis-server, cache peer, vLLM server; :mod:`.services`), vLLM's
GPU cache layouts (:mod:`.vllm_layouts`), and the kit a backend's tests use, ours or a third
party's: the contract suite (:mod:`.backend_contract`, the one module that imports pytest), its
keys and pages (:mod:`.backend_pages`), faults in any backend (:mod:`.faulty`) and the one
``wait_until`` (:mod:`.deadlines`). Imports anything but the tools."""
