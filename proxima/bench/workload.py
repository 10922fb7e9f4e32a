"""Workloads for `proxima bench`: seeded generators, the JSONL loader and its validation.

A workload is a fixed list of requests (prompt text, output length) built once and sent
unchanged to every server, so an A/B compares engines, not inputs; it is saved with the
results. Prompts are words drawn from a fixed vocabulary. Their length in tokens is counted by
the server's own tokenizer (vLLM's `/tokenize`) when it answers, else approximated as one token
per word; `Workload.token_counting` records which.

Invariant: every request has a non-empty prompt and `max_tokens >= 1`. A bad file raises
`WorkloadError` whose message is one line naming `file:line` and the fix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from proxima.files import atomic_output

# Common English words that are one token in the usual LLM tokenizers (with a leading space).
VOCABULARY = (
    "the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "it", "by", "this", "be",
    "are", "from", "at", "or", "an", "was", "have", "not", "you", "we", "can", "will", "all", "they",
    "more", "one", "has", "but", "their", "which", "new", "about", "your", "our", "time", "up", "out", "if",
    "when", "what", "there", "so", "some", "no", "other", "into", "only", "its", "also", "any", "may",
    "how", "these", "first", "two", "use", "than", "data", "after", "most", "over", "work", "each", "year",
    "years", "make", "like", "just", "way", "people", "day", "back", "many", "world", "good", "well",
    "state", "page", "system", "part", "made", "where", "set", "help", "find", "high", "should", "through",
    "right", "long", "memory", "cache", "token", "request", "serve", "model", "engine", "block", "slot",
    "free", "used", "value", "small", "large", "fast", "slow", "open", "close", "start", "end", "read",
    "write", "send", "load", "test", "case", "plan", "team", "user", "order", "price", "city", "water",
    "light", "power", "sound", "voice", "music", "paper", "book", "story", "answer", "question", "reason",
    "result", "point",
)

BUILTIN = ("short-chat", "long-doc", "mixed", "shared-prefix", "multi-turn")
DEFAULT_MAX_TOKENS = 128
ALLOWED_KEYS = frozenset({"prompt", "max_tokens", "prompt_tokens", "followups"})
APPROXIMATE = "approximate (1 token per vocabulary word)"
SERVER_TOKENIZER = "server tokenizer (/tokenize)"
NOT_COUNTED = "not counted (server /tokenize unavailable)"


class WorkloadError(ValueError):
    """A user's workload mistake; the message is one line naming the file, line and fix."""


@dataclass(frozen=True, slots=True)
class Range:
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True, slots=True)
class Shape:
    """Length distribution of one built-in workload (prompt and output tokens)."""

    prompt: Range
    output: Range
    long_fraction: float = 0.0  # `mixed`: share of requests drawn from `long_prompt/long_output`
    long_prompt: Range | None = None
    long_output: Range | None = None
    shared_prefix_tokens: int = 0  # `shared-prefix`: one system prompt in front of every request
    turns: int = 1  # `multi-turn`: each request is a conversation of this many turns


SHAPES: dict[str, Shape] = {
    "short-chat": Shape(Range(50, 200), Range(20, 200)),
    "long-doc": Shape(Range(1000, 3000), Range(100, 300)),
    "mixed": Shape(Range(50, 200), Range(20, 200), 0.2, Range(1000, 3000), Range(100, 300)),
    "shared-prefix": Shape(Range(20, 100), Range(20, 200), shared_prefix_tokens=200),
    # Chats behind one system prompt; each next turn resends the conversation so far (the
    # prompts and the server's real answers) and a new user turn, as chat clients do.
    "multi-turn": Shape(Range(20, 100), Range(20, 100), shared_prefix_tokens=200, turns=4),
}


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    prompt_tokens: int | None = None  # as counted when the workload was built (None: unknown)
    # Later user turns of a conversation: each is sent after the previous answer, appended to
    # the conversation so far (prompt + answer), with the same max_tokens.
    followups: tuple[str, ...] = ()

    def next_turn(self, answer: str) -> BenchRequest | None:
        """The conversation's next request once `answer` came back (None after the last turn)."""
        if not self.followups:
            return None
        return BenchRequest(self.prompt + answer + self.followups[0], self.max_tokens, None,
                            self.followups[1:])


