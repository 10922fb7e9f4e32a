"""fp8 KV cache decode on the GPU under CUDA-graph replay: Proxima's slot kernel against
FlashAttention 3 fp8, and both in bf16 (kit/fp8.py).

usage: python scripts/gpu/bench_fp8.py [--json OUT]   (needs an sm89+ GPU and vLLM 0.26)
"""

from __future__ import annotations

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import fp8

    fp8.run(args.json)


if __name__ == "__main__":
    main()
