"""Per-token-head KV caches (int8, fp8, int4) on token slots: both attention paths against a
float64 oracle computed from the dequantised cache, and the int4 codes' unpacking in registers.

The oracle reads the cache through `per_token_head.gather` and follows vLLM's int4 recipe (queries
rotated and rounded to the model dtype, scale / D, output rotated back), in float64. The bytes the
write leaves, against vLLM's own writer: tests/test_per_token_head_writer.py.
"""

from __future__ import annotations

from tests.attention_cases import (  # first: sets TRITON_INTERPRET on CPU-only machines
    DEVICE,
    INTERPRETER_WARNINGS,
    Batch,
    make_batch,
    triton_attention_or_skip,
)

# isort: split

import re  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from proxima.engine.attention import per_token_head as pth  # noqa: E402
from proxima.engine.attention.reference import slot_attention_torch  # noqa: E402
from tests.test_attention_kernels import assert_rows, naive_attention  # noqa: E402

pytestmark = INTERPRETER_WARNINGS
FORMATS = tuple(pth.PTH_FORMATS)
MIXED = [(1, 21), (7, 7), (5, 19), (1, 1), (0, 6), (12, 30), (1, 9), (3, 3), (0, 0)]
DECODES = [(1, 13), (1, 1), (1, 40), (1, 7), (1, 26)]
CHUNKED = [(9, 25), (20, 41), (4, 4)]
# Contexts over several of the int4 plan's 128-token KV tiles: the online softmax across tiles.
LONG_DECODES = [(1, 300), (1, 129), (2, 260), (1, 5)]


# -- attention: both paths against float64 -------------------------------------------------------

@dataclass
class PTHBatch:
    batch: Batch
    cache: pth.PTHCache

    def args(self, output: torch.Tensor | None = None) -> tuple:
        b = self.batch
        return (b.query, self.cache.k_codes, self.cache.v_codes, b.slot_table, b.query_start_loc, b.seq_lens,
                b.scale, b.output if output is None else output)


def pth_batch(requests, heads, head_size, name, *, seed, dtype=torch.float32, fragmented=True) -> PTHBatch:
    b = make_batch(requests, *heads, head_size, seed=seed, dtype=dtype, fragmented=fragmented)
    fmt = pth.PTH_FORMATS[name]
    num_slots = b.k_cache.shape[0]
    raw = torch.zeros(num_slots, 1, heads[1], fmt.record_bytes(head_size), dtype=torch.uint8, device=DEVICE)
    cache = pth.cache_views(raw, fmt, heads[1], head_size)
    pth.write(b.k_cache.contiguous(), b.v_cache.contiguous(), cache,
              torch.arange(num_slots, dtype=torch.int64, device=DEVICE))
    return PTHBatch(b, cache)


def oracle(pb: PTHBatch) -> torch.Tensor:
    """Float64 attention over the dequantised cache, vLLM's int4 recipe included."""
    b, cache = pb.batch, pb.cache
    head_size = b.query.shape[2]

    def gather(slots):
        return pth.gather(cache, slots)

    if not cache.fmt.packed:
        return naive_attention(b, gather)
    rotated = naive_attention(b, gather, pth.rotate(b.query.cpu()), b.scale / head_size)
    return pth._single_rht(rotated, inverse=True) / head_size  # float64, on the CPU


