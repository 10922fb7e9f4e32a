"""Is vLLM 0.26's CUDA Hadamard (hadacore), alone on fresh tensors, deterministic and right for
every row count? Run on the GPU machine: python3 rht_race.py"""
import torch
from vllm.v1.attention.ops.int4_per_token_head import _get_hadamard_matrix, fast_hadamard_transform

torch.manual_seed(0)
for d in (64, 128, 256):
    H = _get_hadamard_matrix(d, torch.float64, torch.device("cpu")).cuda()
    for rows in (2, 3, 5, 6, 7, 109, 110, 111, 112, 113):
        x = torch.randn(rows, d, device="cuda").to(torch.bfloat16)
        outs = [fast_hadamard_transform(x.float()) for _ in range(30)]
        distinct = sum(not torch.equal(outs[0], o) for o in outs[1:])
        exact = x.double() @ H.T
        err = ((outs[0].double() - exact).abs().amax(-1) / exact.abs().amax(-1))
        bad = (err > 0.05).nonzero().flatten().tolist()
        chunks = -(-rows * d // 256)
        print(f"d{d} rows {rows:4d} chunks {chunks:4d} differ {distinct:2d}/29 "
              f"rel-err max {err.max():.3g} bad rows {bad[:6]}")
