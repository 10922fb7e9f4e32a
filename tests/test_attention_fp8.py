"""fp8 KV caches on token slots: quantisation against vLLM's own writer, both attention paths against
a float64 oracle computed from the dequantised cache, the backend's uint8 -> fp8 view, and the
start-up check.

Scales are never 1 here (K and V differ, and per-head cases differ per head), so a scale not
applied, applied twice or swapped between K and V moves results far outside the tolerances. On a
machine without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET is set by
attention_cases before Triton is imported); on a CUDA machine they run for real.
"""

from __future__ import annotations

from tests.attention_cases import (  # first: sets TRITON_INTERPRET on CPU-only machines
    BACKEND_LAYOUT,
    DEVICE,
    INTERPRETER_WARNINGS,
    Batch,
    make_batch,
    triton_attention_or_skip,
    triton_write_kv_or_skip,
)

# isort: split

import dataclasses  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from proxima.engine.attention import planning  # noqa: E402
from proxima.engine.attention.planning import TileConfig  # noqa: E402
from proxima.engine.attention.quant import KVScales, dequantize, quantize_fp8  # noqa: E402
from proxima.engine.attention.reference import slot_attention_torch  # noqa: E402
from proxima.engine.attention.slot_rows import write_kv  # noqa: E402
from proxima.engine.compat import unsupported_options  # noqa: E402
from tests.test_attention_kernels import assert_rows, naive_attention  # noqa: E402

pytestmark = INTERPRETER_WARNINGS
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# (q_len, seq_len): decodes, a full prefill, chunked prefills over cached context, a request with
# no queries mid-batch and a padding request at the end.
MIXED = [(1, 21), (7, 7), (5, 19), (1, 1), (0, 6), (12, 30), (1, 9), (3, 3), (0, 0)]
DECODES = [(1, 13), (1, 1), (1, 40), (1, 7), (1, 26)]
CHUNKED = [(9, 25), (20, 41), (4, 4)]
HEADS = {"gqa4:2": (4, 2), "gqa8:1": (8, 1), "mha": (4, 4)}
# The data is N(0, 1); these put it around +-20-60 in K codes and +-50 in V codes: e4m3's
# range, far from scale 1 (a dropped scale changes scores 20-fold).
PER_TENSOR = (0.05, 0.02)


def make_scales(num_kv_heads: int, per_head: bool) -> KVScales:
    if not per_head:
        k_scale, v_scale = PER_TENSOR
        return KVScales(torch.tensor(k_scale, device=DEVICE), torch.tensor(v_scale, device=DEVICE))
    heads = torch.arange(num_kv_heads, dtype=torch.float32, device=DEVICE)
    return KVScales(0.04 + 0.01 * heads, 0.03 - 0.005 * heads)


def fp8_batch(requests, heads, head_size, *, seed, dtype=E4M3, per_head=False, layout=BACKEND_LAYOUT,
              query_dtype=torch.float32) -> tuple[Batch, KVScales, Batch]:
    """A batch whose caches are fp8 views of one buffer (same layout as ``layout``), its scales,
    and the same batch over the dequantised float64 cache (the oracle's input)."""
    b = make_batch(requests, *heads, head_size, fragmented=True, seed=seed, dtype=query_dtype, layout=layout)
    scales = make_scales(heads[1], per_head)
    num_slots = b.k_cache.shape[0]
    if layout == "split":
        buf = torch.empty(2, num_slots, heads[1], head_size, dtype=dtype, device=DEVICE)
        k8, v8 = buf[0], buf[1]
    else:
        buf = torch.empty(num_slots, heads[1], 2 * head_size, dtype=dtype, device=DEVICE)
        k8, v8 = buf[..., :head_size], buf[..., head_size:]
    k8.copy_(quantize_fp8(b.k_cache, scales.k, dtype))
    v8.copy_(quantize_fp8(b.v_cache, scales.v, dtype))
    oracle = dataclasses.replace(b, k_cache=dequantize(k8, scales.k).double(),
                                 v_cache=dequantize(v8, scales.v).double(), query=b.query.double())
    return dataclasses.replace(b, k_cache=k8, v_cache=v8), scales, oracle


# ---------------------------------------------------------------------------------------------
# quantisation: vLLM's CPU writer byte for byte, saturation, rounding


