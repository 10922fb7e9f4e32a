"""Triton launch plans against the torch path: the mixed plan at its short-tile boundary, and a
relaunch with new data through the kept compiled kernels (interpreter on CPU, real on CUDA)."""

from __future__ import annotations

from tests.attention_cases import (  # first: sets TRITON_INTERPRET on CPU-only machines
    DEVICE,
    INTERPRETER_WARNINGS,
    make_batch,
    triton_attention_or_skip,
    triton_write_kv_or_skip,
)

# isort: split

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from proxima.engine.attention import planning  # noqa: E402
from proxima.engine.attention.reference import slot_attention_torch  # noqa: E402
from proxima.engine.attention.slot_rows import write_kv  # noqa: E402
from tests.test_attention_kernels import MIXED, MIXED_TILES, assert_rows  # noqa: E402

pytestmark = INTERPRETER_WARNINGS


@pytest.fixture(scope="module")
def triton_attention():
    return triton_attention_or_skip()


@pytest.fixture(scope="module")
def triton_write_kv():
    return triton_write_kv_or_skip()


@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (2, 2)], ids=["gqa2", "gqa4", "mha"])
def test_mixed_plan_at_the_short_tile_boundary(triton_attention, monkeypatch: pytest.MonkeyPatch,
                                               heads: tuple[int, int]) -> None:
    # Queries of exactly the short tile's tokens (16 // group) take it; one more token takes the
    # long tiles; decodes, a long prefill over context and a request with no queries between.
    monkeypatch.setattr(planning, "choose_tiles", lambda *args: MIXED_TILES)
    short_q = MIXED_TILES.short_block_m // (heads[0] // heads[1])
    requests = [(short_q, short_q + 9), (1, 30), (short_q + 1, short_q + 1), (0, 4), (1, 1),
                (40, 70), (short_q, short_q), (1, 17)]
    b = make_batch(requests, *heads, 32, fragmented=True, seed=sum(heads) + short_q)
    expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))))
    triton_attention.slot_attention_triton(*b.args(), max_query_len=40, max_seq_len=70)
    assert_rows(b.output, expected.cpu(), b.num_queries, atol=1e-3, rtol=1e-3)


def test_triton_relaunch_with_new_data_matches_torch(triton_attention, triton_write_kv) -> None:
    """The second launch of a shape goes through the kept compiled kernel (kernel_launch.py) on a GPU:
    it must read the new call's tensors, not the first call's."""
    for seed in (21, 22):  # same shapes and dtypes, different data and allocations
        b = make_batch(MIXED, 4, 2, 32, fragmented=True, seed=seed)
        key, value = b.query[:, :2].clone(), b.query[:, 2:].clone()
        gen = torch.Generator().manual_seed(seed)
        slots = torch.randperm(b.k_cache.shape[0], generator=gen)[: key.shape[0]].to(DEVICE)
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        triton_write_kv.write_kv_triton(key, value, k_cache, v_cache, slots)
        expected_k, expected_v = b.k_cache.clone(), b.v_cache.clone()
        write_kv(key, value, expected_k, expected_v, slots)
        assert torch.equal(k_cache.cpu(), expected_k.cpu()) and torch.equal(v_cache.cpu(), expected_v.cpu())
        expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))))
        triton_attention.slot_attention_triton(*b.args(), max_query_len=7, max_seq_len=40)
        assert_rows(b.output, expected.cpu(), int(b.query_start_loc[-1]), atol=1e-3, rtol=1e-3)
    if DEVICE == "cuda":
        assert triton_attention._launch_attention._compiled and triton_write_kv._launch_write_kv._compiled


@pytest.mark.parametrize("cache, int4_decode", [("float32", "triton"), ("int4_per_token_head", "triton"),
                                                ("int4_per_token_head", "gluon")],
                         ids=["float32", "int4-triton", "int4-gluon"])
