"""End to end on the GPU: Proxima against stock vLLM 0.26 on a Llama-3-8B-shaped model (dummy
weights, bf16). Each engine configuration runs in its own process (plugin registry per process).

  greedy       64 prompts x 64 tokens, temperature 0, logprobs: Proxima vs stock TRITON_ATTN
  ample        8 GiB of KV, 256 requests (20-120 word prompts, 128 tokens): compute-bound tok/s
  tight        1 GiB of KV, 512 short-chat requests: running requests, preemptions, tok/s

Engines named *-fp8* run with --kv-cache-dtype fp8 (e4m3, vLLM's default scale 1.0 on these
uncalibrated weights): the same 1 GiB holds twice the tokens (run.sh e2e-fp8 runs those).

With --profile, each throughput job also reports where a step's time goes: host time per step
in the scheduler and in the model runner, host time per eager attention call (mixed steps run
attention outside CUDA graphs), from a second pass under torch.profiler GPU kernel time by kind
(attention, KV write, GEMM, other) against the wall time, and from a third under cProfile the
host functions that took the most time (engine core, scheduler and runner share the process).

With --shared-prefix, the tight job's requests share one 200-token system prompt (user turns of
20-100 tokens, outputs of 20-100), as chat traffic does: the prefix cache's case.

usage: python scripts/gpu/e2e.py MODEL_DIR OUT_DIR [--only NAME,...] [--profile] [--shared-prefix]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from e2e_profile import HostTimer, attention_impl, host_profile, kernel_profile  # scripts/gpu/

from proxima.engine.slot_table import DenseTileTally
from proxima.files import write_atomic
from proxima.load import random_prompt

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
}
SEEDED = {name for name in ENGINES if "-seeded" in name}
FULL_GRAPHS = {name for name in ENGINES if name.endswith("-full")}
FP8 = {name for name in ENGINES if "-fp8" in name}


def build_seeded_model(path: Path) -> None:
    from proxima.tiny_model import TinyModelSpec, build_tiny_model

    if not (path / "model.safetensors").exists():
        build_tiny_model(path, TinyModelSpec(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                             num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                             init_std=0.05, seed=1))


class Recorder:
    """A telemetry sink that keeps every KV publication of the scheduler (at most one per
    PROXIMA_TELEMETRY_INTERVAL_S while busy: a time sample, not every step)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []

    def publish(self, stats) -> None:
        self.steps.append((stats.num_requests, stats.slots_used, stats.live_tokens))

    def set_static(self, *a) -> None: ...
    def observe_latencies(self, *a) -> None: ...
    def count_preemption(self) -> None: ...
    def request_finished(self, *a) -> None: ...


def prompts(n: int, seed: int, lo: int, hi: int) -> list[str]:
    rng = random.Random(seed)
    return [random_prompt(rng, lo, hi) for _ in range(n)]


