"""The int4 kernel's launch options (``launch_args``), each against the float64 oracle of
``test_attention_per_token_head``:

- ``INT4_ROTATION``: queries and accumulators rotated by float32 butterflies (``triton_int4._fwht``,
  served) or by dots with vLLM's Hadamard matrix (split in halves past 128 columns; kept for the
  GPU's A/B), decode and prefill tiles alike;
- ``INT4_PREFETCH``: decode tiles' loads pipelined in registers, which must change no bit;
- ``INT4_DECODE``: the kernel that attends decodes, set by PROXIMA_INT4_DECODE as an engine's int4
  layers are built (not only when ``launch_args`` is first imported)."""

from __future__ import annotations

from tests.attention_cases import INTERPRETER_WARNINGS, triton_attention_or_skip  # first: TRITON_INTERPRET

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402

from proxima.engine.attention.planning import TileConfig  # noqa: E402
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


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("plan", ["decode", "mixed"])
def test_prefetched_int4_tiles_equal_the_unpipelined_ones(plan, num_splits, monkeypatch):
    """16-token tiles, so a request spans up to 5 of them, and under 3 splits a range starts
    mid-sequence, holds one tile, or none (a request of one tile): the pipeline's first loads, its
    masked loads past the range's end, and its hand-over from one iteration to the next are all
    exercised. The mixed plan runs its short requests through the same decode tiles beside long
    ones."""
    ta = triton_attention_or_skip()
    from proxima.engine.attention import launch_args

    requests = [(1, 77), (1, 16), (1, 1), (1, 33), (0, 5), (1, 64)]
    if plan == "decode":
        tiles = TileConfig(16, 16, 8, 1)
    else:
        requests += [(9, 40)]
        tiles = TileConfig(32, 32, 4, 1, 16, 16)
    pb = pth_batch(requests, (8, 2), 64, "int4_per_token_head", seed=num_splits)
    b = pb.batch
    outputs = []
    for prefetch in (False, True):
        monkeypatch.setattr(launch_args, "INT4_PREFETCH", prefetch)
        out = torch.full_like(b.output, float("nan"))
        for launch, grid, args, key, options in ta._launch_plan(
            b.query, pb.cache.k_codes, pb.cache.v_codes, b.slot_table, b.query_start_loc, b.seq_lens,
            b.scale, out, b.query.shape[0], tiles, num_splits, pb.cache,
        ):
            launch(grid, args, key, **options)
        outputs.append(out[: b.num_queries].cpu())
    assert torch.equal(outputs[0], outputs[1])
    assert_rows(outputs[1], oracle(pb), b.num_queries, atol=1e-4, rtol=1e-4)


def test_int4_layers_read_the_decode_kernel_switch_as_the_engine_is_built(monkeypatch):
    """An in-process engine (proxima.harness) is built after ``launch_args`` was imported, with its
    spec's PROXIMA_* set only then: its int4 layers must take that value. A bad value is refused
    naming the variable and the choices; an fp8 layer leaves the switch alone."""
    from proxima.engine.attention import launch_args
    from proxima.engine.attention.backend import ProximaSlotAttentionImpl
    from proxima.engine.settings import DEFAULT_INT4_DECODE, ProximaConfigError

    def layer(kv_cache_dtype: str) -> ProximaSlotAttentionImpl:
        return ProximaSlotAttentionImpl(4, 64, 0.125, 2, None, None, kv_cache_dtype)

    for kernel in ("triton", "gluon"):
        monkeypatch.setattr(launch_args, "INT4_DECODE", "other")
        monkeypatch.setenv("PROXIMA_INT4_DECODE", kernel)
        layer("int4_per_token_head")
        assert launch_args.INT4_DECODE == kernel
    monkeypatch.delenv("PROXIMA_INT4_DECODE")
    layer("int4_per_token_head")
    assert launch_args.INT4_DECODE == DEFAULT_INT4_DECODE
    monkeypatch.setattr(launch_args, "INT4_DECODE", "triton")
    monkeypatch.setenv("PROXIMA_INT4_DECODE", "gluon")
    layer("fp8_e4m3")
    assert launch_args.INT4_DECODE == "triton"
    monkeypatch.setenv("PROXIMA_INT4_DECODE", "cutlass")
    with pytest.raises(ProximaConfigError, match="PROXIMA_INT4_DECODE='cutlass'.*gluon, triton"):
        layer("int4_per_token_head")
