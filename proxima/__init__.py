"""Proxima: token-granular KV-cache slots for vLLM, and the tools to see that memory."""

# The package version (pyproject.toml reads it from here) and the one vLLM release Proxima is
# built and tested against: the plugin patches vLLM internals that change between releases.
__version__ = "0.1.0"
VLLM_VERSION = "0.26.0"
