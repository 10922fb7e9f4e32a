"""The Gluon int4 decode kernel (proxima/engine/attention/gluon_int4_decode.py) against the
float64 oracle of tests/test_attention_per_token_head.py: compiled on the GPU, its own source run
in torch on the CPU (tests/gluon_emulator.py: Gluon has no interpreter)."""

from __future__ import annotations

from tests.attention_cases import (  # first: sets TRITON_INTERPRET on CPU-only machines
    DEVICE,
    INTERPRETER_WARNINGS,
    triton_attention_or_skip,
)

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.test_attention_kernels import assert_rows  # noqa: E402
from tests.test_attention_per_token_head import (  # noqa: E402
    DECODES,
    LONG_DECODES,
    MIXED,
    oracle,
    pth_batch,
)

pytestmark = INTERPRETER_WARNINGS

GLUON_HEADS = {"gqa4-d128": ((32, 8), 128), "mha-d128": ((8, 8), 128), "gqa3-d64": ((24, 8), 64),
               "gqa8-d64": ((16, 2), 64)}


def _gluon_serving(monkeypatch) -> list:
    """Route int4 decodes to the Gluon kernel and count the launches it builds; without a GPU the
    kernel's source runs in torch (tests/gluon_emulator.py: Gluon has no interpreter)."""
    from proxima.engine.attention import gluon_int4_decode, launch_args

    monkeypatch.setattr(launch_args, "INT4_DECODE", "gluon")
    if DEVICE != "cuda":
        from tests.gluon_emulator import EmulatedLaunch

        monkeypatch.setattr(gluon_int4_decode, "runs_on", lambda device: True)
        kernel = gluon_int4_decode._int4_decode_kernel
        monkeypatch.setattr(gluon_int4_decode, "_launch", EmulatedLaunch(kernel))
    calls = []
    build = gluon_int4_decode.decode_launch

    def counted(*args, **kwargs):
        calls.append(args[-2] is not None)
        return build(*args, **kwargs)

    monkeypatch.setattr(gluon_int4_decode, "decode_launch", counted)
    return calls