def child(model: str, name: str, out: Path, profile: bool = False, shared_prefix: bool = False) -> None:
    proxima, backend, kv_bytes, jobs = ENGINES[name]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if proxima:
        os.environ["PROXIMA_ALLOCATOR"] = "token" if proxima is True else proxima
    from vllm import LLM, SamplingParams

    timer = HostTimer()
    if profile:
        impl = attention_impl(backend)
        timer.wrap(impl, "forward", "attention forward (eager)")
        timer.wrap(impl, "do_kv_cache_update", "kv write (eager)")

    seeded = name in SEEDED
    if seeded:
        model = str(Path(model).parent / "seeded-model")
    kw = dict(load_format="auto" if seeded else "dummy", dtype="bfloat16", max_model_len=2048, seed=0,
              kv_cache_memory_bytes=kv_bytes, max_num_seqs=512, attention_backend=backend)
    # Prefix caching at vLLM's default (on) for every engine, as users run stock.
    if name in FULL_GRAPHS:
        kw["compilation_config"] = {"cudagraph_mode": "FULL"}
    if name in FP8:
        kw["kv_cache_dtype"] = "fp8"
    if proxima is True:
        kw.update(block_size=1, scheduler_cls="proxima.engine.scheduler.ProximaScheduler")
    elif proxima == "block":
        kw.update(block_size=16, scheduler_cls="proxima.engine.scheduler.ProximaScheduler")
    else:
        kw.update(block_size=16)
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    result: dict = {"engine": name, "init_s": time.perf_counter() - t0}
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    running: list[int] = []
    preemptions = [0]
    schedule, preempt = scheduler.schedule, scheduler._preempt_request

    # (contexts read, contexts prefilled) while the untimed contiguity pass runs: it costs ms per step
    tallies: list[DenseTileTally] = []

    def timed(*a, **k):
        out_ = schedule(*a, **k)
        running.append(len(scheduler.running))
        if tallies:  # contiguous KV tiles of every context read, and of those prefilled
            table = scheduler.kv_cache_manager.table
            tallies[0].add(table, (r.request_id for r in scheduler.running))
            tallies[1].add(table, (rid for rid, n in out_.num_scheduled_tokens.items() if n > 1))
        return out_

    def counted(*a, **k):
        preemptions[0] += 1
        return preempt(*a, **k)

    scheduler.schedule, scheduler._preempt_request = timed, counted
    if profile:
        core = llm.llm_engine.engine_core.engine_core
        timer.wrap(scheduler, "schedule", "scheduler.schedule")
        timer.wrap(scheduler, "update_from_output", "scheduler.update_from_output")
        timer.wrap(core.model_executor, "execute_model", "executor.execute_model")
        timer.wrap(core.model_executor, "sample_tokens", "executor.sample_tokens")
    recorder = Recorder()
    if hasattr(scheduler, "kv_sinks"):
        scheduler.kv_sinks.append(recorder)
    for job in jobs:
        running.clear()
        preemptions[0] = 0
        if job == "greedy":
            ps = prompts(64, 1, 20, 120)
            outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=64, logprobs=1, ignore_eos=True),
                                use_tqdm=False)
            result["greedy"] = [
                {"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                for o in outs
            ]
            continue
        if job == "ample":
            n = 256
            ps = prompts(n, 2, 20, 120)
            sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        else:  # short chat with exact lengths: prompts of 50-200 tokens, outputs of 20-100
            from vllm import TokensPrompt

            n, rng = 512, random.Random(3)
            system = [rng.randrange(3, 500) for _ in range(200)] if shared_prefix else []
            lo, hi = (20, 100) if shared_prefix else (50, 200)
            ps = [TokensPrompt(prompt_token_ids=system + [rng.randrange(3, 500)
                                                          for _ in range(rng.randint(lo, hi))])
                  for _ in range(n)]
            sp = [SamplingParams(temperature=0, max_tokens=rng.randint(20, 100), ignore_eos=True)
                  for _ in range(n)]
        llm.generate(ps[:8], sp[:8] if isinstance(sp, list) else sp, use_tqdm=False)  # warm-up
        running.clear()
        recorder.steps.clear()
        preemptions[0] = 0
        timer.reset()
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        host = timer.report(len(running))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        busy = [r for r in running if r > 0]
        result[job] = {"requests": n, "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
                       "running_mean": sum(busy) / max(len(busy), 1), "running_peak": max(running, default=0),
                       "preemptions": preemptions[0], "wrapper_steps": len(running),
                       "recorded_steps": len(recorder.steps),
                       "requests_mean": (sum(r for r, _, _ in recorder.steps if r) /
                                         max(1, sum(1 for r, _, _ in recorder.steps if r))),
                       "requests_peak": max((r for r, _, _ in recorder.steps), default=0),
                       "slot_efficiency": (sum(lv / u for _, u, lv in recorder.steps if u) /
                                           max(1, sum(1 for _, u, _ in recorder.steps if u))),
                       "slots_total": (getattr(scheduler, "last_kv_stats", None)
                                       and scheduler.last_kv_stats.slots_total)}
        if proxima is True:  # the same workload again, untimed, reading each step's slot lists
            tallies[:] = [DenseTileTally(), DenseTileTally("prefill_dense_tiles")]
            llm.generate(ps, sp, use_tqdm=False)
            result[job].update(**tallies[0].shares(), **tallies[1].shares())
            tallies.clear()
        if profile:
            result[job]["host"] = host
            result[job]["kernels"] = kernel_profile(lambda ps=ps, sp=sp: llm.generate(ps, sp, use_tqdm=False))
            result[job]["cprofile"] = host_profile(lambda ps=ps, sp=sp: llm.generate(ps, sp, use_tqdm=False))
    write_atomic(out, json.dumps(result))


def main() -> None:
    model, out_dir = sys.argv[1], Path(sys.argv[2])
    only = None
    if "--only" in sys.argv:
        only = set(sys.argv[sys.argv.index("--only") + 1].split(","))
    profile = [f for f in ("--profile", "--shared-prefix") if f in sys.argv]
    out_dir.mkdir(parents=True, exist_ok=True)
    if not only or only & SEEDED:
        build_seeded_model(Path(model).parent / "seeded-model")
    for name in ENGINES:
        if only and name not in only:
            continue
        out = out_dir / f"{name}.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", model, name, str(out), *profile], env=env,
                              capture_output=True, text=True, timeout=300)
        write_atomic(out_dir / f"{name}.log", proc.stdout[-20000:] + proc.stderr[-60000:])
        print(f"{name}: rc={proc.returncode} in {time.perf_counter() - t:.0f}s", flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], flush=True)
    summarize(out_dir)


