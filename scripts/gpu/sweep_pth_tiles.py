"""int4 decode tile shapes under graph replay (kit/pth.py's `_int4_tile_plans`): the served plan
against narrower decode KV tiles and short launches of their own; time, registers, splits, and
each plan's largest difference from the served plan's output.

usage: python scripts/gpu/sweep_pth_tiles.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import pth

    pth.run_plans(args.json, tile_sweep=True)


if __name__ == "__main__":
    main()
