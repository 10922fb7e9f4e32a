"""Decode launch-shape sweep on the GPU: which tile shape and split count a decode batch wants
(kit/sweeps.py, `decode_point`), each forced launch replayed from a CUDA graph beside FA3.

usage: python scripts/gpu/sweep_decode.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import sweeps

    sweeps.run_sweep(sweeps.DECODE_POINTS, sweeps.decode_point, sweeps.report_sweep, args.json)


if __name__ == "__main__":
    main()
