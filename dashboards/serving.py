"""The serving dashboard: request rate, token throughput, latency quantiles, queue depth.

Reads only stock `vllm:*` series, so it works unchanged on stock vLLM and on Proxima; the KV
panel beside it shows the block-granular usage vLLM reports (the KV memory dashboard shows
what Proxima adds).
"""

from __future__ import annotations

from dashboards import panels as p
from dashboards import promql as q
from proxima.metrics import catalog as c

UID = "proxima-serving"
MATCH = (q.INSTANCE_MATCH, q.MODEL_MATCH)
BY_INSTANCE = ("instance",)
QUANTILES = (0.5, 0.95, 0.99)
TOKENS_PER_S = "suffix: tok/s"


def _latency_panel(title: str, histogram: str, description: str):
    return p.timeseries_panel(
        title, description,
        [p.Target(q.quantile(quant, histogram, p.RATE_INTERVAL, BY_INSTANCE, *MATCH),
                  f"{{{{instance}}}} p{round(quant * 100)}") for quant in QUANTILES],
        "s", min_val=0)


def traffic(board: p.Board) -> None:
    board.row("Traffic")
    board.add(
        p.timeseries_panel(
            "Requests / s",
            f"Finished requests per second ({c.Vllm.REQUEST_SUCCESS}), all finish reasons.",
            [p.Target(q.sum_rate(c.Vllm.REQUEST_SUCCESS, p.RATE_INTERVAL, BY_INSTANCE, *MATCH),
                      "{{instance}}")],
            "reqps", width=8, min_val=0),
        p.timeseries_panel(
            "Tokens / s",
            "Prompt tokens processed and tokens generated per second.",
            [p.Target(q.sum_rate(c.Vllm.PROMPT_TOKENS, p.RATE_INTERVAL, BY_INSTANCE, *MATCH),
                      "{{instance}} prompt"),
             p.Target(q.sum_rate(c.Vllm.GENERATION_TOKENS, p.RATE_INTERVAL, BY_INSTANCE, *MATCH),
                      "{{instance}} generation")],
            TOKENS_PER_S, width=8, min_val=0),
        p.timeseries_panel(
            "Running / waiting requests",
            "Requests in the running batch and in the queue. A queue that grows while KV usage "
            "is high means the cache, not compute, limits the batch.",
            [p.Target(f"sum by (instance) ({q.sel(c.Vllm.RUNNING, *MATCH)})", "{{instance}} running"),
             p.Target(f"sum by (instance) ({q.sel(c.Vllm.WAITING, *MATCH)})", "{{instance}} waiting")],
            "short", width=8, min_val=0),
    )


def latency(board: p.Board) -> None:
    board.row("Latency")
    board.add(
        _latency_panel("Time to first token p50 / p95 / p99", c.Vllm.TTFT,
                       "From arrival to the first generated token (includes queueing and prefill)."),
        _latency_panel("Inter-token latency p50 / p95 / p99", c.Vllm.ITL,
                       "Gap between consecutive generated tokens of a request (decode speed)."),
        _latency_panel("End-to-end latency p50 / p95 / p99", c.Vllm.E2E,
                       "From arrival to the last token."),
        _latency_panel("Queue time p50 / p95 / p99", c.Vllm.QUEUE_TIME,
                       "Time requests wait before they are first scheduled."),
    )


def kv(board: p.Board) -> None:
    board.row("KV cache (as vLLM reports it)")
    board.add(
        p.timeseries_panel(
            "KV cache usage (vLLM, whole blocks)",
            f"{c.Vllm.KV_USAGE}: the fraction of KV blocks in use. Proxima's token-level view is "
            "on the KV memory dashboard.",
            [p.Target(f"max by (instance) ({q.sel(c.Vllm.KV_USAGE, *MATCH)})", "{{instance}}")],
            "percentunit", min_val=0, max_val=1),
        p.timeseries_panel(
            "Preemptions / s (vLLM)",
            f"{c.Vllm.PREEMPTIONS}: requests evicted from the batch because the KV cache was full.",
            [p.Target(q.sum_rate(c.Vllm.PREEMPTIONS, p.RATE_INTERVAL, BY_INSTANCE, *MATCH),
                      "{{instance}}")],
            "reqps", min_val=0),
    )


def build() -> p.Board:
    board = (p.Board(UID, "Proxima / Serving",
                     "vLLM serving: requests, tokens, latency quantiles, queue.")
             .variable(p.query_variable("model_name", "Model", q.MODEL_VALUES, multi=True))
             .variable(p.query_variable("instance", "Instance", q.INSTANCE_VALUES, multi=True)))
    traffic(board)
    latency(board)
    kv(board)
    return board
