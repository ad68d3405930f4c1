"""Test harness shared by the tests, benchmarks and the demo: tiny models, the engine session
runner and the service processes (redis-server, cache peer, vLLM server; :mod:`.services`).
Imports anything but the tools."""
