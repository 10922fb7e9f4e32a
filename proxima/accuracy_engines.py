"""The accuracy benchmark's engines: which configurations run, how each is built, and what one
engine measures in its process (scripts/bench_kv_accuracy.py drives them; accuracy_report.py
turns their raw data into figures).

Layer: tools, beside `proxima.accuracy` (the formulas, pure) and the engine harness (the one door
to in-process engines). vLLM is imported only inside `measure`, which runs in a child process of
its own (`proxima.harness.run_isolated`): one engine per process, so that no run warms, fragments
or shares an attention registry with another. Why in the package and not in the script: the
unit tests build the engine specs, the CI engine test runs a quick pass, and the harness's child
imports `measure` by module name; a script-local copy would be a second place to keep in step.

Configurations (`CONFIGS`): Proxima (token slots, its attention: the CPU torch path, CUSTOM on
CUDA with the FULL CUDA graphs `proxima serve` chooses) at every KV dtype it serves, and stock
vLLM wherever stock serves the mode: `auto` and `fp8` everywhere (block 32 on CPU, vLLM's CPU
attention needs multiples of 32; vLLM's default block and backend on CUDA), the per-token-head
modes only on CUDA (vLLM's TRITON_ATTN; its CPU backend refuses them). Each engine kind's
reference is its own `auto` (the model dtype's KV), and Proxima is also compared with stock auto.

Invariant that keeps comparisons fair: every engine gets the same flags except the KV dtype (and
stock's block size and backend), and a KV budget in bytes large enough that the workload never
waits for KV in any dtype, so every engine runs the same sequence of scheduler steps (the same
batches, hence the same rounding in the model's GEMMs); what differs is what the cache returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import numpy as np

from proxima.engine.compat import PER_TOKEN_HEAD_KV_CACHE_DTYPES as PER_TOKEN_HEAD
from proxima.harness import EngineSpec, open_engine, vllm_flags

logger = logging.getLogger(__name__)

AUTO = "auto"
PROXIMA_DTYPES = (AUTO, "fp8", *PER_TOKEN_HEAD)
STOCK_CPU_BLOCK_SIZE = 32  # vLLM's CPU attention serves blocks of a multiple of 32
STOCK_PER_TOKEN_HEAD_BACKEND = "TRITON_ATTN"  # the one vLLM 0.26 backend that reads these caches


@dataclass(frozen=True, slots=True)
class AccuracyConfig:
    """One engine configuration: Proxima or stock vLLM at one KV dtype."""

    engine: str  # "proxima" | "stock"
    kv_cache_dtype: str
    cuda_only: bool = False

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.kv_cache_dtype}"

    @property
    def reference(self) -> str:
        """The configuration this one is measured against: the same engine with the model's KV."""
        return f"{self.engine}-{AUTO}"


CONFIGS: tuple[AccuracyConfig, ...] = (
    *(AccuracyConfig("proxima", dtype) for dtype in PROXIMA_DTYPES),
    AccuracyConfig("stock", AUTO),
    AccuracyConfig("stock", "fp8"),
    *(AccuracyConfig("stock", dtype, cuda_only=True) for dtype in PER_TOKEN_HEAD),
)
CONFIGS_BY_NAME = {c.name: c for c in CONFIGS}


