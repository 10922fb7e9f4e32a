"""The kernel benches' one command-line option, parsed before anything heavy is imported."""

from __future__ import annotations

import argparse


def parse_json_out(doc: str) -> argparse.Namespace:
    """`--json OUT` (every result goes there), with the script's docstring as its help."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write every result here")
    return p.parse_args()
