"""Launch plans for decode steps replayed from CUDA graphs (kit/pth.py's `run_plans`), over bf16 and
int4 caches: the mixed plan in one launch (what a graph of unknown batches captures), the decode
plan (what a uniform-decode graph captures) and mixed plans of two launches
(`TileConfig.short_launch`), against FA3 bf16 and stock int4; time, registers, splits.

usage: python scripts/gpu/sweep_pth_decode.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import pth

    pth.run_plans(args.json)


if __name__ == "__main__":
    main()
