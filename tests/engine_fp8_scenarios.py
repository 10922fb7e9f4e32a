"""The engine-equivalence prompts on one real vLLM engine with a chosen KV cache dtype, as data.

Run by tests/test_engine_fp8.py through the engine harness, in the session's engine processes,
once per (engine, KV dtype, block size). Same 120 varied prompts, step budget and KV budget in
bytes as tests/engine_scenarios.py, greedy, with the chosen token's logprob at every position,
and the KV geometry the engine ended up with (slots, and for Proxima the bytes per token its
scheduler published on /metrics).
"""

from __future__ import annotations

import random

from proxima.harness import open_engine
from tests.engine_scenarios import engine_spec, prompts, slot_state


def run(model: str, variant: str, kv_cache_dtype: str, block_size: int) -> dict:
    from vllm import SamplingParams

    blocks = ("--block-size", str(block_size)) if variant == "stock" else ()
    with open_engine(engine_spec(model, variant, "--kv-cache-dtype", kv_cache_dtype, *blocks)) as engine:
        ps = prompts(120, seed=1)
        rng = random.Random(2)
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 48), ignore_eos=True, logprobs=1)
                  for _ in ps]
        results = engine.llm.generate(ps, params, use_tqdm=False)
        outputs, logprobs = [], []
        for r in results:
            completion = r.outputs[0]
            outputs.append(list(completion.token_ids))
            chosen = zip(completion.token_ids, completion.logprobs)
            logprobs.append([step[token].logprob for token, step in chosen])
        out = {
            "variant": variant, "kv_cache_dtype": kv_cache_dtype, "block_size": block_size,
            "outputs": outputs, "logprobs": logprobs, "preemptions": engine.recorder.preemptions,
            "after": slot_state(engine),
        }
        exporter = getattr(engine.scheduler, "kv_exporter", None)
        if exporter is not None:  # Proxima's scheduler: what /metrics states
            for key, name in (("bytes_per_token", "proxima_kv_bytes_per_token"),
                              ("cache_bytes", "proxima_kv_cache_bytes")):
                out[key] = exporter.registry.get_sample_value(name, {"engine": "0"})
        return out
