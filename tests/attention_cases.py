"""Shared cases for the attention tests: random batches in every KV layout a backend may hand
over, with NaN-poisoned outputs and out-of-range slot-table padding.

Imported first by each attention test module: on a machine without CUDA it switches Triton to
its interpreter before anything imports Triton.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's own use of numpy (tensor-as-index) warns on every program; not ours to fix.
INTERPRETER_WARNINGS = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)
GARBAGE_SLOT = 1 << 29  # out of range on purpose: any read of an entry past seq_len would fault
# K and V halves of each head's row in one tensor per layer: the slot backend's own layout.
BACKEND_LAYOUT = "head-interleaved"


def kv_views(
    num_slots: int, heads: int, head_size: int, layout: str, gen: torch.Generator, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as views into one random buffer on DEVICE, in the layouts a backend may hand
    over: split [2, S, H, D] (vLLM's), slot-interleaved [S, 2, H, D], and head-interleaved
    [S, H, 2D] (K and V halves of each head's row, so the head stride is 2D). The buffer moves to
    the device whole: moving the views one by one would copy each into a tensor of its own, and
    the layout under test would be gone."""
    if layout == "split":
        buf = torch.randn(2, num_slots, heads, head_size, generator=gen).to(dtype).to(DEVICE)
        return buf[0], buf[1]
    if layout == "slot-interleaved":
        buf = torch.randn(num_slots, 2, heads, head_size, generator=gen).to(dtype).to(DEVICE)
        return buf[:, 0], buf[:, 1]
    assert layout == "head-interleaved", layout
    buf = torch.randn(num_slots, heads, 2 * head_size, generator=gen).to(dtype).to(DEVICE)
    return buf[..., :head_size], buf[..., head_size:]



@dataclass(slots=True)
class Batch:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    output: torch.Tensor  # poisoned with NaN

    def args(self, output: torch.Tensor | None = None) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.slot_table, self.query_start_loc,
                self.seq_lens, self.scale, self.output if output is None else output)

    @property
    def num_queries(self) -> int:
        return int(self.query_start_loc[-1])


def make_batch(
    requests: list[tuple[int, int]],
    num_query_heads: int,
    num_kv_heads: int,
    head_size: int,
    *,
    fragmented: bool = True,
    seed: int,
    dtype: torch.dtype = torch.float32,
    layout: str = "split",
    pad_rows: int = 3,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(s for _, s in requests) + 11  # spare slots hold unrelated data
    k_cache, v_cache = kv_views(num_slots, num_kv_heads, head_size, layout, gen, dtype)
    order = torch.randperm(num_slots, generator=gen) if fragmented else torch.arange(num_slots)
    width = max(s for _, s in requests) + 5
    slot_table = torch.full((len(requests) + 2, width), GARBAGE_SLOT, dtype=torch.int32)
    taken = 0
    for r, (_, seq_len) in enumerate(requests):
        slot_table[r, :seq_len] = order[taken:taken + seq_len].to(torch.int32)
        taken += seq_len
    q_lens = torch.tensor([q for q, _ in requests])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    num_tokens = int(query_start_loc[-1]) + pad_rows
    query = torch.randn(num_tokens, num_query_heads, head_size, generator=gen).to(dtype)
    return Batch(
        query=query.to(DEVICE), k_cache=k_cache, v_cache=v_cache,
        slot_table=slot_table.to(DEVICE), query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor([s for _, s in requests], dtype=torch.int32, device=DEVICE),
        scale=1.0 / math.sqrt(head_size),
        output=torch.full_like(query, float("nan")).to(DEVICE),
    )


def triton_write_kv_or_skip():
    """The Triton KV-write module, or a skip (as ``triton_attention_or_skip``)."""
    triton_attention_or_skip()
    from proxima.engine.attention import triton_write_kv

    return triton_write_kv


def triton_attention_or_skip():
    """The Triton kernels module, or a skip when it cannot run here (see the module docstring)."""
    pytest.importorskip("triton")
    from proxima.engine.attention import triton_attention
    from proxima.engine.attention.launch_args import interpreting

    if DEVICE == "cpu" and not interpreting():
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set; run this module on its own")
    return triton_attention