def summarize(out_dir: Path) -> None:
    res = {p.stem: json.loads(p.read_text()) for p in out_dir.glob("*.json") if p.stem in ENGINES}
    for ours, theirs in (("proxima-8g", "stock-triton-8g"), ("proxima-seeded", "stock-triton-seeded"),
                         ("proxima-seeded", "stock-fa3-seeded"), ("stock-fa3-seeded", "stock-triton-seeded"),
                         ("proxima-seeded-fp8", "stock-triton-seeded-fp8"),
                         ("proxima-seeded-fp8", "stock-fa3-seeded-fp8"),
                         ("stock-fa3-seeded-fp8", "stock-triton-seeded-fp8"),
                         ("proxima-seeded-fp8", "proxima-seeded")):
        if ours in res and theirs in res and "greedy" in res[ours]:
            compare_greedy(ours, theirs, res[ours]["greedy"], res[theirs]["greedy"])
    summarize_throughput(res)


def compare_greedy(ours: str, theirs: str, a: list, b: list) -> None:
    same_tokens = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra["tokens"], rb["tokens"]))
    total = sum(len(r["tokens"]) for r in a)
    identical = sum(ra["tokens"] == rb["tokens"] for ra, rb in zip(a, b))
    first_div = [next((i for i, (x, y) in enumerate(zip(ra["tokens"], rb["tokens"])) if x != y), None)
                 for ra, rb in zip(a, b)]
    # Logprobs compared up to (excluding) the first divergence, where both saw the same prefix.
    diffs = [abs(x - y) for ra, rb, d in zip(a, b, first_div)
             for x, y in list(zip(ra["logprobs"], rb["logprobs"]))[: d if d is not None else None]]
    distinct = len({t for r in a for t in r["tokens"]})
    print(f"greedy {ours} vs {theirs}: {distinct} distinct tokens generated; "
          f"{identical}/{len(a)} sequences identical; {same_tokens}/{total} positions equal; "
          f"first divergences at {sorted(x for x in first_div if x is not None)[:10]}; "
          f"max |logprob diff| before divergence {max(diffs, default=0):.4f}, "
          f"mean {sum(diffs) / max(len(diffs), 1):.5f}")


def summarize_throughput(res: dict) -> None:
    for job in ("ample", "tight"):
        for name, r in res.items():
            if job in r:
                j = r[job]
                extra = ""
                if j.get("recorded_steps"):
                    extra = (f"  [telemetry: {j['recorded_steps']} publishes, "
                             f"requests mean {j['requests_mean']:.1f} "
                             f"peak {j['requests_peak']}, slot efficiency {j['slot_efficiency']:.3f}]")
                print(f"{job:>6} {name:<16} tok/s {j['output_tok_s']:>9.0f}  "
                      f"running mean {j['running_mean']:>6.1f} peak {j['running_peak']:>4}  "
                      f"preemptions {j['preemptions']:>5}  wall {j['wall_s']:.1f}s "
                      f"init {r['init_s']:.0f}s  wrapper steps {j.get('wrapper_steps')}{extra}")
                summarize_profile(j)


def summarize_profile(j: dict) -> None:
    steps = max(j.get("wrapper_steps") or 1, 1)
    if "host" in j:
        print(f"         ms per step {1e3 * j['wall_s'] / steps:.2f}; host: " + "; ".join(
            f"{label} {h['ms_per_step']:.2f} ms/step ({h['us_per_call']:.1f} us x {h['calls']})"
            for label, h in j["host"].items()))
    if "kernels" in j:
        k = j["kernels"]
        kinds = ", ".join(f"{kind} {ms / steps:.2f}" for kind, ms in sorted(k["gpu_ms_by_kind"].items()))
        print(f"         GPU ms per step (profiled pass): total {k['gpu_ms_total'] / steps:.2f} = {kinds}; "
              f"profiled wall {k['wall_ms'] / steps:.2f} ms/step")
        for ms, count, kname in k["top_kernels"][:8]:
            print(f"           {ms:9.1f} ms  x{count:<7} {kname}")
    if "cprofile" in j:
        print("         host self time under cProfile (third pass):")
        lines = j["cprofile"].splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        for line in lines[start:start + 26]:
            print("           " + line.replace(str(Path(sys.prefix)), "")[:150])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], Path(sys.argv[4]), profile="--profile" in sys.argv,
              shared_prefix="--shared-prefix" in sys.argv)
    else:
        main()