def _vllm_cpu_writer():
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        pytest.skip("vLLM's custom ops are not importable here")
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache") or not torch.cpu._is_avx512_supported():
        pytest.skip("vLLM's CPU fp8 writer needs its CPU build on AVX-512")
    return ops


@pytest.mark.parametrize("name,dtype", [("fp8", E4M3), ("fp8_e5m2", E5M2)])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_toward_zero_rounding_is_vllm_cpu_writer_byte_for_byte(name, dtype, model_dtype) -> None:
    ops = _vllm_cpu_writer()
    num_blocks, heads, block, head_size = 4, 2, 32, 64
    gen = torch.Generator().manual_seed(5)
    tokens = num_blocks * block
    # Magnitudes from 1e-6 (fp8 subnormals and zero) to 1e4 (saturated), both signs.
    x = torch.randn(tokens, heads, head_size, generator=gen) * torch.logspace(-6, 4, tokens)[:, None, None]
    x = x.to(model_dtype)
    slots = torch.randperm(tokens, generator=gen)
    k_scale, v_scale = 0.0371, 2.5
    stock = torch.zeros(num_blocks, heads, block, 2 * head_size, dtype=torch.uint8)
    stock_k, stock_v = stock.view(num_blocks, heads, 2 * block, head_size).chunk(2, dim=2)
    # The "vec" ISA keeps V blocks as [block, D] and K blocks as [D, block]: readable back here.
    ops.cpu_attn_reshape_and_cache(x, x.flip(0), stock_k, stock_v, slots, "vec", k_scale=k_scale,
                                   v_scale=v_scale, kv_cache_dtype=name)
    blocks, offsets = slots // block, slots % block
    stock_keys = stock_k.reshape(num_blocks, heads, head_size, block)[blocks, :, :, offsets]
    stock_values = stock_v[blocks, :, offsets]
    ours = torch.zeros(tokens, heads, 2 * head_size, dtype=dtype)
    write_kv(x, x.flip(0), ours[..., :head_size], ours[..., head_size:], torch.arange(tokens),
             KVScales(torch.tensor(k_scale), torch.tensor(v_scale)), rounding="toward_zero")
    codes = ours.view(torch.uint8)
    assert torch.equal(codes[..., :head_size], stock_keys)
    assert torch.equal(codes[..., head_size:], stock_values)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_saturates_and_rounds(dtype) -> None:
    finite = torch.finfo(dtype).max
    x = torch.tensor([[[1e9, -1e9, finite * 1.01, 7.9, -7.9, 0.0, 3e-3]]])
    one = torch.tensor(1.0)
    nearest = quantize_fp8(x, one, dtype).float()
    toward_zero = quantize_fp8(x, one, dtype, "toward_zero").float()
    assert torch.isfinite(nearest).all() and torch.isfinite(toward_zero).all()
    assert nearest[0, 0, :3].tolist() == [finite, -finite, finite]  # saturated, not NaN / inf
    assert nearest[0, 0, 3:5].tolist() == [8.0, -8.0]  # rounding carries into the exponent
    assert toward_zero[0, 0, 3:5].tolist() == [7.5, -7.5] if dtype == E4M3 else [7.0, -7.0]
    assert (toward_zero.abs() <= x.abs().clamp(max=finite)).all()
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(1, 4, 256, generator=gen) * 30
    # Nearest is never further than the other rounding, and both within one code of y.
    assert ((quantize_fp8(y, one, dtype).float() - y).abs()
            <= (quantize_fp8(y, one, dtype, "toward_zero").float() - y).abs()).all()
    # Scale divides once: dequantising gives back x within e4m3/e5m2's relative half-step.
    scale = torch.tensor(0.5)  # y / scale stays inside e4m3 range: no saturation here
    back = dequantize(quantize_fp8(y, scale, dtype), scale)
    step = 2.0 ** -4 if dtype == E4M3 else 2.0 ** -3
    subnormal_step = 0.5 * torch.finfo(dtype).smallest_normal  # absolute bound below the normals
    assert ((back - y).abs() <= y.abs() * step + subnormal_step).all()


# ---------------------------------------------------------------------------------------------
# write_kv into fp8 slots: torch and Triton


