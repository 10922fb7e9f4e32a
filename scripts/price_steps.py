"""Price a burst's schedule in a GPU run's step costs: what keeping more steps in CUDA graphs buys.

A GPU run (scripts/gpu/e2e.py) logs each step's tokens and period. Three costs describe it:
- large steps (4,000 tokens or more): milliseconds per token (their GEMMs), the median;
- of the others, a step replayed from a CUDA graph (at most the run's capture size in tokens):
  their median; an eager step: their median (bound by the host's per-layer launches, nearly flat
  in tokens).
A step costs the larger of its kind's median and its tokens times that rate. The schedule priced
is any step log with the same fields: the GPU run's own (a check of the fit), or a CPU replica's
(scripts/burst_schedule_cpu.py --json, same scheduler and slot count, so the same steps).

usage: python scripts/price_steps.py FIT.json [FIT.json ...] --schedule RUN.json [--graph-tokens 512,2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

LARGE = 4000  # tokens: a step this large is bound by its GEMMs, graph or not


@dataclass(frozen=True)
class StepCosts:
    graph_ms: float
    eager_ms: float
    ms_per_token: float
    graph_tokens: int

    def price(self, tokens: int, graph_tokens: int) -> float:
        floor = self.graph_ms if tokens <= graph_tokens else self.eager_ms
        return max(floor, tokens * self.ms_per_token)


def steps_of(path: Path) -> tuple[list[list[float]], dict]:
    """A run's step rows ([running, waiting, tokens, preemptions, ms]) and its figures (e2e.py's
    JSON keeps them under "tight"; burst_schedule_cpu.py's at the top)."""
    data = json.loads(path.read_text())
    run = data.get("tight", data)
    return run["steps"], run


def fit(paths: list[Path]) -> StepCosts:
    graph, eager, rates, sizes = [], [], [], set()
    for path in paths:
        data = json.loads(path.read_text())
        limit = data.get("graph_tokens") or 0
        if not limit:
            raise SystemExit(f"{path}: no graph_tokens in the run (an e2e.py JSON of a FULL-graph engine)")
        sizes.add(limit)
        for _, _, tokens, _, ms in data["tight"]["steps"]:
            if tokens >= LARGE:
                rates.append(ms / tokens)
            else:
                (graph if tokens <= limit else eager).append(ms)
    if len(sizes) != 1 or not graph or not eager or not rates:
        raise SystemExit("the fit needs runs of one capture size with graph, eager and large steps")
    median = statistics.median
    return StepCosts(median(graph), median(eager), median(rates), sizes.pop())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fit", type=Path, nargs="+", help="e2e.py JSON files of one engine (its step costs)")
    p.add_argument("--schedule", type=Path, action="append", required=True, help="step logs to price")
    p.add_argument("--graph-tokens", default="", help="capture sizes to price at (default: the fit's)")
    args = p.parse_args()
    costs = fit(args.fit)
    print(f"step costs: graph {costs.graph_ms:.1f} ms, eager {costs.eager_ms:.1f} ms, "
          f"{costs.ms_per_token * 1e3:.1f} ms per 1k tokens (fit at {costs.graph_tokens} graph tokens)")
    limits = [int(x) for x in args.graph_tokens.split(",") if x] or [costs.graph_tokens]
    for path in args.schedule:
        steps, run = steps_of(path)
        output = run["output_tokens"]
        for limit in limits:
            wall = sum(costs.price(int(s[2]), limit) for s in steps) / 1e3
            eager = sum(1 for s in steps if s[2] > limit)
            print(f"{path}: graphs to {limit} tokens: {len(steps)} steps, {eager} eager, "
                  f"priced {wall:.2f} s, "
                  f"{output / wall:,.0f} tok/s; running mean {run['running_mean']:.1f}, "
                  f"{run['preemptions']} preemptions")


if __name__ == "__main__":
    main()
