"""Prefill, mixed batches, host launch cost and CUDA-graph replay: Proxima against vLLM's kernels
(kit/mixed.py), and the attention regression guard over their ratios (kit/ratio_guard.py).

usage: python scripts/gpu/bench_mixed.py [--json OUT] [--guard FILE | --record FILE]
                                         [--include FP8.json] [--include PTH.json]
       (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write every result here")
    guard = p.add_mutually_exclusive_group()
    guard.add_argument("--guard", default=None,
                       help="recorded ratios to check this run against (exit 1 past 10%%)")
    guard.add_argument("--record", default=None, help="write this run's ratios here")
    p.add_argument("--include", action="append", default=None,
                   help="bench_fp8.py's or bench_pth.py's JSON, guarded with this run (repeatable)")
    args = p.parse_args()
    from kit import mixed

    return mixed.run(args.json, args.guard, args.record, args.include)


if __name__ == "__main__":
    sys.exit(main())
