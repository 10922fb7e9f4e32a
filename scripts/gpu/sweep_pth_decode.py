"""int4 decode tile shapes on the GPU under CUDA-graph replay (kit/pth.py's sweep): time, registers
and spills of each, against FA3 bf16.

usage: python scripts/gpu/sweep_pth_decode.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import pth

    pth.run_sweep(args.json)


if __name__ == "__main__":
    main()
