"""What a KV cache dtype costs in answers: perplexity, KL divergence of next-token distributions,
top-1 agreement and greedy-answer agreement, computed from what vLLM returns. Pure functions on
plain data; the engine runs that produce the data live elsewhere (the engine harness), the fixed inputs in
`proxima.accuracy_corpus` (the text) and `proxima.chat_prompts` (the chats).

Input shape: for each passage, one `PositionLogprobs` per prompt position after the first (vLLM
has no distribution for the first token): the token that actually came next and the log
probabilities vLLM reported there, as `prompt_logprobs=k` gives them: the top k tokens plus the
actual token when it ranks below k. `from_vllm` reads both the in-process form
(`RequestOutput.prompt_logprobs`, `Logprob` objects keyed by int) and the OpenAI JSON form
(`choices[0].prompt_logprobs`, objects keyed by the token id as a string).

KL from top-k lists. vLLM 0.26 returns at most `--max-logprobs` entries a position (default 20;
`prompt_logprobs=-1` asks for the whole vocabulary, allowed only when `--max-logprobs` is -1 or at
least the vocabulary size: 49,152 tokens a position for SmolLM2, workable in process, not as
JSON). So KL(P_ref || Q_test) is computed on a partition of the vocabulary: each token that both
lists report (`S`, never empty: both carry the actual token) is its own bucket, every other token
falls in one rest bucket with mass 1 - sum over S. Merging outcomes can only lose divergence
(the log-sum inequality), so the figure is a lower bound of the full KL, equal to it when the
rest holds no mass; `KLSummary.mean_rest_mass` says how much mass the buckets merged. With the
full vocabulary on both sides (`prompt_logprobs=-1`) the rest is empty and the figure exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# A rest bucket below this mass is rounding in the reported logprobs (float32 in vLLM), not mass.
REST_MASS_EPSILON = 1e-6


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """One prompt position: the token that came next and the reported log probabilities there."""

    token_id: int
    logprobs: Mapping[int, float]

    def __post_init__(self) -> None:
        if self.token_id not in self.logprobs:
            raise ValueError(f"position's logprobs lack its own token {self.token_id}; vLLM always "
                             f"reports the prompt token beside the top k")


@dataclass(frozen=True, slots=True)
class KLSummary:
    mean: float
    p99: float
    max: float
    num_positions: int
    mean_rest_mass: float  # reference mass outside the tokens both sides reported, averaged


@dataclass(frozen=True, slots=True)
class Agreement:
    num_prompts: int
    num_identical: int
    # Per prompt, the tokens before the first difference over the longer answer's length; averaged.
    mean_common_prefix: float

    @property
    def share_identical(self) -> float:
        return self.num_identical / self.num_prompts if self.num_prompts else math.nan


def from_vllm(prompt_token_ids: Sequence[int],
              prompt_logprobs: Sequence[Mapping | None]) -> list[PositionLogprobs]:
    """vLLM's prompt logprobs of one prompt as positions 1..n-1 (position 0 has none)."""
    if len(prompt_token_ids) != len(prompt_logprobs):
        raise ValueError(f"{len(prompt_token_ids)} prompt tokens but {len(prompt_logprobs)} logprob entries")
    positions = []
    for index, (token_id, entry) in enumerate(zip(prompt_token_ids, prompt_logprobs)):
        if entry is None:
            if index != 0:
                raise ValueError(f"no logprobs at prompt position {index}")
            continue
        positions.append(PositionLogprobs(int(token_id), {int(k): _logprob(v) for k, v in entry.items()}))
    return positions


def _logprob(value) -> float:
    if isinstance(value, Mapping):  # OpenAI JSON: {"logprob": ..., "rank": ..., "decoded_token": ...}
        value = value["logprob"]
    else:
        value = getattr(value, "logprob", value)  # vllm.logprobs.Logprob, or a bare float
    logprob = float(value)
    if math.isnan(logprob) or logprob > 1e-4:
        raise ValueError(f"not a log probability: {logprob}")
    return min(logprob, 0.0)