@pytest.mark.skipif(DEVICE != "cuda", reason="Gluon kernels run compiled, on the GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads, head_size", GLUON_HEADS.values(), ids=GLUON_HEADS.keys())
@pytest.mark.parametrize("requests", [DECODES + LONG_DECODES, MIXED + LONG_DECODES],
                         ids=["decodes", "mixed"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gluon_int4_decode_matches_float64(dtype, heads, head_size, requests, num_splits, monkeypatch):
    """The decode kernel (requests of at most 8 rows) beside the unified kernel's long launch (the
    rest: a mixed batch's prefills, and a 2-query request under GQA 8), unsplit and split, against
    the float64 oracle; and the kernel was the one that ran."""
    _check_gluon_decode(dtype, heads, head_size, requests, num_splits, monkeypatch)


def _check_gluon_decode(dtype, heads, head_size, requests, num_splits, monkeypatch) -> None:
    ta = triton_attention_or_skip()
    from proxima.engine.attention import planning

    calls = _gluon_serving(monkeypatch)
    choose = planning.choose_launch_shape
    monkeypatch.setattr(ta, "choose_launch_shape", lambda *a, **k: (choose(*a, **k)[0], num_splits))
    pb = pth_batch(requests, heads, head_size, "int4_per_token_head", seed=head_size + num_splits,
                   dtype=dtype)
    out = ta.slot_attention_triton(*pb.args(), kv_scales=pb.cache)
    assert calls, "the Gluon kernel was not launched"
    assert_rows(out, oracle(pb), pb.batch.num_queries, atol=2e-2, rtol=2e-2)


# On the CPU the emulation takes seconds a program: a few cases, 2 KV heads (fewer programs, the
# same groups), cover each head shape, both dtypes, both kinds of batch, split and not, each
# prefetch depth (0, 1, 2), both warp counts (4, 8) and two tiles a step: (warps, prefetch[, step]).
EMULATED_GLUON = [
    ("gqa4-d128", (8, 2), 128, torch.bfloat16, "decodes", 1, (4, 1)),
    ("gqa4-d128", (8, 2), 128, torch.float16, "mixed", 3, (4, 1)),
    ("mha-d128", (2, 2), 128, torch.bfloat16, "mixed", 1, (4, 2)),
    ("gqa3-d64", (6, 2), 64, torch.float16, "decodes", 3, (8, 1)),
    ("gqa8-d64", (16, 2), 64, torch.bfloat16, "mixed", 3, (4, 0)),
    ("gqa4-d128", (8, 2), 128, torch.bfloat16, "decodes", 3, (4, 0, 2)),  # odd tile counts a split
]
GLUON_BATCHES = {"decodes": DECODES + LONG_DECODES, "mixed": MIXED + LONG_DECODES}


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs the compiled kernel (the test above)")
@pytest.mark.parametrize("heads, head_size, dtype, batch, num_splits, variant",
                         [c[1:] for c in EMULATED_GLUON],
                         ids=["-".join(map(str, (c[0], str(c[3])[6:], *c[4:6], *c[6])))
                              for c in EMULATED_GLUON])
def test_gluon_int4_decode_source_matches_float64_on_cpu(heads, head_size, dtype, batch, num_splits, variant,
                                                          monkeypatch):
    """The kernel's own source run in torch (its values do not depend on its layouts): the index
    arithmetic, the nibble unpacking, the head dimension's orders and the online softmax against
    the float64 oracle, at each (warps, prefetch) the GPU benchmark times; every read and write in
    bounds."""
    from proxima.engine.attention import gluon_int4_decode

    monkeypatch.setattr(gluon_int4_decode, "NUM_WARPS", variant[0])
    monkeypatch.setattr(gluon_int4_decode, "PREFETCH", variant[1])
    monkeypatch.setattr(gluon_int4_decode, "TILES_A_STEP", variant[2] if len(variant) > 2 else 1)
    _check_gluon_decode(dtype, heads, head_size, GLUON_BATCHES[batch], num_splits, monkeypatch)


def test_gluon_int4_decode_prefetches_deeper_unless_more_programs_an_sm_take_fewer_waves(monkeypatch):
    """Two tiles in flight (two programs an SM) unless one tile (three an SM, each wave 1.1 times
    the cost) or none (four an SM unsplit, 1.85 times) runs the launch in less time; a forced depth wins,
    and two tiles a step take none; the warm-up compiles every depth a launch may take."""
    from proxima.engine.attention import gluon_int4_decode as gd

    monkeypatch.setattr(gd, "PREFETCH", None)
    # 132 multiprocessors stand in (an H100's, an H200's): waves of 264 / 396 / 528
    cpu = torch.device("cpu")
    programs = (8, 264, 265, 368, 396, 397, 512, 528, 529, 792, 793, 1024, 1056, 4096)
    assert [gd.prefetch_for(n, cpu) for n in programs] == [2, 2, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert gd.prefetch_choices() == (0, 1, 2)
    # Split, prefetch 0 takes 152 registers: three programs an SM, no wave saved.
    assert [gd.prefetch_for(n, cpu, split=True) for n in (396, 397, 512)] == [1, 2, 2]
    assert gd.prefetch_choices(split=True) == (1, 2)
    monkeypatch.setattr(gd, "PREFETCH", 2)
    assert gd.prefetch_for(1024, cpu) == 2 and gd.prefetch_choices() == (2,)
    monkeypatch.setattr(gd, "TILES_A_STEP", 2)  # two tiles a step load their own codes
    assert gd.prefetch_for(1024, cpu) == 0 and gd.prefetch_choices() == (0,)


@pytest.mark.skipif(DEVICE != "cuda", reason="Gluon kernels run compiled, on the GPU only")
def test_gluon_int4_decode_replays_alone_from_a_uniform_decode_graph(monkeypatch):
    """Captured as vLLM captures its uniform-decode graphs (``graph_max_query_len`` 1), the plan is
    the decode kernel alone (and the merge): replayed with new queries and other contexts, it
    matches the oracle."""
    ta = triton_attention_or_skip()
    from proxima.engine.attention import gluon_int4_decode

    _gluon_serving(monkeypatch)
    pb = pth_batch([(1, 700), (1, 1), (1, 129), (1, 64)], (32, 8), 128, "int4_per_token_head", seed=5,
                   dtype=torch.bfloat16)
    b, out = pb.batch, torch.full_like(pb.batch.output, float("nan"))
    plans = []
    plan = ta._launch_plan
    monkeypatch.setattr(ta, "_launch_plan", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])

    def call():
        ta.slot_attention_triton(*pb.args(out), kv_scales=pb.cache, graph_max_query_len=1)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    captured = [launch for launch, *_ in plans[-1]]
    assert captured[0] is gluon_int4_decode._launch
    assert ta._launch_attention not in captured, "a unified-kernel launch in a uniform-decode graph"
    b.query.copy_(torch.randn(b.query.shape, generator=torch.Generator().manual_seed(7)).to(b.query))
    b.seq_lens.copy_(torch.tensor([300, 1, 100, 33], dtype=torch.int32))  # within each table row
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_rows(out, oracle(pb), b.num_queries, atol=2e-2, rtol=2e-2)