HEADS = {"gqa4:2": (4, 2), "mha": (2, 2)}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("fragmented", [True, False], ids=["fragmented", "contiguous"])
def test_torch_path_matches_float64(name, heads, head_size, fragmented):
    pb = pth_batch(MIXED, heads, head_size, name, seed=head_size + heads[0], fragmented=fragmented)
    out = slot_attention_torch(*pb.args(), kv_scales=pb.cache)
    assert_rows(out, oracle(pb), pb.batch.num_queries, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("requests", [MIXED, DECODES, CHUNKED], ids=["mixed", "decodes", "chunked"])
@pytest.mark.parametrize("heads, head_size", [((4, 2), 64), ((2, 2), 128), ((2, 1), 256)],
                         ids=["gqa-d64", "mha-d128", "gqa-d256"])
def test_triton_path_matches_float64(name, requests, heads, head_size):
    ta = triton_attention_or_skip()
    pb = pth_batch(requests, heads, head_size, name, seed=len(requests) + head_size)
    out = ta.slot_attention_triton(*pb.args(), kv_scales=pb.cache)
    assert_rows(out, oracle(pb), pb.batch.num_queries, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FORMATS)
def test_triton_decodes_over_several_kv_tiles_match_float64(name):
    ta = triton_attention_or_skip()
    pb = pth_batch(LONG_DECODES, (4, 2), 64, name, seed=21)
    out = ta.slot_attention_triton(*pb.args(), kv_scales=pb.cache)
    assert_rows(out, oracle(pb), pb.batch.num_queries, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("num_splits", [2, 5])
def test_triton_split_kv_matches_float64(name, num_splits, monkeypatch):
    ta = triton_attention_or_skip()
    from proxima.engine.attention import planning

    choose = planning.choose_launch_shape

    def forced(*args, **kwargs):
        tiles, _ = choose(*args, **kwargs)
        return tiles, num_splits

    monkeypatch.setattr(ta, "choose_launch_shape", forced)
    pb = pth_batch(DECODES + [(4, 40)], (4, 2), 64, name, seed=num_splits)
    out = ta.slot_attention_triton(*pb.args(), kv_scales=pb.cache)
    assert_rows(out, oracle(pb), pb.batch.num_queries, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_model_dtype_queries_follow_vllms_rounding(name, dtype):
    """Model-dtype queries: both paths within bf16's precision of the oracle, which rounds the
    rotated queries to the model dtype as vLLM does. fp16 dots take int4 codes as 1024 + code
    (bf16 ones, 128 + code: the GPU's dtype; the interpreter widens bf16 to float32)."""
    ta = triton_attention_or_skip()
    pb = pth_batch(MIXED, (4, 2), 64, name, seed=11, dtype=dtype)
    expected = oracle(pb)
    for run in (slot_attention_torch, ta.slot_attention_triton):
        out = run(*pb.args(torch.full_like(pb.batch.output, float("nan"))), kv_scales=pb.cache)
        assert_rows(out, expected, pb.batch.num_queries, atol=2e-2, rtol=2e-2)



def _unpack_kernel():
    """A kernel storing ``_nibbles`` (``PAIRED``: ``_nibble_pairs``, with inline PTX if ``PTX``) of a
    [16, 8] word tile, and one moving [N, D] rows into and out of the paired order (built on first
    use: Triton may be absent, and must be imported after TRITON_INTERPRET is set)."""
    import triton
    import triton.language as tl

    from proxima.engine.attention import triton_int4

    @triton.jit
    def unpack(words_ptr, out_ptr, N: tl.constexpr, W: tl.constexpr, DTYPE: tl.constexpr,
               PAIRED: tl.constexpr, PTX: tl.constexpr):
        rows, cols = tl.arange(0, N), tl.arange(0, W * 8)
        words = tl.load(words_ptr + rows[:, None] * W + tl.arange(0, W)[None, :])
        if PAIRED:
            codes = int4._nibble_pairs(words, DTYPE, PTX)  # noqa: F821 (a global of the kernel, below)
        else:
            codes = int4._nibbles(words, (cols % 8) * 4, DTYPE)  # noqa: F821
        tl.store(out_ptr + rows[:, None] * W * 8 + cols[None, :], codes)

    @triton.jit
    def reorder(x_ptr, out_ptr, N: tl.constexpr, D: tl.constexpr, TO_PAIRED: tl.constexpr):
        offs = tl.arange(0, N)[:, None] * D + tl.arange(0, D)[None, :]
        x = tl.load(x_ptr + offs)
        if TO_PAIRED:
            x = int4._to_paired_order(x)  # noqa: F821
        else:
            x = int4._from_paired_order(x)  # noqa: F821
        tl.store(out_ptr + offs, x)

    # Triton resolves a kernel's callees among its globals
    unpack.fn.__globals__["int4"] = reorder.fn.__globals__["int4"] = triton_int4
    return unpack, reorder, tl


def paired_order(head_size: int) -> list[int]:
    """The head-dimension position that each column of ``_nibble_pairs`` holds: column 8w + 2k + e
    is word w's nibble k + 4e (k < 4, e < 2), the pair that one 32-bit mask takes 16 bits apart."""
    return [c - c % 8 + (c % 8) // 2 + 4 * (c % 2) for c in range(head_size)]


def _random_words(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[16, 64] random codes (row 0 all 15: the words' sign bit set) and their [16, 8] int32 words."""
    codes = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.int64)
    codes[0] = 15
    words = (codes << (torch.arange(8).repeat(8) * 4)).view(16, 8, 8).sum(-1)
    return codes, torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


UNPACKINGS = {"natural": (False, False), "paired": (True, False),
              "paired-ptx": pytest.param(True, True, marks=pytest.mark.skipif(
                  DEVICE != "cuda", reason="inline PTX runs on the GPU only"))}


@pytest.mark.parametrize("paired, ptx", UNPACKINGS.values(), ids=UNPACKINGS.keys())
@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, 128), (torch.float16, 1024), (torch.float32, 0)])
def test_nibbles_become_bias_plus_code_exactly(dtype, bias, paired, ptx):
    """Every word's 8 nibbles, in order (the natural one, or the paired one of decode-shaped
    tiles), as the dot dtype's bias + code (the GPU's bf16 path and its inline PTX included, which
    the attention tests above cannot reach under the interpreter)."""
    triton_attention_or_skip()
    unpack, _, tl = _unpack_kernel()
    codes, words = _random_words(torch.Generator().manual_seed(5))
    out = torch.empty(16, 64, dtype=dtype, device=DEVICE)
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    unpack[(1,)](words.to(DEVICE), out, 16, 8, tl_dtype, paired, ptx)
    expected = codes[:, paired_order(64)] if paired else codes
    assert torch.equal(out.cpu().float(), (expected + bias).float())


def test_queries_and_accumulators_enter_and_leave_the_paired_order():
    triton_attention_or_skip()
    _, reorder, _ = _unpack_kernel()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    paired, back = torch.empty_like(x), torch.empty_like(x)
    reorder[(1,)](x, paired, 16, 64, True)
    reorder[(1,)](paired, back, 16, 64, False)
    assert torch.equal(paired.cpu(), x.cpu()[:, paired_order(64)])
    assert torch.equal(back, x)


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX's lop3.b32: each result bit is the truth table ``lut`` at index 4a + 2b + c of the
    operands' bits (so lut = f(0xF0, 0xCC, 0xAA) computes f)."""
    return sum(((lut >> (4 * (a >> i & 1) + 2 * (b >> i & 1) + (c >> i & 1))) & 1) << i for i in range(32))


@pytest.mark.parametrize("bias", [0x4300, 0x6400], ids=["bf16", "fp16"])
def test_the_ptx_unpacking_bit_model_gives_the_paired_order(bias):
    """The inline PTX that unpacks codes on the GPU (``triton_int4._MASK_OR_BIAS``, which no CPU test
    can run), modelled bit for bit: word w's pair k (the word shifted right by 4k, arithmetically as
    Triton's >> on int32) through the lop3 gives column 8w + 2k + e the 16-bit half e, which must be
    bias | the nibble at head-dimension position ``paired_order`` of that column."""
    from proxima.engine.attention import triton_int4

    asm = triton_int4._MASK_OR_BIAS.value
    found = re.fullmatch(r"lop3\.b32 \$0, \$1, (0x[0-9A-F]+), \$2, (0x[0-9A-F]+);", asm)
    assert found, asm
    mask, lut = int(found[1], 16), int(found[2], 16)
    codes, words = _random_words(torch.Generator().manual_seed(7))
    order = paired_order(64)
    for row in range(16):
        for col in range(64):
            w, k, e = col // 8, col % 8 // 2, col % 2
            word = int(words[row, w]) & 0xFFFFFFFF
            shifted = (word >> 4 * k) | (0xFFFFFFFF << (32 - 4 * k) & 0xFFFFFFFF if word >> 31 and k else 0)
            half = _lop3(shifted, mask, bias * 0x10001, lut) >> 16 * e & 0xFFFF
            assert half == bias | int(codes[row, order[col]]), (row, col)


@pytest.mark.skipif(DEVICE != "cuda", reason="inline PTX runs on the GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("requests, max_query_len", [(DECODES + [(1, 300), (1, 129)], 1),
                                                     (MIXED + LONG_DECODES, None)],
                         ids=["decode-plan", "mixed-plan"])
def test_triton_int4_ptx_unpacking_equals_tritons_own(dtype, requests, max_query_len, monkeypatch):
    """On the GPU, int4 attention whose codes inline PTX unpacks (``launch_args.int4_ptx``, what a
    CUDA launch runs) against the same launch with Triton's own mask and OR (what the interpreter
    runs): the same codes enter the same dots, so the outputs agree bit for bit, over serving-size
    heads (GQA 4, head 128: the decode-shaped tiles), several 128-token KV tiles and both plans."""
    ta = triton_attention_or_skip()
    pb = pth_batch(requests, (32, 8), 128, "int4_per_token_head", seed=len(requests), dtype=dtype)

    def attend() -> torch.Tensor:
        out = torch.full_like(pb.batch.output, float("nan"))
        return ta.slot_attention_triton(*pb.args(out), kv_scales=pb.cache, max_query_len=max_query_len)

    ptx = attend()
    monkeypatch.setattr(ta, "int4_ptx", lambda codes: False)
    torch.testing.assert_close(ptx, attend(), rtol=0, atol=0, equal_nan=True)  # NaN: rows no query writes
    assert_rows(ptx, oracle(pb), pb.batch.num_queries, atol=2e-2, rtol=2e-2)
