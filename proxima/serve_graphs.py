"""The CUDA graphs `proxima serve` asks vLLM for when Proxima's attention serves a token engine.

Layer: the `proxima serve` command builder (no vLLM imported). One place for the graph choice,
read by `serve_command` and by the GPU benchmarks' FULL-graph engines (scripts/gpu/kit/e2e.py).

Why FULL: vLLM's default mode (FULL_AND_PIECEWISE) runs attention eagerly, layer by layer, in
every mixed prefill+decode step. Proxima's kernels replay correctly from one graph per token count
whatever the batch mix (AttentionCGSupport.ALWAYS; tests/test_attention_gpu_graphs.py): on the
H200, 1 GiB of KV and 512 short chats, 6,437 output tok/s against 5,350 with vLLM's default.

Why steps of up to GRAPH_TOKENS tokens, where vLLM captures 512 at most by default: a larger step
ran outside graphs, bound by each layer's host launches (42.6 ms a step on an H100 whatever its
520-1,530 tokens, against 8.6 in a graph), and a short-chat burst spent two thirds of its wall
there. On an H100, int4 KV: 8,600 output tok/s against 5,910; the graphs take 0.55 GiB against
0.24 and 11 s of start-up against 6 (docs/benchmarks.md, "Graphs to 2,048 tokens").
"""

from __future__ import annotations

import json

from proxima.serve_checks import has_flag

GRAPH_TOKENS = 2048
# vLLM refuses a capture size given both in --compilation-config and as its own flag (which its
# parser also takes with underscores).
_CAPTURE_SIZE_FLAGS = ("--max-cudagraph-capture-size", "--cudagraph-capture-sizes",
                       "--max_cudagraph_capture_size", "--cudagraph_capture_sizes")
# Flags that choose CUDA-graph behaviour themselves: with any of them, the user's choice stands.
_GRAPH_FLAGS = ("--compilation-config", "-cc", "--optimization-level", "-O", "--enforce-eager")


def full_graphs(graph_tokens: int | None = GRAPH_TOKENS) -> dict:
    """vLLM's compilation config for FULL graphs of steps of up to `graph_tokens` tokens (None:
    the capture sizes are set elsewhere)."""
    config: dict = {"cudagraph_mode": "FULL"}
    if graph_tokens is not None:
        config["max_cudagraph_capture_size"] = graph_tokens
    return config


FULL_CUDA_GRAPHS = json.dumps(full_graphs())


def graph_args(args: list[str]) -> tuple[list[str], str | None]:
    """The flags to add to vLLM's `args` and the line saying so; none where the user chose."""
    # Prefixes, not whole flags: vLLM also takes -O3, -cc.cudagraph_mode=... and --compilation-config.x.
    if any(a.startswith(_GRAPH_FLAGS) for a in args):
        return [], None
    if any(has_flag(args, flag) for flag in _CAPTURE_SIZE_FLAGS):
        config, sizes = full_graphs(None), "at the capture sizes given"
    else:
        config = full_graphs()
        sizes = f"steps of up to {GRAPH_TOKENS} tokens (--max-cudagraph-capture-size N for another size)"
    return (["--compilation-config", json.dumps(config)],
            f"CUDA graphs: FULL, mixed prefill+decode steps captured too, {sizes}; "
            "pass --compilation-config or --enforce-eager to choose otherwise")
