"""Proxima: token-granular KV-cache slots for vLLM, and the tools to see that memory."""

__version__ = "0.1.0"
