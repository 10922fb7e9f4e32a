"""The accuracy benchmark's pure parts: perplexity, KL from top-k lists, greedy agreement, the
fixed text and the fixed chats (no engine)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxima import accuracy_corpus
from proxima.accuracy import (
    PositionLogprobs,
    from_vllm,
    greedy_agreement,
    kl_divergence,
    kl_summary,
    perplexity,
    top1_agreement,
    top_token,
)
from proxima.accuracy_corpus import CorpusError, corpus_text, paragraphs, passages
from proxima.chat_prompts import GENERAL_QUESTIONS, SUPPORT_QUESTIONS, accuracy_chats


def _log(dist: np.ndarray) -> dict[int, float]:
    return {i: float(math.log(p)) for i, p in enumerate(dist)}


def _top(logprobs: dict[int, float], k: int, keep: int) -> dict[int, float]:
    """What vLLM reports with prompt_logprobs=k: the k most likely tokens and the actual one."""
    top = dict(sorted(logprobs.items(), key=lambda kv: -kv[1])[:k])
    top[keep] = logprobs[keep]
    return top


def _exact_kl(p: np.ndarray, q: np.ndarray) -> float:
    return float(np.sum(p * (np.log(p) - np.log(q))))


def test_perplexity_is_exp_of_mean_negative_log_likelihood():
    half = PositionLogprobs(5, {5: math.log(0.5), 6: math.log(0.5)})
    quarter = PositionLogprobs(7, {7: math.log(0.25), 1: math.log(0.75)})
    assert perplexity([[half, half]]) == pytest.approx(2.0)
    # Pooled over all tokens of all passages, not averaged per passage.
    pooled = math.exp((math.log(2) + 2 * math.log(4)) / 3)
    assert perplexity([[half], [quarter, quarter]]) == pytest.approx(pooled)
    with pytest.raises(ValueError):
        perplexity([[]])


def test_kl_with_the_whole_vocabulary_is_exact():
    p = np.array([0.5, 0.25, 0.125, 0.125])
    q = np.array([0.25, 0.25, 0.25, 0.25])
    kl, rest = kl_divergence(_log(p), _log(q))
    assert kl == pytest.approx(_exact_kl(p, q)) and rest == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(_log(p), _log(p))[0] == pytest.approx(0.0, abs=1e-12)


def test_kl_from_top_k_merges_the_rest_into_one_bucket():
    p = np.array([0.6, 0.2, 0.1, 0.05, 0.05])
    q = np.array([0.5, 0.3, 0.05, 0.1, 0.05])
    ref, test = _top(_log(p), 2, keep=0), _top(_log(q), 2, keep=0)
    kl, rest = kl_divergence(ref, test)
    # Buckets {0}, {1}, rest {2, 3, 4}: 0.6 ln(0.6/0.5) + 0.2 ln(0.2/0.3) + 0.2 ln(0.2/0.2).
    assert kl == pytest.approx(0.6 * math.log(0.6 / 0.5) + 0.2 * math.log(0.2 / 0.3))
    assert rest == pytest.approx(0.2)
    assert kl <= _exact_kl(p, q)


def test_kl_rest_floor_when_the_test_reports_all_its_mass():
    ref = {0: math.log(0.5)}  # half of the reference's mass is elsewhere
    test = {0: 0.0}  # the test puts everything on token 0
    kl, rest = kl_divergence(ref, test)
    assert rest == pytest.approx(0.5) and math.isfinite(kl) and kl > 1.0
    with pytest.raises(ValueError):
        kl_divergence({1: -1.0}, {2: -1.0})


@settings(max_examples=200)
@given(st.integers(2, 40), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_top_k_kl_is_a_lower_bound_of_the_full_kl(vocab, k, seed):
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.full(vocab, 0.3)) + 1e-12, rng.dirichlet(np.full(vocab, 0.3)) + 1e-12
    p, q = p / p.sum(), q / q.sum()
    actual = int(rng.integers(vocab))
    kl, rest = kl_divergence(_top(_log(p), k, actual), _top(_log(q), k, actual))
    full = _exact_kl(p, q)
    assert -1e-9 <= kl <= full + 1e-9
    if k >= vocab:
        assert kl == pytest.approx(full, rel=1e-6, abs=1e-9)


def test_from_vllm_reads_the_openai_json_and_the_in_process_forms():
    class Logprob:  # vllm.logprobs.Logprob's shape
        def __init__(self, logprob: float) -> None:
            self.logprob = logprob

    json_form = [None, {"11": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
                        "12": {"logprob": -2.5, "rank": 2, "decoded_token": "b"}}]
    object_form = [None, {11: Logprob(-0.1), 12: Logprob(-2.5)}]
    for form in (json_form, object_form):
        (position,) = from_vllm([10, 12], form)
        assert position.token_id == 12 and position.logprobs == {11: -0.1, 12: -2.5}
    with pytest.raises(ValueError):
        from_vllm([10, 12, 13], json_form)  # one entry short
    with pytest.raises(ValueError):
        from_vllm([10, 99], json_form)  # the actual token missing from its position
    with pytest.raises(ValueError):
        from_vllm([10, 11], [None, {"11": {"logprob": 0.5}}])  # not a log probability


def test_kl_summary_over_passages():
    def position(token: int, p0: float) -> PositionLogprobs:
        return PositionLogprobs(token, {0: math.log(p0), 1: math.log(1 - p0)})

    ref = [[position(0, 0.5)] * 99 + [position(1, 0.5)]]
    test = [[position(0, 0.5)] * 99 + [position(1, 0.9)]]
    summary = kl_summary(ref, test)
    worst = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert summary.num_positions == 100 and summary.mean_rest_mass == pytest.approx(0.0, abs=1e-12)
    assert summary.max == pytest.approx(worst) and summary.mean == pytest.approx(worst / 100)
    assert summary.p99 == pytest.approx(float(np.quantile([0.0] * 99 + [worst], 0.99)))
    with pytest.raises(ValueError):
        kl_summary(ref, [[position(1, 0.5)] * 100])  # another token sequence


def test_top1_agreement_counts_positions_whose_most_likely_token_is_the_same():
    def position(token: int, logprobs: dict[int, float]) -> PositionLogprobs:
        return PositionLogprobs(token, logprobs)

    ref = [[position(1, {1: -0.1, 2: -2.0}), position(2, {1: -1.0, 2: -0.5})], [position(3, {3: -0.2})]]
    test = [[position(1, {1: -2.0, 2: -0.1}), position(2, {1: -1.0, 2: -0.5})], [position(3, {3: -0.3})]]
    assert top1_agreement(ref, test) == (2, 3)
    # A tie goes to the lowest token id, as greedy sampling's argmax does.
    assert top_token({9: -0.5, 3: -0.5, 4: -2.0}) == 3
    with pytest.raises(ValueError):
        top1_agreement(ref, test[:1])
    with pytest.raises(ValueError):
        top1_agreement(ref, [test[0][:1], test[1]])


def test_greedy_agreement():
    ref = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    out = [[1, 2, 3, 4], [5, 6, 0], [7, 8, 0, 0]]
    agreement = greedy_agreement(ref, out)
    assert agreement.num_prompts == 3 and agreement.num_identical == 1
    assert agreement.share_identical == pytest.approx(1 / 3)
    assert agreement.mean_common_prefix == pytest.approx((1.0 + 2 / 3 + 2 / 4) / 3)
    with pytest.raises(ValueError):
        greedy_agreement(ref, out[:2])


def test_corpus_is_the_pinned_text_cut_the_same_way_every_time(tmp_path, monkeypatch):
    text = corpus_text()
    first = passages(8)
    assert first == passages(8) and len(first) == 8
    assert first[0].startswith("THE FIRST BOOK OF OPTICKS") and all(len(p) >= 2000 for p in first)
    assert not any("[Illustration" in p or "_" in p for p in passages(200))
    assert len(passages(1000)) == 180  # the whole book at the default passage size
    altered = tmp_path / "opticks.txt"
    altered.write_text(text.replace("Refrangibility", "Refrangibilty", 1))
    monkeypatch.setattr(accuracy_corpus, "corpus_path", lambda: altered)
    with pytest.raises(CorpusError, match="SHA-256"):
        passages(1)


def test_paragraphs_drop_captions_and_footnotes():
    text = ("front matter\n\nTHE FIRST BOOK OF OPTICKS\n\n[Illustration: FIG. 1]\n\n"
            "Light _is_ refracted[A]\nat the surface.\n\n[A] A footnote.\n")
    assert paragraphs(text) == ["THE FIRST BOOK OF OPTICKS", "Light is refracted at the surface."]


def test_accuracy_chats_are_at_least_100_distinct_questions():
    chats = accuracy_chats()
    assert len(chats) >= 100
    questions = [chat[-1]["content"] for chat in chats]
    assert len(set(questions)) == len(questions) == len(SUPPORT_QUESTIONS) + len(GENERAL_QUESTIONS)
    assert all(chat[-1]["role"] == "user" for chat in chats)