@dataclass(frozen=True, slots=True)
class RunParams:
    """What every engine of one run is given: the model, its dtype, the inputs' sizes, the
    engine's step and KV budgets. One object, pickled to each engine's process."""

    model: str
    model_dtype: str = "bfloat16"
    num_passages: int = 24
    passage_chars: int = 2000
    num_chats: int = 120
    max_new_tokens: int = 64
    # vLLM reports the top `top_logprobs` tokens a position (and the actual one); the mass left
    # outside both engines' lists is merged into one bucket, so KL is a lower bound (accuracy.py).
    top_logprobs: int = 200
    max_model_len: int = 4096
    max_num_batched_tokens: int = 512  # vLLM's CPU warm-up runs one step of this size
    max_num_seqs: int = 128  # every chat of the fixed set decodes in one batch
    # Far above what the workload holds at once in the model's dtype (bf16: 23,040 bytes a token,
    # 46,603 tokens; the 120 chats hold ~15k), so no dtype changes the schedule (module docstring).
    kv_cache_memory_bytes: int = 1 << 30
    cuda: bool = False

    def __post_init__(self) -> None:
        if min(self.num_passages, self.passage_chars, self.num_chats, self.max_new_tokens) < 1:
            raise ValueError("passages, passage size, chats and new tokens must all be positive")
        if self.top_logprobs < 1:
            raise ValueError("top_logprobs must be at least 1 (the full vocabulary is too heavy to carry)")


def configurations(cuda: bool, names: list[str] | None = None) -> list[AccuracyConfig]:
    """The configurations to run: all that this device serves, or `names` (with their references
    added, references first, so each comparison has what it needs)."""
    available = [c for c in CONFIGS if cuda or not c.cuda_only]
    if names is None:
        return available
    unknown = [n for n in names if n not in CONFIGS_BY_NAME]
    if unknown:
        raise ValueError(f"unknown configuration {', '.join(unknown)}; choose from "
                         f"{', '.join(c.name for c in available)}")
    refused = [n for n in names if CONFIGS_BY_NAME[n] not in available]
    if refused:
        raise ValueError(f"{', '.join(refused)}: stock vLLM serves per-token-head KV only on CUDA "
                         f"(TRITON_ATTN); its CPU backend refuses it")
    wanted = {CONFIGS_BY_NAME[n] for n in names}
    wanted |= {CONFIGS_BY_NAME[c.reference] for c in wanted}
    return [c for c in available if c in wanted]


def engine_spec(config: AccuracyConfig, params: RunParams) -> EngineSpec:
    """The engine of `config` as `proxima serve` (Proxima) or plain vLLM (stock) would run it.

    CPU: eager (start-up in minutes, not tens of minutes, on this project's CI). CUDA: vLLM's
    graphs; Proxima's CUSTOM backend and FULL graphs come from `proxima serve`'s own command
    builder (proxima.serve_command), so nothing here restates them."""
    stock = config.engine == "stock"
    backend = (STOCK_PER_TOKEN_HEAD_BACKEND if stock and params.cuda
               and config.kv_cache_dtype in PER_TOKEN_HEAD else None)
    flags = vllm_flags(
        dtype=params.model_dtype, max_model_len=params.max_model_len, seed=0,
        max_logprobs=params.top_logprobs, max_num_batched_tokens=params.max_num_batched_tokens,
        max_num_seqs=params.max_num_seqs, kv_cache_memory_bytes=params.kv_cache_memory_bytes,
        kv_cache_dtype=config.kv_cache_dtype, enforce_eager=None if params.cuda else True,
        block_size=STOCK_CPU_BLOCK_SIZE if stock and not params.cuda else None,
        attention_backend=backend)
    # Stock runs unobserved (record=False): nothing of Proxima's is loaded into it.
    return EngineSpec(params.model, "stock" if stock else "token", flags, record=not stock)


@dataclass(frozen=True, slots=True)
class ScoredPassage:
    """One passage, teacher-forced: its prompt token ids and, for positions 1..n-1, the reported
    (token id, logprob) pairs, flattened (`offsets[i]` starts position i+1's entries). numpy
    arrays, not dicts of Logprob objects: a run carries ~10^6 pairs from the engine's process."""

    prompt_token_ids: np.ndarray  # int64 [n]
    token_ids: np.ndarray  # int64 [sum of entries]
    logprobs: np.ndarray  # float32 [sum of entries], vLLM's float32 values, unchanged
    offsets: np.ndarray  # int64 [n]: entries of position i+1 are [offsets[i], offsets[i+1])

    def positions(self) -> list[dict[int, float] | None]:
        """vLLM's `prompt_logprobs` shape again: None for position 0, then {token id: logprob}."""
        out: list[dict[int, float] | None] = [None]
        for start, end in zip(self.offsets[:-1], self.offsets[1:]):
            out.append(dict(zip(self.token_ids[start:end].tolist(), self.logprobs[start:end].tolist())))
        return out


