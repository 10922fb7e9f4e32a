"""Per-token-head KV (int4, int8) in a real vLLM engine on token slots: the prefix cache shares the
quantised slots exactly, and every slot comes back.

A slot holds its codes and scales together (per_token_head.py), so a request that reads another's
cached prefix reads exactly the bytes it would have written itself: with the prefix cache on and
off, greedy outputs must be the same token for token (float32 model; the K/V a token gets do not
depend on which batch computed them). Stock vLLM's CPU backend does not serve these dtypes, so
there is no stock engine to compare with here; the quantised bytes are compared with vLLM's own
writer in tests/test_per_token_head_writer.py, and on the H200 Proxima's kernel with stock's
(scripts/gpu/kit/pth.py).
"""

from __future__ import annotations

import random

import pytest

from proxima.harness import open_engine
from proxima.load import random_prompt
from tests.engine_scenarios import engine_spec, slot_state

pytestmark = pytest.mark.engine


def shared_prompt_run(model: str, variant: str, kv_cache_dtype: str) -> dict:
    """A burst of chats behind one system prompt, then some of them again: outputs, hits, slots."""
    from vllm import SamplingParams

    rng = random.Random(7)
    system = random_prompt(rng, 60, 60)
    prompts = [system + " " + random_prompt(rng, 5, 40) for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True) for _ in prompts]
    with open_engine(engine_spec(model, variant, "--kv-cache-dtype", kv_cache_dtype)) as engine:
        first = engine.llm.generate(prompts, params, use_tqdm=False)
        again = engine.llm.generate(prompts[::3], params[::3], use_tqdm=False)
        return {"outputs": [list(r.outputs[0].token_ids) for r in first + again],
                "after": slot_state(engine), "bytes_per_token": engine.recorder.static.bytes_per_token}


@pytest.fixture(scope="module")
def runs(tiny_model, engine_process) -> dict[str, dict]:
    return {(variant, dtype): engine_process("token").call(shared_prompt_run, tiny_model, variant, dtype,
                                                            timeout=900)
            for dtype in ("int4_per_token_head", "int8_per_token_head")
            for variant in ("token", "token-nocache")}


@pytest.mark.parametrize("dtype", ["int4_per_token_head", "int8_per_token_head"])
def test_shared_quantised_slots_give_the_outputs_recomputing_gives(runs, dtype):
    cached, recomputed = runs[("token", dtype)], runs[("token-nocache", dtype)]
    assert cached["after"]["hit_tokens"] > 24 * 50  # the system prompt was shared, token-exact
    assert recomputed["after"]["hit_tokens"] == 0
    assert cached["outputs"] == recomputed["outputs"]


@pytest.mark.parametrize("dtype, record", [("int4_per_token_head", 2 * (16 + 4)), ("int8_per_token_head",
                                                                                    2 * (32 + 4))])
def test_slots_come_back_and_bytes_per_token_count_the_scales(runs, dtype, record):
    for variant in ("token", "token-nocache"):
        after = runs[(variant, dtype)]["after"]
        assert after["slots_used"] == 0 and after["requests_holding_slots"] == 0
        # The tiny model: 2 layers x 2 KV heads x one record (codes and a float32 scale, K and V).
        assert runs[(variant, dtype)]["bytes_per_token"] == 2 * 2 * record
