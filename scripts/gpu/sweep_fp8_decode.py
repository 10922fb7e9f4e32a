"""fp8 decode launch-shape sweep on the GPU, at the decode points furthest from FA3 fp8
(kit/sweeps.py, `fp8_decode_point`), checked against the float32 oracle over the dequantised cache.

usage: python scripts/gpu/sweep_fp8_decode.py [--json OUT]   (needs an sm89+ GPU and vLLM 0.26)
"""

from __future__ import annotations

import functools

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import sweeps

    report = functools.partial(sweeps.report_sweep, reference="fa3_fp8_us", label="FA3 fp8")
    sweeps.run_sweep(sweeps.FP8_POINTS, sweeps.fp8_decode_point, report, args.json)


if __name__ == "__main__":
    main()