def perplexity(passages: Sequence[Sequence[PositionLogprobs]]) -> float:
    """exp of the mean negative log likelihood of the actual next tokens, over all passages' tokens."""
    total, count = 0.0, 0
    for positions in passages:
        for p in positions:
            total -= p.logprobs[p.token_id]
            count += 1
    if count == 0:
        raise ValueError("perplexity of no tokens")
    return math.exp(total / count)


def kl_divergence(reference: Mapping[int, float], test: Mapping[int, float]) -> tuple[float, float]:
    """KL(reference || test) in nats over the tokens both report plus one rest bucket (a lower
    bound of the full KL; see the module docstring), and the reference's rest mass."""
    shared = reference.keys() & test.keys()
    if not shared:
        raise ValueError("the two distributions share no reported token")
    kl, p_shared, q_shared = 0.0, 0.0, 0.0
    for token in shared:
        lp, lq = reference[token], test[token]
        p = math.exp(lp)
        kl += p * (lp - lq)
        p_shared += p
        q_shared += math.exp(lq)
    p_rest, q_rest = max(0.0, 1.0 - p_shared), max(0.0, 1.0 - q_shared)
    if p_rest > 0.0:
        # Always counted: the rest's term is negative when the test puts more mass there, and
        # leaving it out would overstate the KL. A rest the test puts (almost) no mass on is
        # floored at the epsilon rather than divided by a rounding error (which only lowers it).
        kl += p_rest * math.log(p_rest / max(q_rest, REST_MASS_EPSILON))
    return max(kl, 0.0), p_rest


def kl_summary(reference: Sequence[Sequence[PositionLogprobs]],
               test: Sequence[Sequence[PositionLogprobs]]) -> KLSummary:
    """Mean, p99 (linear interpolation) and max KL over every position of every passage."""
    if len(reference) != len(test):
        raise ValueError(f"{len(reference)} reference passages but {len(test)} test passages")
    kls, rests = [], []
    for index, (ref_positions, test_positions) in enumerate(zip(reference, test)):
        if [p.token_id for p in ref_positions] != [p.token_id for p in test_positions]:
            raise ValueError(f"passage {index} is not the same token sequence in both runs")
        for r, t in zip(ref_positions, test_positions):
            kl, rest = kl_divergence(r.logprobs, t.logprobs)
            kls.append(kl)
            rests.append(rest)
    if not kls:
        raise ValueError("KL divergence of no positions")
    values = np.asarray(kls)
    return KLSummary(mean=float(values.mean()), p99=float(np.quantile(values, 0.99)), max=float(values.max()),
                     num_positions=len(kls), mean_rest_mass=float(np.mean(rests)))


def top_token(logprobs: Mapping[int, float]) -> int:
    """The most likely reported token; on a tie the lowest id, as greedy sampling's argmax picks."""
    return min(logprobs, key=lambda token: (-logprobs[token], token))


def top1_agreement(reference: Sequence[Sequence[PositionLogprobs]],
                   test: Sequence[Sequence[PositionLogprobs]]) -> tuple[int, int]:
    """(positions whose most likely token is the same in both runs, positions)."""
    if len(reference) != len(test):
        raise ValueError(f"{len(reference)} reference passages but {len(test)} test passages")
    equal, count = 0, 0
    for index, (ref_positions, test_positions) in enumerate(zip(reference, test)):
        if len(ref_positions) != len(test_positions):
            raise ValueError(f"passage {index} has {len(ref_positions)} positions in one run, "
                             f"{len(test_positions)} in the other")
        for r, t in zip(ref_positions, test_positions):
            equal += top_token(r.logprobs) == top_token(t.logprobs)
            count += 1
    return equal, count


def greedy_agreement(reference: Sequence[Sequence[int]], test: Sequence[Sequence[int]]) -> Agreement:
    """How many greedy answers are token for token identical, and how far each runs identical."""
    if len(reference) != len(test):
        raise ValueError(f"{len(reference)} reference answers but {len(test)} test answers")
    identical, prefix_shares = 0, []
    for ref, out in zip(reference, test):
        ref, out = list(ref), list(out)
        identical += ref == out
        common = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        prefix_shares.append(1.0 if ref == out else common / max(len(ref), len(out)))
    return Agreement(num_prompts=len(reference), num_identical=identical,
                     mean_common_prefix=float(np.mean(prefix_shares)) if prefix_shares else math.nan)
