"""The same KV tokens laid out twice, for the GPU benchmarks: vLLM's 16-token paged blocks and
Proxima's per-token slots.

Paged: ``k16``/``v16`` of ``[blocks, 16, Hkv, D]`` and a random (fragmented) block table; block 0
is never handed out. Slots: ``rows`` of ``[blocks * 16, Hkv, 2D]`` (K|V halves side by side per
head, the backend's layout) holding the same values, and ``slot_table[r, p] = block * 16 + p % 16``
for position ``p`` of request ``r``. Both benches draw their random data through here, in this
order, so a case's data does not depend on which bench built it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HQ, HKV, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B attention shapes
DTYPE = torch.bfloat16


@dataclass
class KVLayouts:
    k16: torch.Tensor
    v16: torch.Tensor
    block_table: torch.Tensor  # [requests, width] int32
    rows: torch.Tensor  # [slots, Hkv, 2D]
    slot_table: torch.Tensor  # [requests, width * 16] int32, contiguous


def kv_layouts(num_requests: int, width: int, gen: torch.Generator, device: str = "cuda",
               dtype: torch.dtype = DTYPE) -> KVLayouts:
    """``width`` blocks per request, every block distinct and in random order."""
    num_blocks = num_requests * width + 1
    k16 = torch.randn(num_blocks, BLOCK, HKV, D, device=device, dtype=dtype, generator=gen)
    v16 = torch.randn(num_blocks, BLOCK, HKV, D, device=device, dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks - 1, device=device, generator=gen)[: num_requests * width] + 1
    block_table = perm.view(num_requests, width).to(torch.int32)
    rows = torch.empty(num_blocks * BLOCK, HKV, 2 * D, device=device, dtype=dtype)
    rows[:, :, :D] = k16.view(-1, HKV, D)
    rows[:, :, D:] = v16.view(-1, HKV, D)
    slot_table = (block_table.long()[:, :, None] * BLOCK + torch.arange(BLOCK, device=device)).view(
        num_requests, width * BLOCK).to(torch.int32).contiguous()
    return KVLayouts(k16, v16, block_table, rows, slot_table)
