"""Attention over a per-token slot table.

Two implementations of one contract:

- ``proxima.engine.attention.reference`` (``slot_attention_torch``) and ``slot_rows``
  (``write_kv``): pure torch. It is the CPU production path and the oracle the Triton kernels
  are tested against.
- ``proxima.engine.attention.triton_attention`` (``slot_attention_triton``) and
  ``triton_write_kv`` (``write_kv_triton``): Triton kernels and their launchers, compiled ahead of
  serving by ``warmup``. Imported on demand, so this package imports without Triton.
"""
