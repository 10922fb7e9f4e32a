"""End to end on the GPU: Proxima against stock vLLM 0.26 on a Llama-3-8B-shaped model (dummy
weights, bf16), each engine configuration through the engine harness in a process of its own.

  greedy       64 prompts x 64 tokens, temperature 0, logprobs: Proxima vs stock TRITON_ATTN
  ample        8 GiB of KV, 256 requests (20-120 word prompts, 128 tokens): compute-bound tok/s
  tight        1 GiB of KV, 512 short-chat requests: running requests, preemptions, tok/s

Proxima engines get the flags `proxima serve` gives vLLM (proxima.harness reuses its command
line); stock engines are plain vLLM whose scheduler only reports steps and preemptions
(proxima.engine.observed). Each step's running requests and each preemption come from the
harness's recorder. Engines named *-fp8* run with --kv-cache-dtype fp8 (e4m3, vLLM's default
scale 1.0 on these uncalibrated weights): the same 1 GiB holds twice the tokens.

With `profile`, each throughput job also reports where a step's time goes: host time per step
in the scheduler and in the model runner, host time per eager attention call (mixed steps run
attention outside CUDA graphs; kit/profiling.HostTimer observes those functions, wrapping
nothing), from a second pass under torch.profiler GPU kernel time by kind (attention, KV write,
GEMM, other) against the wall time, and from a third under cProfile the host functions that
took the most time (engine core, scheduler and runner share the process).

For each N in `shared_prefix` the tight job runs once in the same engine, which starts once: with
N > 0 its requests share one N-token system prompt (user turns of 20-100 tokens, outputs of
20-100), as chat traffic does, the prefix cache's case. Results: `tight` (N = 0) and
`tight-shared<N>`. `tiles` False skips Proxima's untimed second pass that
counts contiguous KV tiles.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

from kit.calls import attention_impl
from kit.e2e_report import load, summarize, summarize_starts
from kit.profiling import HostTimer, host_profile, kernel_profile
from proxima.engine.settings import INT4_DECODE_ENV
from proxima.files import write_atomic
from proxima.harness import EngineProcessError, EngineSpec, open_engine, run_isolated, vllm_flags
from proxima.harness.tiles import ContextTiles
from proxima.load import random_prompt
from proxima.serve_graphs import full_graphs

GiB = 1 << 30
ENGINES = {
    # name: (proxima?, attention backend, kv bytes, jobs)
    "stock-triton-8g": (False, "TRITON_ATTN", 8 * GiB, ["greedy", "ample"]),
    "stock-fa3-8g": (False, "FLASH_ATTN", 8 * GiB, ["ample"]),
    "proxima-8g": (True, "CUSTOM", 8 * GiB, ["greedy", "ample"]),
    "stock-fa3-1g": (False, "FLASH_ATTN", 1 * GiB, ["tight"]),
    "stock-triton-1g": (False, "TRITON_ATTN", 1 * GiB, ["tight"]),
    # vLLM's default (FULL_AND_PIECEWISE) runs attention outside CUDA graphs in mixed
    # prefill+decode steps; FULL captures those steps too (both backends support it).
    "proxima-1g-full": (True, "CUSTOM", 1 * GiB, ["tight"]),
    "stock-fa3-1g-full": (False, "FLASH_ATTN", 1 * GiB, ["tight"]),
    "proxima-8g-full": (True, "CUSTOM", 8 * GiB, ["ample"]),
    "stock-fa3-8g-full": (False, "FLASH_ATTN", 8 * GiB, ["ample"]),
    "proxima-1g": (True, "CUSTOM", 1 * GiB, ["tight"]),
    # Stock allocation and FA3, observed by Proxima's scheduler (PROXIMA_ALLOCATOR=block): the
    # per-step request and slot counts come from the same telemetry as Proxima's.
    "observed-fa3-1g": ("block", "FLASH_ATTN", 1 * GiB, ["tight"]),
    # vLLM's dummy weights give near-uniform logits (every logprob ~ -ln(vocab)), so greedy
    # agreement on them proves nothing. These two load seeded random weights with wide logits
    # (proxima.tiny_model, 8B-like attention: head 128, GQA 4:1) in bf16.
    "stock-triton-seeded": (False, "TRITON_ATTN", 2 * GiB, ["greedy"]),
    "proxima-seeded": (True, "CUSTOM", 2 * GiB, ["greedy"]),
    # Control: two stock kernels against each other, to size bf16 divergence between kernels.
    "stock-fa3-seeded": (False, "FLASH_ATTN", 2 * GiB, ["greedy"]),
    # fp8 KV cache. Stock GPU backends also quantise the queries to fp8 (q_scale 1.0); Proxima
    # keeps them bf16, so greedy agreement is judged against the stock-vs-stock control pair.
    "stock-fa3-1g-fp8": (False, "FLASH_ATTN", 1 * GiB, ["tight"]),
    "stock-fa3-1g-fp8-full": (False, "FLASH_ATTN", 1 * GiB, ["tight"]),
    "proxima-1g-fp8": (True, "CUSTOM", 1 * GiB, ["tight"]),
    "proxima-1g-fp8-full": (True, "CUSTOM", 1 * GiB, ["tight"]),
    "stock-triton-seeded-fp8": (False, "TRITON_ATTN", 2 * GiB, ["greedy"]),
    "stock-fa3-seeded-fp8": (False, "FLASH_ATTN", 2 * GiB, ["greedy"]),
    "proxima-seeded-fp8": (True, "CUSTOM", 2 * GiB, ["greedy"]),
    # vLLM 0.26's per-token-head KV (TRITON_ATTN only on stock; it does not run eagerly): int4
    # packs two values a byte behind a Hadamard rotation, int8 one; each row has its own scale.
    "stock-triton-1g-int4": (False, "TRITON_ATTN", 1 * GiB, ["tight"]),
    # Stock int4 with FULL graphs as well as at its default, to know which is its stronger form.
    "stock-triton-1g-int4-full": (False, "TRITON_ATTN", 1 * GiB, ["tight"]),
    "proxima-1g-int4-full": (True, "CUSTOM", 1 * GiB, ["tight"]),
    "stock-triton-1g-int8": (False, "TRITON_ATTN", 1 * GiB, ["tight"]),
    "proxima-1g-int8-full": (True, "CUSTOM", 1 * GiB, ["tight"]),
    "stock-triton-seeded-int4": (False, "TRITON_ATTN", 2 * GiB, ["greedy"]),
    "proxima-seeded-int4": (True, "CUSTOM", 2 * GiB, ["greedy"]),
}
SEEDED = {name for name in ENGINES if "-seeded" in name}
FULL_GRAPHS = {name for name in ENGINES if name.endswith("-full")}
KV_DTYPES = {"-fp8": "fp8", "-int4": "int4_per_token_head", "-int8": "int8_per_token_head"}


def kv_cache_dtype(name: str) -> str | None:
    """The --kv-cache-dtype an engine runs with, from its name (None: the model's dtype)."""
    return next((dtype for tag, dtype in KV_DTYPES.items() if tag in name), None)


def build_seeded_model(path: Path) -> None:
    from proxima.tiny_model import TinyModelSpec, build_tiny_model

    if not (path / "model.safetensors").exists():
        build_tiny_model(path, TinyModelSpec(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                             num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                             init_std=0.05, seed=1))


def engine_spec(model: str, name: str, graph_tokens: int | None = None) -> EngineSpec:
    """`graph_tokens`: the largest step the *-full engines replay from a CUDA graph (vLLM's
    max_cudagraph_capture_size; None: `proxima serve`'s, 2,048, the stronger form of stock's FULL
    graphs as well; vLLM's default is 512 here). Larger steps run outside graphs, paying each
    layer's host launch cost."""
    proxima, backend, kv_bytes, _ = ENGINES[name]
    seeded = name in SEEDED
    if seeded:
        model = str(Path(model).parent / "seeded-model")
    # Prefix caching at vLLM's default (on) for every engine, as users run stock. CUDA graphs:
    # FULL for the *-full engines; the others name vLLM's default level, so that Proxima's get
    # vLLM's default graphs too (proxima serve would otherwise choose FULL for them).
    full = full_graphs(graph_tokens) if graph_tokens else full_graphs()
    graphs = {"compilation_config": full} if name in FULL_GRAPHS else {"optimization_level": 2}
    flags = vllm_flags(load_format="auto" if seeded else "dummy", dtype="bfloat16", max_model_len=2048,
                       seed=0, kv_cache_memory_bytes=kv_bytes, max_num_seqs=512, attention_backend=backend,
                       kv_cache_dtype=kv_cache_dtype(name),
                       block_size=None if proxima is True else 16, **graphs)
    variant = "token" if proxima is True else proxima or "stock"
    # One client measuring the allocator: token-exact hit figures. The harness sets the caller's
    # PROXIMA_* aside while an engine is built, so the int4 decode kernel's switch is carried in the
    # spec, built in the caller's process (`run`).
    env = {"PROXIMA_KV_FIGURES": "exact"}
    if os.environ.get(INT4_DECODE_ENV):
        env[INT4_DECODE_ENV] = os.environ[INT4_DECODE_ENV]
    return EngineSpec(model, variant, flags, env=env)


def prompts(n: int, seed: int, lo: int, hi: int) -> list[str]:
    rng = random.Random(seed)
    return [random_prompt(rng, lo, hi) for _ in range(n)]


def workload(job_name: str, shared_prefix: int):
    """(requests, prompts, sampling params) of a throughput job."""
    from vllm import SamplingParams, TokensPrompt

    if job_name == "ample":
        return 256, prompts(256, 2, 20, 120), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    # short chat with exact lengths: prompts of 50-200 tokens, outputs of 20-100
    n, rng = 512, random.Random(3)
    system = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    lo, hi = (20, 100) if shared_prefix else (50, 200)
    ps = [TokensPrompt(prompt_token_ids=system + [rng.randrange(3, 500)
                                                  for _ in range(rng.randint(lo, hi))])
          for _ in range(n)]
    return n, ps, [SamplingParams(temperature=0, max_tokens=rng.randint(20, 100), ignore_eos=True)
                   for _ in range(n)]


def tight_key(shared_prefix: int) -> str:
    """The result key of the tight job with that shared prompt."""
    return f"tight-shared{shared_prefix}" if shared_prefix else "tight"


def job(spec: EngineSpec, name: str, profile: bool = False, shared_prefix: tuple[int, ...] = (0,),
        tiles: bool = True, repeats: int = 1) -> dict:
    """One engine's jobs (run in a process of its own, from the spec `run` built in the caller's:
    the job process starts without the caller's PROXIMA_*). ``repeats`` > 1 times a throughput
    job's burst that many times in this engine, each from the same cache state (prefix cache reset,
    the warm-up again): its figures are the first run's, with every run's tok/s and their median.
    A burst of 512 short chats lasts 4-6 s on an H200 and stock int4 gave 5,418 and 6,650 tok/s in
    two runs of one pair, while an engine starts in 15-80 s (docs/results/h200-2026-12-05b,
    -12-06): repeats are the cheap way to steady a pair."""
    from vllm import SamplingParams

    proxima, backend, _, jobs = ENGINES[name]
    timer = HostTimer() if profile else None
    t0 = time.perf_counter()
    with open_engine(spec) as engine:
        # The most tokens a step replayed from a CUDA graph holds (0: no graphs, as on CPU).
        sizes = engine.scheduler.vllm_config.compilation_config.cudagraph_capture_sizes
        result: dict = {"engine": name, "init_s": time.perf_counter() - t0, "graph_tokens": max(sizes or [0])}
        if proxima is True and kv_cache_dtype(name) == "int4_per_token_head":
            from proxima.engine.attention import launch_args

            # The switch its layers took as it was built (the Gluon kernel serves only on sm_80+ GPUs).
            result["int4_decode_switch"] = launch_args.INT4_DECODE
        llm, recorder = engine.llm, engine.recorder
        if timer is not None:
            watch_host(timer, engine, backend)
        burst_jobs = [(tight_key(p) if job_name == "tight" else job_name, job_name, p)
                      for job_name in jobs for p in (shared_prefix if job_name == "tight" else (0,))]
        for key, job_name, prefix in burst_jobs:
            if job_name == "greedy":
                outs = llm.generate(prompts(64, 1, 20, 120),
                                    SamplingParams(temperature=0, max_tokens=64, logprobs=1, ignore_eos=True),
                                    use_tqdm=False)
                result["greedy"] = [{"tokens": list(o.outputs[0].token_ids),
                                     "logprobs": [lp[t].logprob for lp, t in
                                                  zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                                    for o in outs]
                continue
            n, ps, sp = workload(job_name, prefix)
            runs = []
            for _ in range(repeats):
                llm.reset_prefix_cache()  # every burst from an empty cache, the engine's second burst too
                llm.generate(ps[:8], sp[:8] if isinstance(sp, list) else sp, use_tqdm=False)  # warm-up
                recorder.reset()
                if timer is not None:
                    timer.reset()
                t = time.perf_counter()
                outs = llm.generate(ps, sp, use_tqdm=False)
                ended = time.perf_counter()
                runs.append(throughput(recorder, outs, n, ended - t, ended))
            result[key] = runs[0]
            if repeats > 1:
                result[key]["repeat_tok_s"] = [r["output_tok_s"] for r in runs]
                result[key]["repeat_running_mean"] = [r["running_mean"] for r in runs]
                result[key]["output_tok_s_median"] = statistics.median(r["output_tok_s"] for r in runs)
            if timer is not None:
                result[key]["host"] = timer.report(len(recorder.steps))
            if proxima is True and tiles:  # the same workload again, untimed, reading each step's slot lists
                counter = ContextTiles(engine)
                with engine.listening(counter):
                    llm.generate(ps, sp, use_tqdm=False)
                result[key].update(counter.shares())
            if profile:
                def again(ps=ps, sp=sp):  # from the cache state a timed run starts from
                    llm.reset_prefix_cache()
                    return llm.generate(ps, sp, use_tqdm=False)

                result[key]["kernels"] = kernel_profile(again)
                result[key]["cprofile"] = host_profile(again)
    if timer is not None:
        timer.close()
    return result


def watch_host(timer: HostTimer, engine, backend: str) -> None:
    """Host time of the scheduler's and the executor's step calls, and of eager attention."""
    scheduler, executor = type(engine.scheduler), type(engine.core.model_executor)
    impl = attention_impl(backend)
    timer.watch(scheduler.schedule, "scheduler.schedule")
    timer.watch(scheduler.update_from_output, "scheduler.update_from_output")
    timer.watch(executor.execute_model, "executor.execute_model")
    timer.watch(executor.sample_tokens, "executor.sample_tokens")
    timer.watch(impl.forward, "attention forward (eager)")
    timer.watch(impl.do_kv_cache_update, "kv write (eager)")


def throughput(recorder, outs, requests: int, wall: float, ended: float) -> dict:
    """A timed run's figures: tok/s, running requests per step, preemptions and, from the KV
    telemetry published meanwhile (at most one per PROXIMA_TELEMETRY_INTERVAL_S), requests and
    slot efficiency. Each step's row ends with its period in ms (`ended`: perf_counter when the
    run returned): where a run's wall time went, by step, with no profiler attached."""
    periods = recorder.step_periods(ended)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    published = [s.kv for s in recorder.steps if s.kv is not None]
    holding = [kv.requests_holding_slots for kv in published if kv.requests_holding_slots]
    while_waiting, waiting_steps = recorder.running_mean_while_waiting()
    return {"requests": requests, "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "running_mean": recorder.running_mean(), "running_peak": recorder.running_peak(),
            "running_mean_while_waiting": while_waiting, "waiting_steps": waiting_steps,
            # per step: running, waiting, tokens scheduled, preemptions, period ms (for later analysis)
            "steps": [[s.num_running, s.num_waiting, s.num_scheduled_tokens, s.preemptions,
                       round(1e3 * period, 3)] for s, period in zip(recorder.steps, periods)],
            "preemptions": recorder.preemptions, "wrapper_steps": len(recorder.steps),
            "recorded_steps": len(published),
            "requests_mean": sum(holding) / max(1, len(holding)),
            "requests_peak": max((kv.requests_holding_slots for kv in published), default=0),
            "slot_efficiency": recorder.slot_efficiency(),
            "slots_total": recorder.last_kv and recorder.last_kv.slots_total}


def run(model: str, out_dir: Path, only: set[str] | None, profile: bool,
        shared_prefix: tuple[int, ...] = (0,), tiles: bool = True, repeats: int = 1, starts: int = 1,
        graph_tokens: int | None = None) -> None:
    """Every engine (or those in `only`) in a fresh process, one after the other; then the summary.
    With `starts` > 1 the engines start that many times in turn, each start's files in
    out_dir/start<i>, every other start in reverse order (so no engine always runs first or last
    on a warming machine), and the summary is across starts (kit/e2e_report.py)."""
    if not only or only & SEEDED:
        build_seeded_model(Path(model).parent / "seeded-model")
    names = [name for name in ENGINES if not only or name in only]
    if starts == 1:
        run_start(model, out_dir, names, profile, shared_prefix, tiles, repeats, graph_tokens)
        summarize(out_dir, ENGINES)
        return
    folders = [out_dir / f"start{i + 1}" for i in range(starts)]
    for i, folder in enumerate(folders):
        print(f"start {i + 1} of {starts}", flush=True)
        run_start(model, folder, names[::-1] if i % 2 else names, profile, shared_prefix, tiles, repeats,
                  graph_tokens)
    summarize_starts([load(folder, ENGINES) for folder in folders])


def run_start(model: str, out_dir: Path, names: list[str], profile: bool, shared_prefix: tuple[int, ...],
              tiles: bool, repeats: int, graph_tokens: int | None = None) -> None:
    """One start of each engine in `names`, in that order: its JSON and log in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        log = out_dir / f"{name}.log"
        log.unlink(missing_ok=True)
        t = time.perf_counter()
        try:
            spec = engine_spec(model, name, graph_tokens)
            result = run_isolated(job, spec, name, profile, shared_prefix, tiles, repeats, timeout=300,
                                  log_path=log)
        except EngineProcessError as err:
            # The error's head (the child's traceback), then the engine log's tail.
            print(f"{name}: failed in {time.perf_counter() - t:.0f}s\n{str(err)[:8000]}", flush=True)
            continue
        write_atomic(out_dir / f"{name}.json", json.dumps(result))
        print(f"{name}: ok in {time.perf_counter() - t:.0f}s", flush=True)
