"""Per-token-head KV decode (int4, int8) on the GPU under CUDA-graph replay: Proxima's slot kernel
against FlashAttention 3 over bf16 and vLLM's own TRITON_ATTN kernel over the same bytes (kit/pth.py).

usage: python scripts/gpu/bench_pth.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import pth

    pth.run(args.json)


if __name__ == "__main__":
    main()
