"""The parts of a vLLM /v1/completions (or chat) answer the tools read: the text and token ids
(`completion_answer`: a wrong shape is a `MalformedAnswer`), and what a request asked for beside
them: the prompt's token ids, each position's top logprobs, the prompt tokens' ranks under
``prompt_logprobs`` (these readers never raise: a caller that wanted them says it could not tell).

Layer: pure functions on parsed JSON, beside `proxima.fetch` (which reads and parses it); used by
`proxima.load`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from proxima.fetch import MalformedAnswer, is_count


def completion_answer(payload: object, max_tokens: int,
                      chat: bool = False) -> tuple[str, tuple[int, ...] | None, int, int]:
    """(text, token ids or None, prompt tokens, completion tokens) of a whole /v1/completions
    answer's first choice (`chat`: a /v1/chat/completions answer's, its message's content);
    MalformedAnswer when it is not one, or holds more than `max_tokens`."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedAnswer('no "choices" list')
    choice = choices[0]
    if chat:
        message = choice.get("message")
        if not isinstance(message, dict):
            raise MalformedAnswer('no "message" object')
        text = message.get("content")
    else:
        text = choice.get("text")
    if text is not None and not isinstance(text, str):
        raise MalformedAnswer('the answer\'s text is not a string')
    ids = choice.get("token_ids")
    if ids is not None and not (isinstance(ids, list) and all(is_count(t) for t in ids)):
        raise MalformedAnswer('"token_ids" is not a list of token ids')
    usage = payload.get("usage")
    if usage is None:
        usage = {}
    if not isinstance(usage, dict):
        raise MalformedAnswer('"usage" is not an object')
    prompt_tokens, completion_tokens = (usage.get(k) or 0 for k in ("prompt_tokens", "completion_tokens"))
    if not (is_count(prompt_tokens) and is_count(completion_tokens)):
        raise MalformedAnswer('"usage" token counts are not counts')
    if completion_tokens > max_tokens or (ids is not None and len(ids) > max_tokens):
        raise MalformedAnswer(f"more tokens than the {max_tokens} asked for")
    return text or "", tuple(ids) if ids is not None else None, prompt_tokens, completion_tokens


def completion_prompt_ids(payload: object) -> tuple[int, ...] | None:
    """The prompt's token ids of a /v1/completions answer asked with ``"return_token_ids": true``
    (vLLM 0.26); None when absent or not a list of ids (never raises)."""
    try:
        ids = payload["choices"][0]["prompt_token_ids"]
    except (KeyError, IndexError, TypeError):
        return None
    return tuple(ids) if isinstance(ids, list) and all(is_count(t) for t in ids) else None


def prompt_token_ranks(payload: object, token_ids: Sequence[int], scored_from: int) -> tuple[int, ...] | None:
    """Each prompt token's rank (1: the server's most likely next token there) at positions
    ``scored_from`` on, from a /v1/completions answer asked with ``"prompt_logprobs"`` (vLLM lists
    the actual token at every position, with its rank); None when not of that shape."""
    try:
        entries = payload["choices"][0]["prompt_logprobs"]
        if len(entries) != len(token_ids) or scored_from < 1:
            return None
        ranks = tuple(entries[i][str(token_ids[i])]["rank"] for i in range(scored_from, len(token_ids)))
    except (KeyError, IndexError, TypeError):
        return None
    return ranks if all(is_count(r) and r >= 1 for r in ranks) else None


def completion_top_logprobs(payload: object) -> tuple[dict[str, float], ...] | None:
    """Each generated position's top logprobs (token text -> logprob) of a /v1/completions answer's
    first choice asked with ``"logprobs": n``; None when absent or not of that shape (never raises:
    a caller that wanted them reports that it could not tell, not a failed request)."""
    try:
        top = payload["choices"][0]["logprobs"]["top_logprobs"]
        out = tuple({str(k): float(v) for k, v in position.items()} for position in top)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None
    finite = all(math.isfinite(v) or v == -math.inf for position in out for v in position.values())
    return out if finite else None
