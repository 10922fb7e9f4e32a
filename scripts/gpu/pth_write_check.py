"""On the GPU: Proxima's per-token-head KV write against vLLM's compiled writer, byte for byte, and
how far the CPU torch writer (the one the interpreter-run tests hold to vLLM's kernel) lands from
the compiled one.

usage: python scripts/gpu/pth_write_check.py   (after .gpu-bundle/device.sh install)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import vllm_reference_kernels as ref  # noqa: E402

from proxima.engine.attention import per_token_head as pth  # noqa: E402

FIELDS = ("k_codes", "v_codes", "k_scales", "v_scales")


def rows(n: int, heads: int, head_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, head_size, generator=gen) * 3).to(dtype)


def main() -> None:
    for name in ("int8_per_token_head", "int4_per_token_head", "fp8_per_token_head"):
        for dtype in (torch.bfloat16, torch.float32):
            k, v = rows(512, 8, 128, dtype, 1).cuda(), rows(512, 8, 128, dtype, 2).cuda()
            slots = torch.randperm(2048)[:512].cuda()
            stock = ref.write_stock(k, v, slots, name)
            fmt = pth.PTH_FORMATS[name]
            raw = torch.zeros(2048, 1, 8, fmt.record_bytes(128), dtype=torch.uint8, device="cuda")
            cache = pth.cache_views(raw, fmt, 8, 128)
            pth.write(k, v, cache, slots)  # Proxima's CUDA path
            same = all(torch.equal(getattr(cache, f)[slots].cpu().contiguous().view(torch.uint8),
                                   stock[f].contiguous().view(torch.uint8)) for f in FIELDS)
            codes, scales = pth.quantize(k.cpu(), fmt)  # the CPU torch writer
            ulps = (scales.view(torch.int32) - stock["k_scales"].view(torch.int32)).abs()
            differ = codes.contiguous().view(torch.uint8) != stock["k_codes"].contiguous().view(torch.uint8)
            print(f"{name} {dtype} | Proxima CUDA write == vLLM stock-layout write: {same} "
                  f"| CPU torch writer vs GPU: scales differ {(ulps > 0).float().mean():.4f} "
                  f"max ulp {int(ulps.max())} codes differ {differ.float().mean():.5f}", flush=True)


if __name__ == "__main__":
    main()
