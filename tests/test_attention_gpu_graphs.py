"""Proxima's Triton attention as vLLM drives it on a GPU: full CUDA graphs and kernel warm-up.

`proxima serve` runs vLLM with ``cudagraph_mode=FULL``: every batch of up to 512 tokens, mixed
prefill+decode included, replays a graph captured once per token count with vLLM's dummy
decode-like batch (one token per request). These tests capture exactly that way, then replay
real mixed, prefill and decode metadata written into the same buffers, against the torch
reference; and they check that the warm-up compiles every kernel variant later launches use,
so no request waits for a compile. CUDA only (run by `scripts/gpu/run.sh kernels`).
"""

from __future__ import annotations

from tests.attention_cases import DEVICE, GARBAGE_SLOT  # first: sets TRITON_INTERPRET on CPU-only machines

# isort: split

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from proxima.engine.attention.reference import slot_attention_torch  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and compiled kernels need a GPU")

HQ, HKV, D, WIDTH, SLOTS = 32, 8, 128, 2048, 20000
SCALE = 1.0 / math.sqrt(D)


class GraphBuffers:
    """The persistent tensors a captured graph reads, sized for ``tokens`` padded tokens."""

    def __init__(self, tokens: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        self.tokens = tokens
        self.gen = gen
        kv = torch.randn(SLOTS, HKV, 2 * D, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.k_cache, self.v_cache = kv[..., :D], kv[..., D:]
        self.query = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.output = torch.zeros_like(self.query)
        # vLLM's dummy capture batch: one token per request, as many requests as tokens.
        self.table = torch.full((tokens, WIDTH), GARBAGE_SLOT, dtype=torch.int32, device="cuda")
        self.table[:, :8] = torch.randperm(SLOTS, device="cuda", generator=gen)[: tokens * 8].view(tokens, 8)
        self.qsl = torch.arange(tokens + 1, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.full((tokens,), 8, dtype=torch.int32, device="cuda")

    def call(self) -> None:
        from proxima.engine.attention.triton_attention import slot_attention_triton

        slot_attention_triton(self.query, self.k_cache, self.v_cache, self.table, self.qsl, self.seq_lens,
                              SCALE, self.output, num_actual_tokens=self.tokens, max_query_len=1,
                              max_seq_len=8)

    def load(self, requests: list[tuple[int, int]]) -> int:
        """Write a real batch (query tokens, context incl. them) into the buffers, padded as vLLM
        pads a graph's batch: spare requests get no queries and length 0. Returns its token count."""
        num_reqs, num_tokens = len(requests), sum(q for q, _ in requests)
        assert num_reqs <= self.tokens and num_tokens <= self.tokens
        perm = torch.randperm(SLOTS, device="cuda", generator=self.gen)
        self.table.fill_(GARBAGE_SLOT)
        taken, starts = 0, [0]
        for r, (q_len, seq_len) in enumerate(requests):
            self.table[r, :seq_len] = perm[taken:taken + seq_len]
            taken += seq_len
            starts.append(starts[-1] + q_len)
        starts += [num_tokens] * (self.tokens - num_reqs)
        self.qsl.copy_(torch.tensor(starts, dtype=torch.int32))
        self.seq_lens.copy_(torch.tensor([s for _, s in requests] + [0] * (self.tokens - num_reqs),
                                         dtype=torch.int32))
        self.query.copy_(torch.randn(self.query.shape, device="cuda", generator=self.gen))
        self.output.fill_(float("nan"))
        return num_tokens


REPLAYS = {
    4: [[(1, 1500), (2, 300)], [(4, 2048)], [(1, 7), (1, 2048), (1, 100), (1, 1)]],
    64: [[(40, 140), (1, 300), (1, 1500), (1, 7), (1, 2048)], [(60, 60)],
         [(1, n) for n in range(100, 164)], [(16, 2000), (16, 16), (1, 900)]],
}


@pytest.mark.parametrize("tokens", sorted(REPLAYS), ids=lambda t: f"{t}-token graph")
def test_graph_captured_on_a_decode_batch_replays_mixed_batches_exactly(tokens: int) -> None:
    """The 4-token graph splits KV (few programs), the 64-token one does not."""
    b = GraphBuffers(tokens)
    b.call()  # vLLM runs each size once before capturing it
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b.call()
    for requests in REPLAYS[tokens]:
        n = b.load(requests)
        graph.replay()
        r = len(requests)
        expected = slot_attention_torch(b.query, b.k_cache, b.v_cache, b.table[:r], b.qsl[: r + 1],
                                        b.seq_lens[:r], SCALE, torch.full_like(b.output, float("nan")))
        got = b.output[:n].float()
        assert torch.isfinite(got).all(), requests
        torch.testing.assert_close(got, expected[:n].float(), atol=2e-2, rtol=2e-2, msg=str(requests))


def _compiled_count(fn) -> int:
    device = torch.cuda.current_device()
    return len(fn.device_caches[device][0])


def test_precompiled_variants_cover_every_launch_that_follows() -> None:
    from proxima.engine.attention import triton_attention as ta
    from proxima.engine.attention import warmup
    from proxima.engine.attention.triton_merge_splits import _merge_splits_kernel

    b = GraphBuffers(64)
    warmup.compile_attention_variants(b.query, b.k_cache, b.v_cache, b.table, b.qsl, b.seq_lens, b.output)
    before = (_compiled_count(ta._slot_attention_kernel), _compiled_count(_merge_splits_kernel))
    # Decode and prefill tiles, unsplit and split with several split counts, mixed batches.
    for requests in ([(1, 2048)], [(1, 300)] * 64, [(64, 64)], [(8, 2048)], [(1, 1000)] * 3,
                     [(30, 500), (1, 2000), (1, 1)], [(2, 2048)] * 2):
        n = b.load(requests)
        q_lens = [q for q, _ in requests]
        ta.slot_attention_triton(b.query, b.k_cache, b.v_cache, b.table, b.qsl[: len(requests) + 1],
                                 b.seq_lens[: len(requests)], SCALE, b.output, num_actual_tokens=n,
                                 max_query_len=max(q_lens), max_seq_len=max(s for _, s in requests))
    torch.cuda.synchronize()
    after = (_compiled_count(ta._slot_attention_kernel), _compiled_count(_merge_splits_kernel))
    assert after == before, f"compiled after warm-up: {before} -> {after} (attention, merge)"
