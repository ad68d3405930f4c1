"""What we know of vLLM's engine: config translation, KV cache layouts, weights identity and
the vLLM plugin patches. Imports the core, never the connector, tools or test harness.

The connector imports vLLM too, at run time only where it must be vLLM's kind of object (the
connector classes vLLM loads, their foreign children, vLLM's metrics and KV event classes:
``tests/unit/test_import_layers.py`` lists them); its scheduler and worker sides name vLLM's
types only for type checking."""