def _write_case(dtype, per_head: bool, layout: str, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    num_slots, heads, head_size = 40, 2, 32
    key = torch.randn(9, heads, head_size, generator=gen).to(DEVICE) * 3
    value = torch.randn(9, heads, head_size, generator=gen).to(DEVICE)
    key[0, 0, 0] = 1e5  # saturates
    slots = torch.randperm(num_slots, generator=gen)[:7]
    slots[[1, 4]] = -1
    if layout == "split":
        buf = torch.zeros(2, num_slots, heads, head_size, dtype=dtype, device=DEVICE)
        k_cache, v_cache = buf[0], buf[1]
    else:
        buf = torch.zeros(num_slots, heads, 2 * head_size, dtype=dtype, device=DEVICE)
        k_cache, v_cache = buf[..., :head_size], buf[..., head_size:]
    return key, value, k_cache, v_cache, slots.to(DEVICE), make_scales(heads, per_head)


def _expected_write(key, value, k_cache, v_cache, slots, scales, rounding):
    k_expect, v_expect = k_cache.float().clone(), v_cache.float().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expect[slot] = quantize_fp8(key[row:row + 1], scales.k, k_cache.dtype, rounding)[0].float()
            v_expect[slot] = quantize_fp8(value[row:row + 1], scales.v, v_cache.dtype, rounding)[0].float()
    return k_expect, v_expect


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("layout", [BACKEND_LAYOUT, "split"])
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
def test_write_kv_quantises_rows_once_into_slots(dtype, per_head, layout, rounding) -> None:
    key, value, k_cache, v_cache, slots, scales = _write_case(dtype, per_head, layout)
    expected = _expected_write(key, value, k_cache, v_cache, slots, scales, rounding)
    write_kv(key, value, k_cache, v_cache, slots, scales, rounding=rounding)
    assert torch.equal(k_cache.float(), expected[0]) and torch.equal(v_cache.float(), expected[1])
    assert k_cache.float().abs().max() == torch.finfo(dtype).max  # the 1e5 saturated


@pytest.fixture(scope="module")
def kernels():
    return triton_attention_or_skip()


@pytest.fixture(scope="module")
def write_kernels():
    return triton_write_kv_or_skip()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_write_kv_triton_rounds_to_nearest_as_vllm_cuda(write_kernels, dtype, per_head) -> None:
    key, value, k_cache, v_cache, slots, scales = _write_case(dtype, per_head, BACKEND_LAYOUT, seed=4)
    expected = _expected_write(key, value, k_cache, v_cache, slots, scales, "nearest")
    write_kernels.write_kv_triton(key, value, k_cache, v_cache, slots, scales)
    assert torch.equal(k_cache.float().cpu(), expected[0].cpu())
    assert torch.equal(v_cache.float().cpu(), expected[1].cpu())


# ---------------------------------------------------------------------------------------------
# attention over fp8 slots vs float64 over the dequantised cache


TORCH_TOL = 1e-4  # float32 math over exactly dequantised values
TRITON_TOL = 1e-3


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("requests", [MIXED, DECODES, CHUNKED], ids=["mixed", "decodes", "chunked"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_torch_fp8_matches_float64_of_dequantised_cache(head_size, heads, requests, per_head) -> None:
    b, scales, oracle = fp8_batch(requests, heads, head_size, seed=head_size + heads[0], per_head=per_head)
    slot_attention_torch(*b.args(), kv_scales=scales)
    assert_rows(b.output, naive_attention(oracle), b.num_queries, atol=TORCH_TOL, rtol=TORCH_TOL)


def test_torch_fp8_e5m2_split_layout_bf16_queries() -> None:
    b, scales, oracle = fp8_batch(MIXED, (4, 2), 64, seed=8, dtype=E5M2, layout="split",
                                  query_dtype=torch.bfloat16)
    slot_attention_torch(*b.args(), kv_scales=scales)
    assert b.output.dtype == torch.bfloat16
    assert_rows(b.output.float(), naive_attention(oracle), b.num_queries, atol=2e-2, rtol=2e-2)


def test_a_dropped_or_swapped_scale_is_caught() -> None:
    """The tolerances above are tight enough to see each mistake the fp8 path could make."""
    b, scales, oracle = fp8_batch(MIXED, (4, 2), 64, seed=2)
    expected = naive_attention(oracle)
    num = b.num_queries
    one = torch.tensor(1.0, device=DEVICE)
    for wrong in (KVScales(one, one), KVScales(scales.v, scales.k), KVScales(scales.k, one)):
        out = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))), kv_scales=wrong)
        assert (out[:num].cpu().double() - expected[:num]).abs().max() > 100 * TORCH_TOL


