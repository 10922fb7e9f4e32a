"""End to end on the GPU: Proxima against stock vLLM 0.26 on a Llama-3-8B-shaped model (dummy
weights, bf16). Each engine configuration runs in its own process (plugin registry per process).

  greedy       64 prompts x 64 tokens, temperature 0, logprobs: Proxima vs stock TRITON_ATTN
  ample        8 GiB of KV, 256 requests (20-120 word prompts, 128 tokens): compute-bound tok/s
  tight        1 GiB of KV, 512 short-chat requests: running requests, preemptions, tok/s

usage: python scripts/gpu/e2e.py MODEL_DIR OUT_DIR [--only NAME,...]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bad kings "
         "memory slots cache tokens request serve model engine block page fragment free used").split()
GiB = 1 << 30
ENGINES = {
    # name: (proxima?, attention backend, kv bytes, jobs)
    "stock-triton-8g": (False, "TRITON_ATTN", 8 * GiB, ["greedy", "ample"]),
    "stock-fa3-8g": (False, "FLASH_ATTN", 8 * GiB, ["ample"]),
    "proxima-8g": (True, "CUSTOM", 8 * GiB, ["greedy", "ample"]),
    "stock-fa3-1g": (False, "FLASH_ATTN", 1 * GiB, ["tight"]),
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
}
SEEDED = {"stock-triton-seeded", "proxima-seeded", "stock-fa3-seeded"}


def build_seeded_model(path: Path) -> None:
    from proxima.tiny_model import TinyModelSpec, build_tiny_model

    if not (path / "model.safetensors").exists():
        build_tiny_model(path, TinyModelSpec(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                             num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                             init_std=0.05, seed=1))


class Recorder:
    """A telemetry sink that keeps every per-step KV publication of the scheduler."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []

    def publish(self, stats) -> None:
        self.steps.append((stats.num_requests, stats.slots_used, stats.live_tokens))

    def set_static(self, *a) -> None: ...
    def observe_latency(self, *a) -> None: ...
    def count_preemption(self) -> None: ...
    def request_finished(self, *a) -> None: ...


def prompts(n: int, seed: int, lo: int, hi: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def child(model: str, name: str, out: Path) -> None:
    proxima, backend, kv_bytes, jobs = ENGINES[name]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if proxima:
        os.environ["PROXIMA_ALLOCATOR"] = "token" if proxima is True else proxima
    from vllm import LLM, SamplingParams

    seeded = name in SEEDED
    if seeded:
        model = str(Path(model).parent / "seeded-model")
    kw = dict(load_format="auto" if seeded else "dummy", dtype="bfloat16", max_model_len=2048, seed=0,
              kv_cache_memory_bytes=kv_bytes, max_num_seqs=512, enable_prefix_caching=False,
              attention_backend=backend)
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

    def timed(*a, **k):
        out_ = schedule(*a, **k)
        running.append(len(scheduler.running))
        return out_

    def counted(*a, **k):
        preemptions[0] += 1
        return preempt(*a, **k)

    scheduler.schedule, scheduler._preempt_request = timed, counted
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
            ps = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 500) for _ in range(rng.randint(50, 200))])
                  for _ in range(n)]
            sp = [SamplingParams(temperature=0, max_tokens=rng.randint(20, 100), ignore_eos=True)
                  for _ in range(n)]
        llm.generate(ps[:8], sp[:8] if isinstance(sp, list) else sp, use_tqdm=False)  # warm-up
        running.clear()
        recorder.steps.clear()
        preemptions[0] = 0
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        wall = time.perf_counter() - t
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
                       "slots_total": getattr(scheduler, "last_kv_stats", None) and scheduler.last_kv_stats.slots_total}
    out.write_text(json.dumps(result))


def main() -> None:
    model, out_dir = sys.argv[1], Path(sys.argv[2])
    only = None
    if "--only" in sys.argv:
        only = set(sys.argv[sys.argv.index("--only") + 1].split(","))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not only or only & SEEDED:
        build_seeded_model(Path(model).parent / "seeded-model")
    for name in ENGINES:
        if only and name not in only:
            continue
        out = out_dir / f"{name}.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", model, name, str(out)], env=env,
                              capture_output=True, text=True, timeout=240)
        (out_dir / f"{name}.log").write_text(proc.stdout[-20000:] + proc.stderr[-60000:])
        print(f"{name}: rc={proc.returncode} in {time.perf_counter() - t:.0f}s", flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], flush=True)
    summarize(out_dir)


def summarize(out_dir: Path) -> None:
    res = {p.stem: json.loads(p.read_text()) for p in out_dir.glob("*.json") if p.stem in ENGINES}
    for ours, theirs in (("proxima-8g", "stock-triton-8g"), ("proxima-seeded", "stock-triton-seeded"),
                         ("proxima-seeded", "stock-fa3-seeded"), ("stock-fa3-seeded", "stock-triton-seeded")):
        if ours in res and theirs in res and "greedy" in res[ours]:
            compare_greedy(ours, theirs, res[ours]["greedy"], res[theirs]["greedy"])
    summarize_throughput(res)


def compare_greedy(ours: str, theirs: str, a: list, b: list) -> None:
    if True:
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
              f"max |logprob diff| before divergence {max(diffs, default=0):.4f}, mean {sum(diffs) / max(len(diffs), 1):.5f}")


def summarize_throughput(res: dict) -> None:
    for job in ("ample", "tight"):
        for name, r in res.items():
            if job in r:
                j = r[job]
                extra = ""
                if j.get("recorded_steps"):
                    extra = (f"  [telemetry: {j['recorded_steps']} steps, requests mean {j['requests_mean']:.1f} "
                             f"peak {j['requests_peak']}, slot efficiency {j['slot_efficiency']:.3f}]")
                print(f"{job:>6} {name:<16} tok/s {j['output_tok_s']:>9.0f}  running mean {j['running_mean']:>6.1f} "
                      f"peak {j['running_peak']:>4}  preemptions {j['preemptions']:>5}  wall {j['wall_s']:.1f}s "
                      f"init {r['init_s']:.0f}s  wrapper steps {j.get('wrapper_steps')}{extra}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    else:
        main()
