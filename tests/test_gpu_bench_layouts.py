"""The GPU benchmarks' two KV layouts (scripts/gpu/kit/layouts.py) hold the same token at the same
position, so their timings compare kernels on identical data. The builder runs on CPU too."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "kit" / "layouts.py"
_spec = importlib.util.spec_from_file_location("gpu_bench_layouts", _PATH)
layouts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layouts)


def test_slot_rows_hold_the_paged_blocks_tokens_position_by_position() -> None:
    gen = torch.Generator().manual_seed(0)
    kv = layouts.kv_layouts(3, 4, gen, device="cpu", dtype=torch.float32)
    b, d = layouts.BLOCK, layouts.D
    assert kv.block_table.shape == (3, 4) and kv.slot_table.shape == (3, 4 * b)
    assert kv.slot_table.is_contiguous() and kv.slot_table.dtype == torch.int32
    used = kv.block_table.flatten()
    assert used.unique().numel() == used.numel() and int(used.min()) >= 1  # distinct, block 0 unused
    for r in range(3):
        for p in (0, 5, b, 4 * b - 1):
            block, offset = int(kv.block_table[r, p // b]), p % b
            slot = int(kv.slot_table[r, p])
            assert slot == block * b + offset
            assert torch.equal(kv.rows[slot, :, :d], kv.k16[block, offset])
            assert torch.equal(kv.rows[slot, :, d:], kv.v16[block, offset])
