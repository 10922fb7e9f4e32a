"""Probe (not kept): int4 rotation at head 256 on the GPU against torch."""
import torch
import triton
import triton.language as tl

from proxima.engine.attention import triton_int4
from proxima.engine.attention.per_token_head import rht_matrices


@triton.jit
def rot(x_ptr, h_ptr, out_ptr, M: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
        SPLIT_HI: tl.constexpr):
    rows, cols = tl.arange(0, M), tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :])
    y = hadamard(x, h_ptr, D, DOT, PREC, SPLIT_HI)  # noqa: F821
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y)


rot.fn.__globals__["hadamard"] = triton_int4._hadamard
for d in (128, 256):
    h, _ = rht_matrices(d, torch.device("cuda"))
    x = torch.randn(16, d, device="cuda")
    want = x.double() @ h.double()
    for dot, prec, split in ((tl.float32, "tf32x3", False), (tl.bfloat16, "tf32", True)):
        out = torch.empty_like(x)
        rot[(1,)](x, h, out, 16, d, dot, prec, split)
        err = (out.double() - want).abs().max().item()
        print(f"d={d} dot={dot} max|err|={err:.3g} scale={want.abs().max().item():.3g}")
        if err > 1e-2:
            bad = (out.double() - want).abs() > 1e-2
            cols = bad.any(0).nonzero().flatten().tolist()
            print("  bad columns", cols[:8], "...", len(cols), "ratio out/want at [0, :4]",
                  (out[0, :4].double() / want[0, :4]).tolist())
