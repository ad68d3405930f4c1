"""User tools: the ``hybrid-offload`` CLI, benchmarks and the demo. They use the connector as
a user would (through vLLM); nothing below imports them."""
