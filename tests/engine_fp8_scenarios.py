"""Run the engine-equivalence prompts on one real vLLM engine with a chosen KV cache dtype; write JSON.

Executed as a subprocess by tests/test_engine_fp8.py (vLLM's plugins and attention registry are
per process), once per (engine, KV dtype, block size). Same 120 varied prompts, step budget and
KV budget in bytes as tests/engine_scenarios.py, greedy, with the chosen token's logprob at every
position, and the KV geometry the engine ended up with (slots, and for Proxima the bytes per
token its scheduler published on /metrics).

usage: python tests/engine_fp8_scenarios.py MODEL_DIR {token,stock} KV_DTYPE BLOCK_SIZE OUT.json
"""

from __future__ import annotations

import json
import os
import random
import sys

from engine_scenarios import count_preemptions, engine_kwargs, prompts, slot_state


def run(model: str, variant: str, kv_cache_dtype: str, block_size: int) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = engine_kwargs(variant)
    kwargs.update(kv_cache_dtype=kv_cache_dtype)
    if variant == "stock":
        kwargs.update(block_size=block_size)
    llm = LLM(model, **kwargs)
    preempted = count_preemptions(llm)
    ps = prompts(120, seed=1)
    rng = random.Random(2)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 48), ignore_eos=True, logprobs=1)
              for _ in ps]
    results = llm.generate(ps, params, use_tqdm=False)
    outputs, logprobs = [], []
    for r in results:
        completion = r.outputs[0]
        outputs.append(list(completion.token_ids))
        chosen = zip(completion.token_ids, completion.logprobs)
        logprobs.append([step[token].logprob for token, step in chosen])
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    out = {
        "variant": variant, "kv_cache_dtype": kv_cache_dtype, "block_size": block_size,
        "outputs": outputs, "logprobs": logprobs, "preemptions": preempted[0], "after": slot_state(llm),
    }
    exporter = getattr(scheduler, "kv_exporter", None)
    if exporter is not None:  # Proxima's scheduler: what /metrics states
        for key, name in (("bytes_per_token", "proxima_kv_bytes_per_token"),
                          ("cache_bytes", "proxima_kv_cache_bytes")):
            out[key] = exporter.registry.get_sample_value(name, {"engine": "0"})
    return out


if __name__ == "__main__":
    model_dir, variant, kv_cache_dtype, block_size, out_path = sys.argv[1:6]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["PROXIMA_CHECK_INVARIANTS"] = "1"
    if variant == "token":
        os.environ["PROXIMA_ALLOCATOR"] = "token"
    result = run(model_dir, variant, kv_cache_dtype, int(block_size))
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
