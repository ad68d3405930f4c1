"""hybrid-offload: an external KV cache for hybrid (attention + Mamba/GDN) models in vLLM."""

__version__ = "0.1.0"
FORMAT_VERSION = 6
