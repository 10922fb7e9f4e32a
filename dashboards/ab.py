"""The A/B dashboard: a Proxima instance ($instance_a) beside a baseline ($instance_b).

B is stock vLLM (only `vllm:*` series) or `proxima serve --proxima-allocator block` (stock
block allocation with Proxima's telemetry, so B's proxima_* series appear too). Every panel
plots both instances together, so a gain or a regression reads off one chart.
"""

from __future__ import annotations

from collections.abc import Callable

from dashboards import panels as p
from dashboards import promql as q
from proxima.metrics import catalog as c

UID = "proxima-ab"
MODEL = q.MODEL_MATCH
SIDES = (("A", 'instance="$instance_a"'), ("B", 'instance="$instance_b"'))
TOKENS_PER_S = "suffix: tok/s"


def _intro(runbook_base: str) -> str:
    page = f"{runbook_base}no-throughput-gain.md"
    return f"""\
**A/B: Proxima against a baseline under the same load.** Pick for **A** a server that runs
Proxima (`proxima serve`) and for **B** the baseline: stock vLLM, or `proxima serve
--proxima-allocator block` to see the baseline's fragmentation too. Send both the same
traffic. Expect A to hold less KV for the same requests, preempt less, and sustain more
throughput once B's cache is the limit. No gain? See [{page}]({page})."""


def _both(make: Callable[[str, str], p.Target]) -> list[p.Target]:
    return [make(side, instance) for side, instance in SIDES]


def _ratio(build: Callable[[str], str]) -> str:
    a, b = (build(instance) for _, instance in SIDES)
    return f"{a} / {b}"


def comparison(board: p.Board) -> None:
    board.row("A relative to B")

    def throughput(instance: str) -> str:
        return f"sum({q.rate(c.Vllm.GENERATION_TOKENS, p.RATE_INTERVAL, instance, MODEL)})"

    def p95_e2e(instance: str) -> str:
        return q.quantile(0.95, c.Vllm.E2E, p.RATE_INTERVAL, (), instance, MODEL)

    board.add(
        p.stat_panel("Generation throughput, A ÷ B",
                     "Above 1: Proxima generates more tokens per second than the baseline.",
                     [p.Target(_ratio(throughput), "A ÷ B")],
                     "suffix:×", width=12),
        p.stat_panel("P95 end-to-end latency, A ÷ B",
                     "Below 1: Proxima's requests finish sooner at the 95th percentile.",
                     [p.Target(_ratio(p95_e2e), "A ÷ B")], "suffix:×", width=12),
    )


def memory(board: p.Board) -> None:
    board.row("Memory")
    board.add(
        p.timeseries_panel(
            "KV usage",
            "Token usage (what requests hold; Proxima) and the block usage vLLM reports "
            f"({c.Vllm.KV_USAGE}) for each side.",
            [*_both(lambda side, inst: p.Target(q.sel(c.TOKEN_USAGE, inst), f"{side} token usage")),
             *_both(lambda side, inst: p.Target(q.sel(c.Vllm.KV_USAGE, inst, MODEL),
                                                f"{side} vLLM reported"))],
            "percentunit", min_val=0, max_val=1),
        p.timeseries_panel(
            "Fragmentation",
            f"{c.FRAGMENTATION.help} For A, also what {c.REFERENCE_BLOCK_SIZE}-token blocks "
            "would waste on the same requests.",
            [*_both(lambda side, inst: p.Target(q.sel(c.FRAGMENTATION, inst),
                                                f"{side} allocator in use")),
             p.Target(q.sel(c.BLOCK_FRAGMENTATION, SIDES[0][1]),
                      f"A if {c.REFERENCE_BLOCK_SIZE}-token blocks")],
            "percentunit", min_val=0, max_val=1),
    )


def throughput_latency(board: p.Board) -> None:
    board.row("Throughput, latency, preemptions")
    board.add(
        p.timeseries_panel(
            "Generation tokens / s", "Tokens generated per second by each side.",
            _both(lambda side, inst: p.Target(
                f"sum({q.rate(c.Vllm.GENERATION_TOKENS, p.RATE_INTERVAL, inst, MODEL)})", side)),
            TOKENS_PER_S, width=8, min_val=0),
        p.timeseries_panel(
            "Requests / s", "Finished requests per second on each side.",
            _both(lambda side, inst: p.Target(
                f"sum({q.rate(c.Vllm.REQUEST_SUCCESS, p.RATE_INTERVAL, inst, MODEL)})", side)),
            "reqps", width=8, min_val=0),
        p.timeseries_panel(
            "Preemptions / s",
            f"{c.Vllm.PREEMPTIONS} on each side: the baseline preempting while A does not is "
            "Proxima's memory gain at work.",
            _both(lambda side, inst: p.Target(
                f"sum({q.rate(c.Vllm.PREEMPTIONS, p.RATE_INTERVAL, inst, MODEL)})", side)),
            "reqps", width=8, min_val=0),
    )
    for title, histogram in (("P95 time to first token", c.Vllm.TTFT),
                             ("P95 inter-token latency", c.Vllm.ITL),
                             ("P95 end-to-end latency", c.Vllm.E2E)):
        board.add(p.timeseries_panel(
            title, f"95th percentile of {histogram} on each side.",
            _both(lambda side, inst, h=histogram: p.Target(
                q.quantile(0.95, h, p.RATE_INTERVAL, (), inst, MODEL), side)),
            "s", width=8, min_val=0))
    board.add(p.timeseries_panel(
        "Running / waiting", "Batch size and queue depth on each side.",
        [*_both(lambda side, inst: p.Target(f"sum({q.sel(c.Vllm.RUNNING, inst, MODEL)})",
                                            f"{side} running")),
         *_both(lambda side, inst: p.Target(f"sum({q.sel(c.Vllm.WAITING, inst, MODEL)})",
                                            f"{side} waiting"))],
        "short", width=24, min_val=0))


def build(runbook_base: str) -> p.Board:
    board = (p.Board(UID, "Proxima / A-B comparison",
                     "A Proxima instance beside a stock (or block-allocator) baseline.")
             .variable(p.query_variable("model_name", "Model", q.MODEL_VALUES, multi=True))
             .variable(p.query_variable("instance_a", "A (Proxima)", q.INSTANCE_VALUES, multi=False))
             .variable(p.query_variable("instance_b", "B (baseline)", q.INSTANCE_VALUES, multi=False)))
    board.add(p.text_panel("About this comparison", _intro(runbook_base), height=4))
    comparison(board)
    memory(board)
    throughput_latency(board)
    return board
