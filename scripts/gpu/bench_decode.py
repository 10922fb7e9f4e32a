"""Decode attention on the GPU, eager: Proxima's slot-table kernel against vLLM's paged kernels
(TRITON_ATTN, FlashAttention 3) on the same tokens; the table is kit/decode.py's.

usage: python scripts/gpu/bench_decode.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import decode

    decode.run(args.json)


if __name__ == "__main__":
    main()
