"""Does this GPU rank prefill pipeline depths as the sweep did? A quick check, ~20 s
(kit/sweeps.py, `prefill_stages`).

usage: python scripts/gpu/prefill_stages.py   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

import argparse


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from kit import sweeps

    sweeps.prefill_stages()


if __name__ == "__main__":
    main()
