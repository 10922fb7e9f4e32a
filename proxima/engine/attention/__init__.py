"""Attention over a per-token slot table.

Two implementations of one contract:

- ``proxima.engine.attention.reference``: pure torch (``write_kv``, ``slot_attention_torch``).
  It is the CPU production path and the oracle the Triton kernels are tested against.
- ``proxima.engine.attention.triton_attention``: Triton kernels and their launchers
  (``write_kv_triton``, ``slot_attention_triton``). Imported on demand, so this package
  imports without Triton.
"""
