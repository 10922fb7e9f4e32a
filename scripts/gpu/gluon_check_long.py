"""Gluon and Triton int4 decode against the float32 torch oracle at long contexts (kit's decode batch).

usage: python scripts/gpu/gluon_check_long.py   (needs CUDA)
"""
import torch
from kit import pth as kp
from kit.cases import decode_batch

from proxima.engine.attention import launch_args
from proxima.engine.attention.reference import slot_attention_torch

for batch, ctx in [(8, 1024), (8, 4096), (8, 8192), (64, 8192)]:
    b = decode_batch(batch, ctx)
    cache = kp.slot_cache(b, "int4_per_token_head")
    expected = torch.empty(b.q.shape, dtype=torch.float32, device="cuda")
    slot_attention_torch(b.q.float(), cache.k_codes, cache.v_codes, b.slot_table, b.cu_q, b.seq_lens,
                         kp.SCALE, expected, kv_scales=cache)
    size = expected.abs()
    row = f"{batch:>4} x {ctx:>5}: |expected| max {float(size.max()):.4f} mean {float(size.mean()):.4f}"
    for kernel in ("gluon", "triton"):
        launch_args.INT4_DECODE = kernel
        out = torch.full_like(b.q, float("nan"))
        kp.proxima_call(b, cache, out)()
        torch.cuda.synchronize()
        err = (out.float() - expected).abs()
        row += f" | {kernel}: max {float(err.max()):.4f} mean {float(err.mean()):.5f}"
    print(row, flush=True)
    del b, cache
    torch.cuda.empty_cache()
