"""End to end on the GPU: Proxima against stock vLLM 0.26 on a Llama-3-8B-shaped model (dummy
weights, bf16), every engine through the engine harness in a process of its own; the engines,
jobs and summary are kit/e2e.py's (greedy agreement, compute-bound and KV-bound throughput).

usage: python scripts/gpu/e2e.py MODEL_DIR OUT_DIR [--only NAME,...] [--profile] [--shared-prefix [N[,M...]]]
                                 [--no-tiles] [--repeats N] [--starts N]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def prefix_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts separated by commas, e.g. 0,300") \
            from None
    if any(n < 0 for n in lengths) or len(set(lengths)) < len(lengths):
        raise argparse.ArgumentTypeError(f"{text!r}: each length once, none negative (e.g. 0,300)")
    return lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="the 8B-shaped model directory (scripts/gpu/llama8b_dummy.py)")
    p.add_argument("out", type=Path, help="one JSON and one log per engine go here")
    p.add_argument("--only", default=None, help="comma-separated engine names (kit/e2e.py ENGINES)")
    p.add_argument("--profile", action="store_true",
                   help="also time the host per step, GPU kernels by kind and the busiest host functions")
    p.add_argument("--shared-prefix", type=prefix_lengths, nargs="?", const=(200,), default=(0,),
                   metavar="N[,M...]",
                   help="the tight job's requests share one N-token system prompt (200 if N is left out); "
                        "0,300 runs the burst without and with one in each engine, which starts once")
    p.add_argument("--no-tiles", action="store_true",
                   help="skip Proxima's untimed pass counting contiguous KV tiles")
    p.add_argument("--repeats", type=int, default=1,
                   help="time each throughput burst N times in one engine (prefix cache reset between): "
                        "every run's tok/s and their median")
    p.add_argument("--starts", type=int, default=1,
                   help="start each engine N times in turn (OUT/start1, ...): tok/s moves more between "
                        "starts than between repeats, so a ratio of engines wants N >= 2")
    p.add_argument("--graph-tokens", type=int, default=None, metavar="N",
                   help="the *-full engines replay steps of up to N tokens from CUDA graphs (vLLM's "
                        "max_cudagraph_capture_size; default proxima serve's 2048, vLLM's is 512 here): "
                        "larger steps run outside graphs")
    args = p.parse_args()
    if args.repeats < 1 or args.starts < 1:
        p.error("--repeats and --starts take a count of 1 or more")
    if args.graph_tokens is not None and args.graph_tokens < 1:
        p.error("--graph-tokens takes a token count of 1 or more (at most vLLM's max-num-batched-tokens)")
    from kit import e2e

    only = set(args.only.split(",")) if args.only else None
    if only and only - set(e2e.ENGINES):
        p.error(f"unknown engines: {', '.join(sorted(only - set(e2e.ENGINES)))}")
    e2e.run(args.model, args.out, only, args.profile, args.shared_prefix, not args.no_tiles, args.repeats,
            args.starts, args.graph_tokens)


if __name__ == "__main__":
    main()
