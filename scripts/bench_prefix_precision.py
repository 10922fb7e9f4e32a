"""What keeping a request's first tokens (a shared system prompt) at higher precision buys when
the rest of its KV is int4 per token head: the measurement issue 25's stretch asks for before
anything is built.

A shared system prompt is stored once and read by every request that carries it, so spending
bytes on it costs little capacity. Whether it buys accuracy is measured here by simulation: the
real model (SmolLM2-135M-Instruct) in transformers, float32, with each layer's post-RoPE K and V
replaced by what a cache of the chosen dtype reads back (vLLM 0.26's quantisers, as Proxima's
torch twin computes them byte for byte: `proxima.engine.attention.per_token_head`) before
attention, per position: the first `P` positions in one dtype, the rest in another. Every figure
is against the same model with float32 KV, over the positions after the prefix only (what a
request's own tokens see), with the full vocabulary (exact KL, no top-k bound):

- chats: the 60 support questions under the shop's system prompt (`proxima.chat_prompts`), each
  followed by the float32-KV greedy answer (64 tokens), teacher-forced; the prefix is the tokens
  all 60 share (the system turn);
- text: passages of the accuracy corpus (Newton's *Opticks*), the first `--text-prefix` tokens
  taken as the prefix, perplexity over the rest.

Sanity anchor: "int4 everywhere" here should cost what the engines measured (docs/benchmarks.md,
"Accuracy per KV dtype": +6.1 to +6.5% perplexity, KL mean ~0.043, top-1 87%) up to the engine's
bf16 model and chunking.

usage: python scripts/bench_prefix_precision.py MODEL_DIR [--passages 12] [--json out.json]
       (MODEL_DIR: `proxima model smol DIR --dtype float32`)
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from proxima.accuracy_corpus import passages
from proxima.chat_prompts import SUPPORT_QUESTIONS, support_chat
from proxima.engine.attention import per_token_head as pth
from proxima.files import atomic_output

# (name, prefix dtype, rest dtype, most positions the prefix dtype covers: None for the whole
# prefix); "fp32" is the reference, stored as computed.
CONFIGS = (
    ("bf16 everywhere", "bf16", "bf16", None),
    ("int8 per token head everywhere", "int8_per_token_head", "int8_per_token_head", None),
    ("int4 everywhere", "int4_per_token_head", "int4_per_token_head", None),
    ("int4, first 4 tokens bf16", "bf16", "int4_per_token_head", 4),
    ("int4, prefix int8 per token head", "int8_per_token_head", "int4_per_token_head", None),
    ("int4, prefix fp8 per token head", "fp8_per_token_head", "int4_per_token_head", None),
    ("int4, prefix bf16", "bf16", "int4_per_token_head", None),
)


def read_back(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Rows `[T, Hkv, D]` as a cache of `dtype` reads them back (float32)."""
    if dtype == "fp32":
        return x
    if dtype == "bf16":
        return x.to(torch.bfloat16).float()
    fmt = pth.PTH_FORMATS[dtype]
    values = pth.dequantize(*pth.quantize(x, fmt), fmt)
    return pth.unrotate(values) if fmt.packed else values  # int4 is stored rotated


class Placement:
    """The attention hook's setting: positions `< prefix_len` (and `< cap`, when set) in `prefix`,
    the rest in `rest`."""
    prefix, rest, prefix_len, cap = "fp32", "fp32", 0, None