def test_warm_up_compiles_every_variant_the_launches_use(monkeypatch: pytest.MonkeyPatch, cache: str,
                                                         int4_decode: str) -> None:
    """The warm-up (``warmup.compile_attention_variants``, run before serving) must compile the
    variants that decode, mixed and split launches then use; int4 caches take tiles of their own
    (``planning.cache_tiles``), and their decodes the Gluon kernel where it serves (its plans hold
    one more launch). A variant is what Triton compiles per key: the tensors' dtypes and
    alignment, the constexprs and the launch options. Nothing is compiled or launched here: both
    are recorded, and the GPU's SM count is given so that small batches split."""
    from proxima.engine.attention import gluon_int4_decode, launch_args, warmup
    from proxima.engine.attention import triton_attention as ta
    from proxima.engine.attention.kernel_launch import CompiledLaunch
    from tests.test_attention_per_token_head import pth_batch

    monkeypatch.setattr(launch_args, "INT4_DECODE", int4_decode)
    monkeypatch.setattr(gluon_int4_decode, "runs_on", lambda device: True)  # launches are recorded only

    compiled: set = set()
    launched: set = set()

    def variant(launcher, key, options) -> tuple:
        # The attention key's constexprs and role; the merge's last two items.
        return id(launcher), key[1], key[4:6] if launcher is ta._launch_attention else key[-2:], \
            tuple(sorted(options.items()))

    def compile_(self, grid, args, key, **options) -> bool:
        compiled.add(variant(self, key, options))
        return True

    def launch(self, grid, args, key, **options) -> None:
        launched.add(variant(self, key, options))

    batches = ([(1, 300)] * 3, [(30, 500), (1, 200), (1, 1)], [(1, 2000)], [(1, 40)] * 40)
    width = max(s for requests in batches for _, s in requests) + 5  # make_batch's width
    made = []  # written before launches are recorded: a GPU KV write is a launch too, not attention's
    for requests in batches:
        if cache == "float32":
            made.append((requests, make_batch(requests, 8, 2, 64, seed=len(requests)), None))
        else:
            # The Gluon kernel takes bf16/fp16 queries only (gluon_int4_decode.serves).
            dtype = torch.bfloat16 if int4_decode == "gluon" else torch.float32
            pb = pth_batch(requests, (8, 2), 64, cache, seed=len(requests), dtype=dtype)
            made.append((requests, pb.batch, pb.cache))
    monkeypatch.setattr(CompiledLaunch, "compile", compile_)
    monkeypatch.setattr(CompiledLaunch, "__call__", launch)
    monkeypatch.setattr(planning, "num_sms", lambda device: 132)
    for requests, b, scales in made:
        table = torch.full((b.slot_table.shape[0], width), 0, dtype=torch.int32, device=DEVICE)
        table[:, : b.slot_table.shape[1]] = b.slot_table  # one width: the warm-up plans from it
        args = (b.query, b.k_cache if scales is None else scales.k_codes,
                b.v_cache if scales is None else scales.v_codes, table, b.query_start_loc, b.seq_lens)
        if not compiled:
            warmup.compile_attention_variants(*args, b.output, scales)
        ta.slot_attention_triton(*args, b.scale, b.output, max_query_len=max(q for q, _ in requests),
                                 max_seq_len=max(s for _, s in requests), kv_scales=scales)
    splits = {v for v in launched if v[0] == id(ta._launch_attention) and v[2][0][11]}  # SPLIT
    assert splits and launched, "the cases must launch split and unsplit variants"
    assert launched <= compiled, f"launched but never warmed up: {launched - compiled}"
    gluon = {v for v in launched if v[0] == id(gluon_int4_decode._launch)}
    assert bool(gluon) == (int4_decode == "gluon"), "int4 decodes take the Gluon kernel where it serves"


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("cache", ["float32", "int4_per_token_head"])
def test_a_plan_of_two_launches_equals_the_one_launch_plan(num_splits: int, cache: str) -> None:
    """``TileConfig.short_launch``: the short requests in a launch of their own (one program per
    request) and the rest in the long tiles' launch, both into one split workspace, must write what
    the one launch writes: bit for bit under the interpreter (same tiles, same sums), to float32
    rounding on a GPU (other warps). Short queries at the boundary, long ones, empty requests."""
    from dataclasses import replace

    from proxima.engine.attention import triton_attention as ta
    from tests.test_attention_per_token_head import pth_batch

    triton_attention_or_skip()
    requests = [(4, 40), (1, 30), (5, 5), (0, 4), (1, 1), (21, 60), (4, 4), (1, 77), (0, 0)]
    if cache == "float32":
        b = make_batch(requests, 8, 2, 64, fragmented=True, seed=5)
        scales, k, v = None, b.k_cache, b.v_cache
        one = planning.TileConfig(32, 16, short_block_m=16, short_block_n=32)
    else:
        pb = pth_batch(requests, (8, 2), 64, cache, seed=5)
        b, scales = pb.batch, pb.cache
        k, v = scales.k_codes, scales.v_codes
        # A bf16 model's int4 plan (a float32 one has no short tiles): 16-row decode tiles beside 64.
        one = planning.cache_tiles(4, 64, 2, None, True)
        assert one.short_block_m == 16
    two = replace(one, short_launch=planning.TileConfig(one.short_block_m, one.short_block_n, 8, 1))
    outputs = []
    for tiles in (one, two):
        out = torch.full_like(b.output, float("nan"))
        plan = ta._launch_plan(b.query, k, v, b.slot_table, b.query_start_loc, b.seq_lens, b.scale, out,
                               b.query.shape[0], tiles, num_splits, scales)
        # Two launches: the longest query's launch first (the long launch reads it).
        assert len(plan) == 2 * (tiles is two) + (num_splits > 1) + 1
        for launch, grid, args, key, options in plan:
            launch(grid, args, key, **options)
        outputs.append(out.cpu())
        if tiles is two and num_splits == 1:  # each launch alone writes only its own requests' rows
            short = torch.tensor([q <= one.short_block_m // 4 for q, _ in requests for _ in range(q)])
            for (launch, grid, args, key, options), mine in zip(plan[1:], (short, ~short)):
                alone = torch.full_like(b.output, float("nan"))
                launch(grid, tuple(alone if a is out else a for a in args), key, **options)
                written = torch.isfinite(alone[: b.num_queries].cpu()).all(-1).all(-1)
                assert torch.equal(written, mine)
    expected = slot_attention_torch(b.query, k, v, b.slot_table, b.query_start_loc, b.seq_lens, b.scale,
                                    torch.full_like(b.output, float("nan")), kv_scales=scales)
    assert_rows(outputs[1], expected.cpu(), b.num_queries, atol=1e-3, rtol=1e-3)
    if DEVICE == "cpu":
        assert torch.equal(outputs[0][: b.num_queries], outputs[1][: b.num_queries])
    else:
        torch.testing.assert_close(outputs[0][: b.num_queries], outputs[1][: b.num_queries],
                                   atol=1e-5, rtol=1e-5)


def test_a_uniform_decode_graph_gets_the_decode_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph being captured drops the host hints (it replays other batches), so it gets the mixed
    plan; vLLM's uniform-decode graphs (``BatchDescriptor.uniform``) replay only batches of the
    capture's query length, which the backend passes on so they get the decode plan."""
    from vllm.config import VllmConfig
    from vllm.forward_context import BatchDescriptor, create_forward_context, override_forward_context

    from proxima.engine.attention.backend import uniform_graph_query_len

    b = make_batch([(1, 30)] * 4, 8, 2, 64, seed=3, dtype=torch.bfloat16)  # fp32 plans are never mixed
    args = (b.query, b.k_cache, b.slot_table, b.query_start_loc)
    decode = planning.choose_launch_shape(*args, 1, 30)[0]
    mixed = planning.choose_launch_shape(*args, None, None)[0]
    assert decode.short_block_m == 0 and mixed.short_block_m > 0
    monkeypatch.setattr(planning, "capturing", lambda t: True)
    assert planning.choose_launch_shape(*args, 1, 30)[0] == mixed
    assert planning.choose_launch_shape(*args, 1, 30, graph_max_query_len=1)[0] == decode

    meta = SimpleNamespace(max_query_len=1)
    assert uniform_graph_query_len(meta) is None  # no forward context: not known
    config = VllmConfig()
    for uniform, expected in ((True, 1), (False, None)):
        descriptor = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=uniform)
        with override_forward_context(create_forward_context(None, config, batch_descriptor=descriptor)):
            assert uniform_graph_query_len(meta) == expected
    with override_forward_context(create_forward_context(None, config)):  # eager: no descriptor
        assert uniform_graph_query_len(meta) is None


def test_the_longest_query_is_found_on_the_device() -> None:
    """Over more requests than the kernel reads at a time (512), empty ones and the longest last."""
    from proxima.engine.attention import triton_attention as ta

    triton_attention_or_skip()
    for lengths in ([1], [0, 0], [3, 0, 7, 1], [1] * 700 + [0, 9], [5] + [1] * 1030):
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        assert int(ta.longest_query(starts.to(DEVICE))) == max(lengths)


def test_a_long_launch_reads_the_longest_query_before_anything_else() -> None:
    """The long launch of a two-launch plan returns at once when the longest query fits the short
    tiles: told so (falsely, here) it writes nothing, though a long request is there; told the
    truth, it writes the long requests' rows."""
    from dataclasses import replace

    from proxima.engine.attention import triton_attention as ta

    triton_attention_or_skip()
    requests = [(1, 30), (21, 60), (1, 1)]
    b = make_batch(requests, 8, 2, 64, fragmented=True, seed=6)
    one = planning.TileConfig(32, 16, short_block_m=16, short_block_n=32)
    two = replace(one, short_launch=planning.TileConfig(16, 32, 8, 1))
    long_rows = torch.tensor([q > 16 // 4 for q, _ in requests for _ in range(q)])
    for told, written in ((torch.tensor([4]), False), (torch.tensor([21]), True)):
        out = torch.full_like(b.output, float("nan"))
        plan = ta._launch_plan(b.query, b.k_cache, b.v_cache, b.slot_table, b.query_start_loc, b.seq_lens,
                               b.scale, out, b.query.shape[0], two, 1, None,
                               longest_query=lambda told=told: told.to(torch.int32).to(DEVICE))
        assert len(plan) == 2  # given the longest query, no launch of its own
        launch, grid, args, key, options = plan[1]
        launch(grid, args, key, **options)
        rows = torch.isfinite(out[: b.num_queries].cpu()).all(-1).all(-1)
        assert torch.equal(rows, long_rows if written else torch.zeros_like(long_rows))
