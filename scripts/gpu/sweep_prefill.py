"""Prefill / mixed-batch tile sweep on the GPU: which tile shape a batch with long queries wants
(kit/sweeps.py, `prefill_case`: every case of kit/cases.MIXED, gathered and dense-tile reads).

usage: python scripts/gpu/sweep_prefill.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

from kit.cli import parse_json_out


def main() -> None:
    args = parse_json_out(__doc__)
    from kit import sweeps

    sweeps.run_sweep(sweeps.prefill_cases(), sweeps.prefill_case, sweeps.report_case, args.json)


if __name__ == "__main__":
    main()
