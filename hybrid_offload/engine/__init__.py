"""The only layer that knows vLLM: config translation, KV cache layouts, weights identity and
the vLLM plugin patches. Imports the core, never the connector, tools or test harness."""
