"""Accuracy per KV cache dtype on the real model (issues 25 and 26): what quantised KV costs in
answers, Proxima beside stock vLLM wherever stock serves the mode.

For every engine configuration (Proxima at auto, fp8, int8/fp8/int4_per_token_head; stock at
auto and fp8, and on CUDA at the per-token-head modes through TRITON_ATTN), each in a process of
its own through the engine harness, on SmolLM2-135M-Instruct in bfloat16 (what users serve; the
reference "bf16 KV" is the same engine with --kv-cache-dtype auto):
  - perplexity over fixed passages of Newton's Opticks (proxima/accuracy_corpus.py), teacher-forced
    through vLLM's prompt_logprobs;
  - mean and p99 KL divergence of next-token distributions against the reference, and the share of
    positions whose most likely token is the reference's (top-1 equal);
  - the share of greedy chat answers (chat template, temperature 0) equal to the reference's, on
    the fixed chats of proxima/chat_prompts.py.
Comparisons: each configuration against its own engine at auto; Proxima also against stock auto
and against stock at the same dtype (proxima/accuracy_report.py). The device is vLLM's choice:
the same command runs on CPU and, unchanged, on a CUDA GPU.

usage: python scripts/bench_kv_accuracy.py [--model .proxima/smol-model] [--quick]
           [--configs proxima-auto,proxima-int4_per_token_head] [--json OUT] [--passages 24]
           [--chats 120] [--top-logprobs 200] [--device auto|cpu|cuda]
(--quick: 4 short passages, 16 chats of 32 tokens: a sanity run of a few minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from proxima.accuracy_engines import RunParams, configurations, engine_spec, measure
from proxima.accuracy_report import assemble, check_measurement, render_table, to_json, write_json
from proxima.harness import EngineProcessError, run_isolated

logger = logging.getLogger("bench_kv_accuracy")
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".proxima" / "smol-model"
QUICK = {"num_passages": 4, "passage_chars": 1200, "num_chats": 16, "max_new_tokens": 32}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunParams)}  # a slots class has none to read
ENGINE_TIMEOUT_S = 3600.0  # one engine, start-up included, on a loaded 2-core machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="the real model's directory (proxima model smol DIR builds it)")
    p.add_argument("--dtype", default=DEFAULTS['model_dtype'], help="the model's dtype (vLLM's --dtype)")
    p.add_argument("--configs", default=None,
                   help="comma-separated configurations (their references are added); default: all "
                        "that the device serves")
    p.add_argument("--quick", action="store_true", help="a sanity run of a few minutes: " + ", ".join(
        f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--passages", type=int, default=None, help=f"passages scored (default "
                   f"{DEFAULTS['num_passages']}, quick {QUICK['num_passages']})")
    p.add_argument("--passage-chars", type=int, default=None, help="minimum characters a passage")
    p.add_argument("--chats", type=int, default=None, help="chats answered greedily (at most 120)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens a greedy answer")
    p.add_argument("--top-logprobs", type=int, default=DEFAULTS['top_logprobs'],
                   help="prompt logprobs a position (vLLM's --max-logprobs is set to it)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=DEFAULTS['kv_cache_memory_bytes'],
                   help="every engine's KV budget (large enough that no dtype changes the schedule)")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULTS['max_num_batched_tokens'],
                   help="every engine's step budget, so its longest prefill chunk (stock vLLM's CPU fp8 KV "
                   "fails above 320 with a bf16 model: docs/benchmarks.md)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when torch sees a GPU (vLLM picks it either way; this chooses "
                        "the configurations and flags)")
    p.add_argument("--json", type=Path, default=None, help="write the run's record here")
    p.add_argument("--log-dir", type=Path, default=None, help="keep each engine's log here")
    return p.parse_args(argv)


def run_params(args: argparse.Namespace, cuda: bool) -> RunParams:
    sizes = dict(QUICK) if args.quick else {}
    for field, value in (("num_passages", args.passages), ("passage_chars", args.passage_chars),
                         ("num_chats", args.chats), ("max_new_tokens", args.max_new_tokens)):
        if value is not None:
            sizes[field] = value
    return RunParams(model=str(args.model), model_dtype=args.dtype, top_logprobs=args.top_logprobs,
                     kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                     max_num_batched_tokens=args.max_num_batched_tokens, cuda=cuda, **sizes)


def cuda_available(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        print(f"no model at {args.model}; build it with: proxima model smol {args.model}", file=sys.stderr)
        return 2
    cuda = cuda_available(args.device)
    try:
        params = run_params(args, cuda)
        configs = configurations(cuda, args.configs.split(",") if args.configs else None)
        for config in configs:
            engine_spec(config, params)  # refuse a bad flag before the first engine starts
    except ValueError as err:
        print(f"bench_kv_accuracy: {err}", file=sys.stderr)
        return 2
    began = time.monotonic()
    measurements, failures = {}, {}
    for config in configs:
        logger.info("%s: starting its engine", config.name)
        log_path = args.log_dir / f"{config.name}.log" if args.log_dir else None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            m = run_isolated(measure, config, params, timeout=ENGINE_TIMEOUT_S, log_path=log_path)
        except EngineProcessError as err:
            logger.error("%s failed: %s", config.name, str(err)[-2000:])
            failures[config.name] = str(err)[-4000:]
            continue
        try:
            check_measurement(m)
        except ValueError as err:
            # Seen: stock CPU fp8 KV with 384-512-token prefill chunks (NaN logprobs, or a crash).
            logger.error("%s returned prompt logprobs that cannot be scored: %s", config.name, err)
            failures[config.name] = f"prompt logprobs that cannot be scored: {err}"
            continue
        measurements[config.name] = m
        logger.info("%s: start %.0f s, passages %.0f s, chats %.0f s; %s KV bytes a token", config.name,
                    m.start_s, m.score_s, m.chat_s, m.bytes_per_token)
        if args.json:  # after every engine: a run cut short keeps the figures of those that finished
            save(args.json, measurements, failures, params, cuda, time.monotonic() - began,
                 complete=config == configs[-1])
    report = assemble(measurements)
    duration = time.monotonic() - began
    positions = report.configs[0].num_positions if report.configs else 0
    rest = max((c.kl.mean_rest_mass for c in report.comparisons), default=float("nan"))
    print(f"\n{params.model_dtype} model, {params.num_passages} passages ({positions} positions, "
          f"top {params.top_logprobs} logprobs; rest mass at most {rest:.2e} on average), "
          f"{params.num_chats} chats x {params.max_new_tokens} greedy tokens, "
          f"{'cuda' if cuda else 'cpu'}; {duration / 60:.1f} min\n")
    print(render_table(report))
    for name, error in failures.items():
        print(f"\n{name} FAILED: {error.splitlines()[-1] if error else ''}")
    if args.json:
        save(args.json, measurements, failures, params, cuda, duration, complete=True)
    return 1 if failures else 0


def save(path: Path, measurements: dict, failures: dict, params: RunParams, cuda: bool, duration: float,
         complete: bool) -> None:
    """The run's record so far (``complete`` false while engines remain), written whole."""
    facts = {"benchmark": "kv-accuracy", "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "device": "cuda" if cuda else "cpu", "params": dataclasses.asdict(params),
             "duration_s": duration, "failures": failures, "complete": complete}
    answers = {name: m.answer_texts for name, m in measurements.items()}
    write_json(path, to_json(assemble(measurements), answers=answers, **facts))


if __name__ == "__main__":
    sys.exit(main())
