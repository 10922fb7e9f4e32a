"""Serving-size shapes on a GPU: Proxima's Triton kernels against the torch reference.

The CPU suite checks the same contract on small shapes under Triton's interpreter; this module
needs CUDA (run by `scripts/gpu/run.sh kernels`) and covers what only a GPU can hold: head sizes
64/128/256, contexts to 32k, batches to 512, GQA and MHA, fragmented and contiguous slots
(the largest combinations are skipped: the batch is built in float32 on the host first).
"""

from __future__ import annotations

from tests.attention_cases import DEVICE, make_batch  # first: sets TRITON_INTERPRET on CPU-only machines

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402

from proxima.engine.attention.reference import slot_attention_torch  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="serving-size shapes need a GPU")

SHAPES = {
    "decode 512 x 512": [(1, 512)] * 512,
    "decode 4 x 32k": [(1, 32768)] * 4,
    "decode 1 x 32k": [(1, 32768)],
    "mixed: 64 decodes + prefill 2k": [(1, 700)] * 64 + [(2048, 2048)],
    "chunked prefill 1k over 31k": [(1024, 32768)],
}
MAX_KV_ELEMENTS = 6e8


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads", [(32, 8), (16, 16)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_triton_serving_shapes_match_torch(shape: str, heads: tuple[int, int], head_size: int) -> None:
    from proxima.engine.attention.triton_attention import slot_attention_triton

    requests = SHAPES[shape]
    kv_elements = sum(s for _, s in requests) * heads[1] * head_size * 2
    if kv_elements > MAX_KV_ELEMENTS:
        pytest.skip(f"{kv_elements:.2g} K/V values: the test batch is built in float32 on the host first")
    b = make_batch(requests, *heads, head_size, fragmented=list(SHAPES).index(shape) % 2 == 0,
                   seed=head_size, dtype=torch.bfloat16, layout="head-interleaved")
    expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))))
    q_lens = b.query_start_loc[1:] - b.query_start_loc[:-1]
    slot_attention_triton(*b.args(), max_query_len=int(q_lens.max()), max_seq_len=int(b.seq_lens.max()))
    rows = int(b.query_start_loc[-1])
    got, want = b.output[:rows].float(), expected[:rows].float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fragmented", [True, False], ids=["fragmented", "contiguous"])
def test_triton_fp16_long_context_matches_torch(fragmented: bool) -> None:
    from proxima.engine.attention.triton_attention import slot_attention_triton

    b = make_batch([(1, 16384)] * 8 + [(512, 4096)], 32, 8, 128, fragmented=fragmented, seed=3,
                   dtype=torch.float16, layout="head-interleaved")
    expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))))
    slot_attention_triton(*b.args())
    rows = int(b.query_start_loc[-1])
    torch.testing.assert_close(b.output[:rows].float(), expected[:rows].float(), atol=2e-2, rtol=2e-2)
