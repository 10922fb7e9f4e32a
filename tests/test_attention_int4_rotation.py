"""The int4 rotation inside the Triton kernels (``launch_args.INT4_ROTATION``): queries and
accumulators rotated by float32 butterflies (``triton_int4._fwht``, served) or by dots with vLLM's
Hadamard matrix (split in halves past 128 columns; kept for the GPU's A/B), against the float64
oracle of ``test_attention_per_token_head``, decode and prefill tiles alike."""

from __future__ import annotations

from tests.attention_cases import INTERPRETER_WARNINGS, triton_attention_or_skip  # first: TRITON_INTERPRET

# isort: split

import pytest  # noqa: E402

from tests.test_attention_kernels import assert_rows  # noqa: E402
from tests.test_attention_per_token_head import MIXED, oracle, pth_batch  # noqa: E402

pytestmark = INTERPRETER_WARNINGS


@pytest.mark.parametrize("rotation", ["butterfly", "matrix"])
@pytest.mark.parametrize("head_size", [64, 256])
def test_both_int4_rotations_match_float64(rotation, head_size, monkeypatch):
    ta = triton_attention_or_skip()
    from proxima.engine.attention import launch_args

    monkeypatch.setattr(launch_args, "INT4_ROTATION", rotation)
    pb = pth_batch(MIXED, (4, 2), head_size, "int4_per_token_head", seed=head_size)
    out = ta.slot_attention_triton(*pb.args(), kv_scales=pb.cache, max_query_len=12)
    assert_rows(out, oracle(pb), pb.batch.num_queries, atol=1e-4, rtol=1e-4)