@dataclass(slots=True)
class Workload:
    name: str  # built-in generator name or the file path it came from
    seed: int
    requests: list[BenchRequest]
    token_counting: str = NOT_COUNTED
    notes: list[str] = field(default_factory=list)

    def window(self, start: int, count: int) -> list[BenchRequest]:
        """`count` requests from `start`, wrapping around (levels reuse prompts only if they must)."""
        n = len(self.requests)
        return [self.requests[(start + i) % n] for i in range(count)]

    def describe(self) -> dict:
        prompt = [r.prompt_tokens for r in self.requests if r.prompt_tokens is not None]
        output = [r.max_tokens for r in self.requests]
        return {
            "name": self.name, "seed": self.seed, "num_requests": len(self.requests),
            "token_counting": self.token_counting, "notes": list(self.notes),
            "prompt_tokens_min": min(prompt, default=None), "prompt_tokens_max": max(prompt, default=None),
            "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
            "max_tokens_min": min(output), "max_tokens_max": max(output),
            "max_tokens_mean": sum(output) / len(output),
        }


def parse_range(text: str, option: str) -> Range:
    """`N` or `LOW-HIGH`, positive integers; raises WorkloadError naming the option."""
    try:
        low, _, high = text.partition("-")
        r = Range(int(low), int(high or low))
    except ValueError:
        raise WorkloadError(f"{option} must be N or LOW-HIGH (positive integers), got {text!r}") from None
    if r.low < 1 or r.high < r.low:
        raise WorkloadError(f"{option} must be N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return r


@dataclass(frozen=True, slots=True)
class WorkloadPlan:
    """What to build: a built-in shape or a file, before any tokenizer is known."""

    source: str
    num_prompts: int
    seed: int = 0
    prompt_override: Range | None = None
    output_override: Range | None = None

    @property
    def is_file(self) -> bool:
        return self.source not in BUILTIN


def check_source(source: str) -> None:
    if source in BUILTIN:
        return
    path = Path(source)
    if not path.exists():
        raise WorkloadError(
            f"workload file {source} not found; pass an existing JSONL file or one of {', '.join(BUILTIN)}"
        )
    if not path.is_file():
        raise WorkloadError(f"workload {source} is not a file; pass a JSONL file with one request per line")


def load_jsonl(path: str | Path, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> list[BenchRequest]:
    """Read {"prompt": str, "max_tokens": int (optional)} per line; blank lines are skipped."""
    path = Path(path)
    check_source(str(path))
    fix = 'each line must be a JSON object like {"prompt": "Hello", "max_tokens": 64}'
    requests: list[BenchRequest] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: not UTF-8 text; {fix}") from None
    except OSError as err:
        raise WorkloadError(f"{path}: cannot read ({err.strerror}); check the path and permissions") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise WorkloadError(f"{where}: not valid JSON ({err.msg}); {fix}") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: a JSON {type(row).__name__}, not an object; {fix}")
        unknown = sorted(set(row) - ALLOWED_KEYS)
        if unknown:
            raise WorkloadError(
                f"{where}: unknown key {unknown[0]!r}; allowed keys are prompt, max_tokens, "
                "prompt_tokens, followups"
            )
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f'{where}: missing "prompt" (a non-empty string); {fix}')
        max_tokens = row.get("max_tokens", default_max_tokens)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise WorkloadError(
                f'{where}: "max_tokens" must be a positive integer, got {json.dumps(max_tokens)}; '
                "fix the value or omit the key"
            )
        prompt_tokens = row.get("prompt_tokens")
        if prompt_tokens is not None and (not isinstance(prompt_tokens, int) or prompt_tokens < 1):
            raise WorkloadError(f'{where}: "prompt_tokens" must be a positive integer or omitted')
        followups = row.get("followups", [])
        if not isinstance(followups, list) or not all(isinstance(t, str) and t for t in followups):
            raise WorkloadError(f'{where}: "followups" must be a list of non-empty strings (the '
                                "later user turns of a conversation) or omitted")
        requests.append(BenchRequest(prompt, max_tokens, prompt_tokens, tuple(followups)))
    if not requests:
        raise WorkloadError(f"{path}: no requests; {fix}")
    return requests


class WordCosts:
    """Tokens per vocabulary word, so a prompt can be built to an exact token length.

    A BPE tokenizer with a whitespace pre-tokenizer encodes each ` word` independently, so a
    prompt's length is the sum of its words' costs plus the special tokens (BOS); the built
    prompts are then counted again by the server, which is the number recorded.
    """

    def __init__(self, first: dict[str, int], later: dict[str, int], special: int) -> None:
        self.first, self.later, self.special = first, later, special

    @classmethod
    def approximate(cls) -> WordCosts:
        return cls({w: 1 for w in VOCABULARY}, {w: 1 for w in VOCABULARY}, 0)

    def build(self, rng: random.Random, target: int, leading: bool = False) -> tuple[str, int]:
        """Words totalling `target` tokens (+ special tokens unless `leading` continues a prompt)."""
        words: list[str] = []
        total = 0 if leading else self.special
        while total < target or not (words or leading):  # never an empty prompt
            table = self.later if words or leading else self.first
            word = VOCABULARY[rng.randrange(len(VOCABULARY))]
            if total + table[word] > target:  # near the end: a word that fits, else the cheapest
                fitting = [w for w in VOCABULARY if total + table[w] <= target]
                word = fitting[rng.randrange(len(fitting))] if fitting else min(VOCABULARY, key=table.get)
            words.append(word)
            total += table[word]
        text = " ".join(words)
        return (" " + text if leading and text else text), total


def generate(plan: WorkloadPlan, costs: WordCosts, max_model_len: int | None = None) -> Workload:
    """Build a built-in workload; lengths are clamped so prompt + output fits `max_model_len`."""
    shape = SHAPES[plan.source]
    rng = random.Random(plan.seed)
    notes: list[str] = []
    prefix, prefix_tokens = "", 0
    if shape.shared_prefix_tokens:
        prefix, prefix_tokens = costs.build(random.Random(plan.seed ^ 0x5EED), shape.shared_prefix_tokens)
    clamped = 0
    requests = []
    for _ in range(plan.num_prompts):
        long = shape.long_fraction and rng.random() < shape.long_fraction
        prompt_range = plan.prompt_override or (shape.long_prompt if long else shape.prompt)
        output_range = plan.output_override or (shape.long_output if long else shape.output)
        prompt_len, output_len = prompt_range.draw(rng), output_range.draw(rng)
        if shape.turns > 1 and max_model_len is not None:
            # The whole conversation must fit: each turn gets an equal share of the context.
            share = max(2, (max_model_len - prefix_tokens - 1) // shape.turns)
            if prompt_len + output_len > share:
                output_len = max(1, min(output_len, share // 4))
                prompt_len = max(1, share - output_len)
                clamped += 1
        elif max_model_len is not None and prefix_tokens + prompt_len + output_len >= max_model_len:
            # Too long for this server: keep the output, within a quarter of the context, and
            # shorten the prompt; counted in the notes so that nobody mistakes it for the shape.
            output_len = min(output_len, max(1, max_model_len // 4))
            prompt_len = max(1, min(prompt_len, max_model_len - output_len - prefix_tokens - 1))
            clamped += 1
        if prefix:
            body, n = costs.build(rng, prompt_len, leading=True)
            text, counted = prefix + body, prefix_tokens + n
        else:
            text, counted = costs.build(rng, prompt_len)
        followups = tuple(costs.build(rng, prompt_len, leading=True)[0] for _ in range(shape.turns - 1))
        requests.append(BenchRequest(text, output_len, counted, followups))
    if clamped:
        notes.append(f"{clamped} prompts shortened to fit the server's max_model_len={max_model_len}")
    if prefix:
        notes.append(f"shared system prompt of {prefix_tokens} tokens")
    if shape.turns > 1:
        notes.append(f"each request is a conversation of {shape.turns} turns, each resending the "
                     "conversation so far with the server's answer")
    return Workload(plan.source, plan.seed, requests, APPROXIMATE, notes)


def from_file(plan: WorkloadPlan, default_max_tokens: int) -> Workload:
    """The file's requests as written; `default_max_tokens` fills lines without "max_tokens"."""
    return Workload(plan.source, plan.seed, load_jsonl(plan.source, default_max_tokens), NOT_COUNTED)


def write_jsonl(workload: Workload, path: Path) -> None:
    """The exact requests sent, loadable again with `--workload` (written via a temporary file)."""
    with atomic_output(path) as f:
        for r in workload.requests:
            row: dict = {"prompt": r.prompt, "max_tokens": r.max_tokens}
            if r.prompt_tokens is not None:
                row["prompt_tokens"] = r.prompt_tokens
            if r.followups:
                row["followups"] = list(r.followups)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