@pytest.fixture(params=["default-tiles", "small-tiles"])
def tiles(request, kernels, monkeypatch: pytest.MonkeyPatch) -> str:
    """Small tiles: several query tiles per request and several KV tiles per context."""
    if request.param == "small-tiles":
        small = TileConfig(block_m=16, block_n=16)
        monkeypatch.setattr(planning, "choose_tiles", lambda *args: small)
    return request.param


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_triton_fp8_mixed_batch_matches_float64(kernels, tiles, head_size, heads) -> None:
    # MIXED holds decodes, a full prefill and chunked prefills over cached context, fragmented.
    b, scales, oracle = fp8_batch(MIXED, heads, head_size, seed=head_size + heads[1])
    out = kernels.slot_attention_triton(*b.args(), kv_scales=scales)
    assert out is b.output
    assert_rows(out, naive_attention(oracle), b.num_queries, atol=TRITON_TOL, rtol=TRITON_TOL)


@pytest.mark.parametrize("case", ["decodes", "chunked", "per-head", "e5m2", "bf16", "num-actual-tokens"])
def test_triton_fp8_cases_match_float64(kernels, case) -> None:
    requests = {"decodes": DECODES, "chunked": CHUNKED}.get(case, MIXED)
    b, scales, oracle = fp8_batch(requests, (4, 2), 64, seed=len(case), per_head=case == "per-head",
                                  dtype=E5M2 if case == "e5m2" else E4M3,
                                  query_dtype=torch.bfloat16 if case == "bf16" else torch.float32)
    limit = b.num_queries - 3 if case == "num-actual-tokens" else None
    kernels.slot_attention_triton(*b.args(), num_actual_tokens=limit, kv_scales=scales)
    tol = 2e-2 if case == "bf16" else TRITON_TOL
    assert_rows(b.output.float(), naive_attention(oracle), limit or b.num_queries, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_triton_fp8_split_kv_matches_float64(kernels, monkeypatch, num_splits, per_head) -> None:
    # The interpreter never splits on its own (no SM count): force S splits over 16-token tiles,
    # so v_scale must reach every split partial (the merge itself knows no scales).
    monkeypatch.setattr(planning, "choose_tiles", lambda *args: TileConfig(block_m=16, block_n=16))
    monkeypatch.setattr(planning, "choose_num_splits", lambda *args: num_splits)
    requests = [(1, 96), (1, 40), (1, 9), (1, 1), (5, 21), (12, 70)]
    b, scales, oracle = fp8_batch(requests, (8, 2), 64, seed=num_splits, per_head=per_head)
    kernels.slot_attention_triton(*b.args(), kv_scales=scales, max_query_len=12, max_seq_len=96)
    assert_rows(b.output, naive_attention(oracle), b.num_queries, atol=TRITON_TOL, rtol=TRITON_TOL)


# ---------------------------------------------------------------------------------------------
# the contract: fp8 caches come with scales, others without


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fp8_cache_and_scales_go_together(kernels, write_kernels, impl) -> None:
    attend = slot_attention_torch if impl == "torch" else kernels.slot_attention_triton
    writer = write_kv if impl == "torch" else write_kernels.write_kv_triton
    b, scales, _ = fp8_batch(MIXED, (4, 2), 64, seed=1)
    with pytest.raises(ValueError, match="needs the layer's k/v scales"):
        attend(*b.args())
    codes = dataclasses.replace(b, k_cache=b.k_cache.view(torch.uint8), v_cache=b.v_cache.view(torch.uint8))
    with pytest.raises(ValueError, match="uint8 is not fp8"):  # raw codes would be read as values
        attend(*codes.args(), kv_scales=scales)
    plain = make_batch(MIXED, 4, 2, 64, seed=1, layout=BACKEND_LAYOUT)
    with pytest.raises(ValueError, match="not fp8 but scales were given"):
        attend(*plain.args(), kv_scales=scales)
    three = KVScales(torch.ones(3, device=DEVICE), torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="1 or Hkv=2"):
        attend(*b.args(), kv_scales=three)
    key = torch.randn(4, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="needs the layer's k/v scales"):
        writer(key, key, b.k_cache, b.v_cache, torch.arange(4, device=DEVICE))
    assert torch.isnan(b.output).all()


# ---------------------------------------------------------------------------------------------
# the vLLM backend: uint8 cache from vLLM, viewed as fp8, scales from the layer


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_backend_writes_and_reads_vllm_uint8_cache_as_fp8(name) -> None:
    from proxima.engine.attention.backend import ProximaSlotAttentionImpl, ProximaSlotMetadata

    num_heads, num_kv_heads, head_size, num_slots = 4, 2, 64, 64
    impl = ProximaSlotAttentionImpl(num_heads, head_size, head_size ** -0.5, num_kv_heads, None, None, name)
    layer = SimpleNamespace(_k_scale=torch.tensor(0.05), _v_scale=torch.tensor(0.02))
    kv_cache = torch.zeros(num_slots, 1, num_kv_heads, 2 * head_size, dtype=torch.uint8)  # as vLLM allocates
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_slots, generator=gen)[:15]
    slot_table = torch.stack([slots[:9], torch.cat([slots[9:], slots[:3]])]).to(torch.int32)
    key = torch.randn(15, num_kv_heads, head_size, generator=gen)
    value = torch.randn(15, num_kv_heads, head_size, generator=gen)
    # Step 1 writes the decode's context and the prefill; only the new tokens' rows at step 2.
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    query = torch.randn(7, num_heads * head_size, generator=gen)
    output = torch.full_like(query, float("nan"))
    metadata = ProximaSlotMetadata(
        num_actual_tokens=7, max_query_len=6, max_seq_len=9,
        query_start_loc=torch.tensor([0, 1, 7], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 1, 7], dtype=torch.int32),
        seq_lens=torch.tensor([9, 6], dtype=torch.int32), slot_table=slot_table,
        slot_mapping=slots[8:15])
    impl.forward(layer, query, None, None, kv_cache, metadata, output=output)
    # Oracle: the cache as vLLM's CPU writer would hold it, dequantised, in float64.
    dtype = torch.float8_e5m2 if name == "fp8_e5m2" else E4M3
    k_deq = dequantize(quantize_fp8(key, layer._k_scale, dtype, "toward_zero"), layer._k_scale)
    v_deq = dequantize(quantize_fp8(value, layer._v_scale, dtype, "toward_zero"), layer._v_scale)
    deq = torch.zeros(num_slots, num_kv_heads, head_size, dtype=torch.float64)
    k_cache_deq, v_cache_deq = deq.clone(), deq.clone()
    k_cache_deq[slots], v_cache_deq[slots] = k_deq.double(), v_deq.double()
    oracle = Batch(query=query.view(7, num_heads, head_size).double(), k_cache=k_cache_deq,
                   v_cache=v_cache_deq, slot_table=slot_table[:, :9],
                   query_start_loc=metadata.query_start_loc, seq_lens=metadata.seq_lens,
                   scale=head_size ** -0.5, output=output)
    assert_rows(output.view(7, num_heads, head_size), naive_attention(oracle), 7,
                atol=TORCH_TOL, rtol=TORCH_TOL)
    assert kv_cache.dtype == torch.uint8 and kv_cache.any()  # written through the fp8 view


# ---------------------------------------------------------------------------------------------
# start-up check


def _config(cache_dtype: str, skip_layers: list[str] | None = None):
    return SimpleNamespace(
        model_config=None,
        cache_config=SimpleNamespace(block_size=1, cache_dtype=cache_dtype,
                                     kv_cache_dtype_skip_layers=skip_layers or []),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1),
        kv_transfer_config=None, speculative_config=None,
    )


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head",
                                  "fp8_per_token_head", "int4_per_token_head"])
def test_compat_accepts_fp8_and_per_token_head_kv_caches(name) -> None:
    assert unsupported_options(_config(name)) == []


@pytest.mark.parametrize("name", ["turboquant_4bit_nc", "turboquant_k8v4", "nvfp4", "fp8_inc", "bfloat16"])
def test_compat_refuses_other_kv_cache_dtypes_in_one_line(name) -> None:
    (problem,) = unsupported_options(_config(name))
    assert problem.startswith(f"--kv-cache-dtype {name}:") and "\n" not in problem


def test_compat_refuses_skipped_layers() -> None:
    (problem,) = unsupported_options(_config("fp8", ["0"]))
    assert problem.startswith("--kv-cache-dtype-skip-layers:")
