"""The H200 end-to-end burst's scheduling, replayed on CPU: the same requests (token counts from
scripts/gpu/kit/e2e.py's `tight` job), the same slot count and step budget, on the tiny model.

Running requests, preemptions and steps depend on token counts and slots alone (greedy,
`ignore_eos`), not on the weights or the device: at Proxima int4's 30,840 slots this gives what the
H200 gives (docs/benchmarks.md, issue 25), so scheduling changes can be tried here first.

usage: python scripts/burst_schedule_cpu.py [--slots 30840] [--shared-prefix 300] [--variant token]
                                            [--model DIR] [--json OUT]
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


def job(model: str, variant: str, slots: int, shared_prefix: int) -> dict:
    from kit.e2e import workload

    flags = vllm_flags(seed=0, kv_cache_memory_bytes=slots * TINY_BYTES_PER_TOKEN, max_num_seqs=512,
                       max_num_batched_tokens=16384, block_size=None if variant == "token" else 32)
    args = tuple("2048" if a == "1024" else a for a in TINY_CPU_ARGS)  # the H200 run's max_model_len
    spec = EngineSpec(model, variant, args + flags, env={"PROXIMA_KV_FIGURES": "exact"})
    with open_engine(spec) as engine:
        llm, recorder = engine.llm, engine.recorder
        n, prompts, params = workload("tight", shared_prefix)
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up, as on the GPU
        recorder.reset()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        waiting_mean, waiting_steps = recorder.running_mean_while_waiting()
        return {"requests": n, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "wall_s": time.perf_counter() - start, "steps": len(recorder.steps),
                "running_mean": recorder.running_mean(), "running_peak": recorder.running_peak(),
                "running_mean_while_waiting": waiting_mean, "waiting_steps": waiting_steps,
                "preemptions": recorder.preemptions,
                "step_counts": [[s.num_running, s.num_waiting, s.num_scheduled_tokens, s.preemptions]
                                for s in recorder.steps]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=30840, help="KV slots (Proxima int4 at 1 GiB on the H200)")
    p.add_argument("--shared-prefix", type=int, default=300, help="system prompt tokens (0: short chats)")
    p.add_argument("--variant", default="token", choices=("token", "block"))
    p.add_argument("--model", default=".proxima/tiny-model")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    r = run_isolated(job, args.model, args.variant, args.slots, args.shared_prefix, timeout=1800)
    print(f"{args.variant} at {args.slots} slots, shared prefix {args.shared_prefix}: {r['steps']} steps, "
          f"running mean {r['running_mean']:.1f}, while requests wait {r['running_mean_while_waiting']:.1f} "
          f"over {r['waiting_steps']} steps, peak {r['running_peak']}, {r['preemptions']} preemptions, "
          f"{r['output_tokens']} output tokens")
    if args.json:
        write_atomic(args.json, json.dumps(r))


if __name__ == "__main__":
    main()
