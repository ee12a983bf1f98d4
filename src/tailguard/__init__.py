"""tailguard: keep the tail latency of LLM inference services in check."""

__version__ = "0.1.0"