@dataclass(frozen=True, slots=True)
class EngineMeasurement:
    """Everything one engine reported, as plain data (pickled back from its process)."""

    config: AccuracyConfig
    passages: list[ScoredPassage]
    answers: list[list[int]]  # greedy token ids, one list per chat
    answer_texts: list[str]  # the same, detokenised (the JSON record keeps these)
    bytes_per_token: float | None  # KV bytes a token, scales included, as the engine sized its cache
    preemptions: int | None  # Proxima's recorder; None for stock (unobserved)
    start_s: float
    score_s: float
    chat_s: float

    def timings(self) -> dict[str, float]:
        return {"start_s": self.start_s, "score_s": self.score_s, "chat_s": self.chat_s}

    def describe(self) -> dict:
        return {**asdict(self.config), "name": self.config.name, "bytes_per_token": self.bytes_per_token,
                "preemptions": self.preemptions, **self.timings()}


def measure(config: AccuracyConfig, params: RunParams) -> EngineMeasurement:
    """Run in an engine's own process: score the passages teacher-forced, then answer the chats
    greedily. The inputs are the fixed ones (accuracy_corpus, chat_prompts), cut by `params`."""
    from vllm import SamplingParams

    from proxima.accuracy_corpus import passages
    from proxima.chat_prompts import accuracy_chats

    texts = passages(params.num_passages, params.passage_chars)
    chats = accuracy_chats()[:params.num_chats]
    began = time.monotonic()
    with open_engine(engine_spec(config, params)) as engine:
        opened = time.monotonic()
        # max_tokens=1: the passage itself is the measurement; vLLM computes prompt logprobs
        # without reading the prefix cache, so every passage's KV is its own.
        scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=params.top_logprobs)
        scored = [_scored(r) for r in engine.llm.generate(texts, scoring, use_tqdm=False)]
        scored_at = time.monotonic()
        greedy = SamplingParams(max_tokens=params.max_new_tokens, temperature=0)
        completions = [r.outputs[0] for r in engine.llm.chat(chats, greedy, use_tqdm=False)]
        done = time.monotonic()
        preemptions = engine.recorder.preemptions if engine.recorder is not None else None
        return EngineMeasurement(config=config, passages=scored,
                                 answers=[list(c.token_ids) for c in completions],
                                 answer_texts=[c.text for c in completions],
                                 bytes_per_token=_bytes_per_token(engine), preemptions=preemptions,
                                 start_s=opened - began, score_s=scored_at - opened, chat_s=done - scored_at)


def _scored(result) -> ScoredPassage:
    ids: list[int] = []
    logprobs: list[float] = []
    offsets = [0]
    for entry in result.prompt_logprobs[1:]:
        for token_id, logprob in entry.items():
            ids.append(token_id)
            logprobs.append(logprob.logprob)
        offsets.append(len(ids))
    return ScoredPassage(np.asarray(result.prompt_token_ids, dtype=np.int64), np.asarray(ids, dtype=np.int64),
                         np.asarray(logprobs, dtype=np.float32), np.asarray(offsets, dtype=np.int64))


def _bytes_per_token(engine) -> float | None:
    """KV bytes a token over every layer, from the cache vLLM sized (scales and padding included)."""
    try:
        groups = engine.scheduler.kv_cache_config.kv_cache_groups
        return float(sum(g.kv_cache_spec.page_size_bytes / g.kv_cache_spec.block_size * len(g.layer_names)
                         for g in groups))
    except AttributeError as err:  # another vLLM's layout: the figure informs, the run goes on
        logger.warning("KV bytes per token unknown (%s)", err)
        return None
