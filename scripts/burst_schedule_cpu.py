"""The H200 end-to-end burst's scheduling, replayed on CPU: the same requests (token counts from
scripts/gpu/kit/e2e.py's `tight` job), the same slot count and step budget, on the tiny model.

Running requests, preemptions and steps depend on token counts and slots alone (greedy,
`ignore_eos`), not on the weights or the device: at Proxima int4's 30,840 slots this gives what the
H200 gives (docs/benchmarks.md, issue 25), so scheduling changes can be tried here first.

`--step-cap N`, a what-if: while requests run, no step schedules more than N tokens (steps then
fit a CUDA graph of N tokens; vLLM has no such setting, so the job patches its scheduler's
budget). `scripts/price_steps.py` prices a run's steps in a GPU run's costs.

usage: python scripts/burst_schedule_cpu.py [--slots 30840] [--shared-prefix 300] [--variant token]
                                            [--step-cap N] [--model DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

from proxima.files import write_atomic  # noqa: E402
from proxima.harness import TINY_CPU_ARGS, EngineSpec, open_engine, run_isolated, vllm_flags  # noqa: E402

TINY_BYTES_PER_TOKEN = 1024  # the tiny model's float32 K and V: 2 layers x 2 x 2 heads x 32 x 4 bytes


def job(model: str, variant: str, slots: int, shared_prefix: int, step_cap: int = 0) -> dict:
    from kit.e2e import throughput, workload

    if step_cap:
        cap_running_steps(step_cap)

    # vLLM keeps the last of a repeated flag: the H200 run's max_model_len over the tiny default.
    flags = vllm_flags(seed=0, kv_cache_memory_bytes=slots * TINY_BYTES_PER_TOKEN, max_num_seqs=512,
                       max_num_batched_tokens=16384, max_model_len=2048,
                       block_size=None if variant == "token" else 32)
    spec = EngineSpec(model, variant, TINY_CPU_ARGS + flags, env={"PROXIMA_KV_FIGURES": "exact"})
    with open_engine(spec) as engine:
        llm, recorder = engine.llm, engine.recorder
        n, prompts, params = workload("tight", shared_prefix)
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up, as on the GPU
        recorder.reset()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        ended = time.perf_counter()
        result = throughput(recorder, outs, n, ended - start, ended)
    return result | {"step_bounds": step_bounds(prompts, params, slots, shared_prefix)}


def cap_running_steps(cap: int) -> None:
    """Patch this process's vLLM scheduler: `cap` tokens a step while any request runs."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule

    def capped(self, *args, **kwargs):
        full = self.__dict__.setdefault("_uncapped_budget", self.max_num_scheduled_tokens)
        self.max_num_scheduled_tokens = min(cap, full) if self.running else full
        return schedule(self, *args, **kwargs)

    Scheduler.schedule = capped


def step_bounds(prompts, params, slots: int, shared_prefix: int) -> dict:
    """Fewest steps any schedule of the burst could take: by KV memory (every request's private
    tokens held at each of its steps, the shared prompt once) and by its longest answer."""
    token_steps = sum(sum(len(p["prompt_token_ids"]) - shared_prefix + t for t in range(sp.max_tokens))
                      for p, sp in zip(prompts, params))
    return {"memory": token_steps / (slots - shared_prefix),
            "longest_answer": max(sp.max_tokens for sp in params)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=30840, help="KV slots (Proxima int4 at 1 GiB on the H200)")
    p.add_argument("--shared-prefix", type=int, default=300, help="system prompt tokens (0: short chats)")
    p.add_argument("--variant", default="token", choices=("token", "block"))
    p.add_argument("--step-cap", type=int, default=0, metavar="N",
                   help="while requests run, at most N tokens a step (a what-if; 0: vLLM's budget)")
    p.add_argument("--model", default=".proxima/tiny-model")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    r = run_isolated(job, args.model, args.variant, args.slots, args.shared_prefix, args.step_cap,
                     timeout=1800)
    bounds = r["step_bounds"]
    print(f"{args.variant} at {args.slots} slots, shared prefix {args.shared_prefix}: {r['wrapper_steps']} "
          f"steps (no schedule takes fewer than {bounds['memory']:.0f} by memory, {bounds['longest_answer']} "
          f"by the longest answer), running mean {r['running_mean']:.1f}, while requests wait "
          f"{r['running_mean_while_waiting']:.1f} over {r['waiting_steps']} steps, peak {r['running_peak']}, "
          f"{r['preemptions']} preemptions, {r['output_tokens']} output tokens")
    if args.json:
        write_atomic(args.json, json.dumps(r))


if __name__ == "__main__":
    main()