def _kv_as_cached(t: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, T, D]` keys or values, each position read back in its placement's dtype."""
    rows = t.transpose(1, 2).float()  # [B, T, Hkv, D]
    split = Placement.prefix_len if Placement.cap is None else min(Placement.prefix_len, Placement.cap)
    out = torch.cat([read_back(rows[0, :split], Placement.prefix),
                     read_back(rows[0, split:], Placement.rest)])
    return out.unsqueeze(0).transpose(1, 2).to(t.dtype)


def _attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention of one unpadded sequence over the K/V as cached; the queries are the last
    positions (a causal mask aligned to the end: the default top-left one is wrong with a cache)."""
    key, value = _kv_as_cached(key), _kv_as_cached(value)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    q_len, k_len = query.shape[2], key.shape[2]
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@dataclass
class Sequence:
    ids: list[int]
    scored_from: int  # first position whose next-token distribution counts


@dataclass
class Figures:
    kl_mean: float
    kl_p99: float
    top1_equal: float
    nll_mean: float  # of the sequence's actual next tokens (text) or the reference answer (chats)
    positions: int


def _log_probs(model, seq: Sequence, cache: DynamicCache | None = None, start: int = 0) -> torch.Tensor:
    """Log probabilities `[positions, vocab]` for the scored positions of `seq`, its first `start`
    tokens already in `cache` (a copy is extended; the hook reads each position afresh)."""
    with torch.inference_mode():
        cache = copy.deepcopy(cache) if cache is not None else None
        logits = model(torch.tensor([seq.ids[start:]]), cache=cache, use_cache=cache is not None).logits[0]
        logits = logits[seq.scored_from - 1 - start:-1].float()
    return F.log_softmax(logits, -1)


def _prefix_cache(model, ids: list[int]) -> DynamicCache:
    """The shared prefix's cache under the hook's current placement (its K/V of layers past the
    first depend on how the prefix read its own KV)."""
    with torch.inference_mode():
        cache = model(torch.tensor([ids]), use_cache=True).cache
    if cache is None or cache.get_seq_length() != len(ids):
        raise RuntimeError("this transformers version returned no cache: the prefix would be lost")
    return cache


def measure(model, sequences: list[Sequence], prefix_lens: list[int], reference: list[torch.Tensor],
            prefix: str, rest: str, shared: int = 0, cap: int | None = None) -> Figures:
    """Figures of one placement; with `shared`, every sequence starts with the same `shared` tokens,
    computed once."""
    kls, agree, nlls = [], [], []
    Placement.prefix, Placement.rest, Placement.cap = prefix, rest, cap
    cache = None
    for seq, p_len, ref in zip(sequences, prefix_lens, reference):
        Placement.prefix_len = p_len
        if shared and cache is None:
            cache = _prefix_cache(model, seq.ids[:shared])
        test = _log_probs(model, seq, cache, shared)
        kls.append((ref.exp() * (ref - test)).sum(-1))
        agree.append(ref.argmax(-1) == test.argmax(-1))
        targets = torch.tensor(seq.ids[seq.scored_from:])
        nlls.append(-test.gather(1, targets[:, None])[:, 0])
    kl, eq, nll = torch.cat(kls), torch.cat(agree), torch.cat(nlls)
    return Figures(kl.mean().item(), torch.quantile(kl, 0.99).item(), eq.float().mean().item(),
                   nll.mean().item(), kl.numel())


def chat_sequences(model, tokenizer, answer_tokens: int) -> tuple[list[Sequence], int]:
    """The support chats with their float32-KV greedy answers, and the tokens all of them share."""
    prompts = [list(tokenizer.apply_chat_template(support_chat(q), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for q in SUPPORT_QUESTIONS]
    shared = 0
    while all(len(p) > shared and p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    Placement.prefix = Placement.rest = "fp32"
    prefix = _prefix_cache(model, prompts[0][:shared])
    sequences = []
    with torch.inference_mode():
        for p in prompts:
            cache = copy.deepcopy(prefix)
            ids, feed = list(p), p[shared:]
            for _ in range(answer_tokens):  # greedy, EOS or not: every answer the same length
                nxt = int(model(torch.tensor([feed]), cache=cache, use_cache=True).logits[0, -1].argmax())
                ids.append(nxt)
                feed = [nxt]
            sequences.append(Sequence(ids, len(p)))
    return sequences, shared


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--passages", type=int, default=12)
    ap.add_argument("--text-prefix", type=int, default=300, help="tokens of a passage taken as its prefix")
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    AttentionInterface.register("proxima_kv_as_cached", _attention)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                 attn_implementation="proxima_kv_as_cached").eval()
    started = time.monotonic()
    chats, shared = chat_sequences(model, tokenizer, args.answer_tokens)
    texts = [Sequence(ids, args.text_prefix + 1) for ids in
             (tokenizer(p)["input_ids"] for p in passages(args.passages)) if len(ids) > args.text_prefix + 64]
    sets = {  # name: sequences, each one's prefix, tokens all of them share
        "chats": (chats, [shared] * len(chats), shared),
        "chats, whole prompt as the prefix": (chats, [c.scored_from for c in chats], shared),
        "text": (texts, [args.text_prefix] * len(texts), 0),
    }
    print(f"chats: {len(chats)} support questions, shared prefix {shared} tokens, "
          f"{args.answer_tokens}-token answers; text: {len(texts)} passages, prefix {args.text_prefix} "
          "tokens")
    results: dict = {"shared_prefix_tokens": shared, "text_prefix_tokens": args.text_prefix, "sets": {}}
    for set_name, (seqs, p_lens, common) in sets.items():
        Placement.prefix = Placement.rest = "fp32"
        cache = _prefix_cache(model, seqs[0].ids[:common]) if common else None
        reference = [_log_probs(model, seq, cache, common) for seq in seqs]
        ref_nll = torch.cat([-r.gather(1, torch.tensor(s.ids[s.scored_from:])[:, None])[:, 0]
                             for r, s in zip(reference, seqs)]).mean().item()
        rows = {}
        print(f"\n{set_name} (positions after the prefix; perplexity with float32 KV "
              f"{torch.tensor(ref_nll).exp().item():.3f})")
        print(f"{'KV placement':36} {'KL mean':>9} {'KL p99':>8} {'top-1':>7} {'ppl Δ':>7}")
        for name, prefix, rest, cap in CONFIGS:
            fig = measure(model, seqs, p_lens, reference, prefix, rest, common, cap)
            rows[name] = asdict(fig)
            print(f"{name:36} {fig.kl_mean:9.5f} {fig.kl_p99:8.4f} {fig.top1_equal:7.1%} "
                  f"{(torch.tensor(fig.nll_mean - ref_nll).exp().item() - 1):+7.2%}")
        results["sets"][set_name] = {"reference_nll": ref_nll, "configs": rows}
    print(f"\n{time.monotonic() - started:.0f} s")
    if args.json:
        with atomic_output(args.json) as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
