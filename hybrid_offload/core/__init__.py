"""The pure core: specs, planner, page format, TP shards, model cards, metrics data, secrets.

Imports nothing but the standard library, numpy and xxhash: no vLLM, no torch, no backend, no
connector, no tool (the import contract in ``pyproject.toml`` checks it).
"""
