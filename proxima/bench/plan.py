"""What one `proxima bench` run will do, checked whole before anything is sent, launched or written.

`BenchOptions` is what the user typed (the CLI's options, as given); `BenchPlan.from_options`
turns it into a `BenchPlan` or raises `PlanError` whose message is one line naming the option
and the fix: servers given by URL or launched (`LaunchPlan`), load levels, sweep parameters and
the workload (a workload file is read and validated here, so a bad line costs nothing else).
Light to import (the CLI's help text reads its defaults): the sweep and HTTP layers load on use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from proxima.bench import workload as wl

if TYPE_CHECKING:
    from proxima.bench.sweep import SweepParams

DEFAULT_CONCURRENCY = "4,8,16,32,64,128"
DEFAULT_REQUESTS_PER_LEVEL = 100


class PlanError(ValueError):
    """A user's mistake in the options; the message is one line naming the option and the fix."""


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Servers `proxima bench --launch` starts: same model and flags, allocators differ."""

    model: str
    variants: tuple[str, ...]
    labels: tuple[str, ...]
    vllm_args: tuple[str, ...] = ()
    side_by_side: bool = False
    log_dir: Path = Path(".")
    startup_timeout_s: float = 600.0


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """The options of `proxima bench` as given (None: not given); names are the CLI's."""

    vllm_args: tuple[str, ...] | list[str] | None = None
    url: str | None = None
    a: str | None = None
    b: str | None = None
    label_a: str | None = None
    label_b: str | None = None
    launch: str | None = None
    variants: str = "block,token"
    side_by_side: bool = False
    interleave: bool = True
    workload: str = "short-chat"
    num_prompts: int | None = None
    prompt_tokens: str | None = None
    max_tokens: str | None = None
    seed: int = 0
    concurrency: str | None = None
    rate: str | None = None
    requests: int | None = None
    duration: float | None = None
    slo_p95: float = 2.0
    max_error_rate: float = 0.10
    avalanche_factor: float = 3.0
    timeout: float = 120.0
    sample_interval: float = 0.5
    client_workers: int | None = None
    repeat: int = 1
    check_answers: bool = False
    warmup: int = 8
    out: Path | None = None
    log_dir: Path | None = None
    api_key: str | None = field(default=None, repr=False)


@dataclass(slots=True)
class BenchPlan:
    workload: wl.WorkloadPlan
    levels: list[tuple[str, float]]
    params: SweepParams
    urls: list[str] = field(default_factory=list)  # given servers ...
    labels: list[str | None] = field(default_factory=list)
    launch: LaunchPlan | None = None  # ... or servers to launch
    default_max_tokens: int = wl.DEFAULT_MAX_TOKENS
    command: str = ""
    interleave: bool = True  # servers up together take turns level by level
    check_answers: bool = False  # greedy answers from every server before its sweep (bench/answers.py)
    warmup: int = 0  # unmeasured requests to every server before its first level

    @classmethod
    def from_options(cls, o: BenchOptions, command: str = "") -> BenchPlan:
        """The checked plan; PlanError on the first mistake, in the order the checks read."""
        from proxima.bench.sweep import SweepParams, levels_to_run
        from proxima.fetch import normalize_url

        _check_servers(o)
        _check_numbers(o)
        levels = levels_to_run(_ints(o.concurrency, "--concurrency") if o.concurrency else [],
                               _floats(o.rate, "--rate") if o.rate else [])
        if not levels:
            levels = levels_to_run(_ints(DEFAULT_CONCURRENCY, "--concurrency"), [])
        per_level = o.requests if o.requests is not None else \
            (None if o.duration else DEFAULT_REQUESTS_PER_LEVEL)
        try:
            workload, default_max = _workload(o, per_level, len(levels) * o.repeat)
        except wl.WorkloadError as err:
            raise PlanError(str(err)) from None
        from proxima.fetch import api_key_from

        params = SweepParams(per_level, o.duration, o.slo_p95, o.max_error_rate, o.avalanche_factor,
                             request_timeout_s=o.timeout, sample_interval_s=o.sample_interval, seed=o.seed,
                             client_workers=o.client_workers, repeat=o.repeat,
                             api_key=api_key_from(o.api_key))
        if o.launch:
            return cls(workload, levels, params, launch=_launch_plan(o), default_max_tokens=default_max,
                       command=command, interleave=o.interleave, check_answers=o.check_answers,
                       warmup=o.warmup)
        try:
            urls = [normalize_url(u) for u in ([o.url] if o.url else [o.a, o.b])]
        except ValueError as err:
            raise PlanError(str(err)) from None
        labels = [None] if o.url else [o.label_a, o.label_b]
        return cls(workload, levels, params, urls, labels, None, default_max, command, o.interleave,
                   o.check_answers, o.warmup)


def _check_servers(o: BenchOptions) -> None:
    given = [x for x in (o.url, o.a, o.b) if x]
    if o.launch and given:
        raise PlanError("use either --launch MODEL or server URLs (--url, or --a and --b), not both")
    if o.url and (o.a or o.b):
        raise PlanError("use --url for one server, or --a URL --b URL for an A/B, not both")
    if bool(o.a) != bool(o.b):
        raise PlanError("an A/B needs both --a URL and --b URL (or use --url for one server)")
    if not o.launch and not given:
        raise PlanError("say which server to load: --url URL, --a URL --b URL, or --launch MODEL")
    if o.vllm_args and not o.launch:
        raise PlanError(f"unexpected argument {o.vllm_args[0]!r}: vLLM flags after `--` are only used "
                        "with --launch")
    if (o.label_a or o.label_b) and o.url:
        raise PlanError("--label-a/--label-b name the servers of an A/B; with --url there is one server")
    if o.out is not None:
        problem = unwritable(o.out)
        if problem:
            raise PlanError(f"--out {o.out}: {problem}; choose a writable directory")


def _check_numbers(o: BenchOptions) -> None:
    if o.requests is not None and o.requests < 1:
        raise PlanError("--requests must be at least 1")
    if o.duration is not None and o.duration <= 0:
        raise PlanError("--duration must be a positive number of seconds")
    if o.slo_p95 <= 0 or o.timeout <= 0 or o.avalanche_factor <= 0:
        raise PlanError("--slo-p95, --timeout and --avalanche-factor must be positive")
    if o.sample_interval < 0:
        raise PlanError("--sample-interval is seconds between metrics samples (0 turns sampling off)")
    if o.warmup < 0:
        raise PlanError("--warmup is how many unmeasured requests each server gets first: 0 or more")
    if o.repeat < 1:
        raise PlanError("--repeat is how many times each level runs: at least 1 (2 or more for intervals)")
    if o.client_workers is not None and o.client_workers < 1:
        raise PlanError("--client-workers must be at least 1 (1: no worker processes; default: by level)")
    if not 0 <= o.max_error_rate < 1:
        raise PlanError("--max-error-rate is a fraction in [0, 1), e.g. 0.1 for 10%")


def _workload(o: BenchOptions, per_level: int | None, num_runs: int) -> tuple[wl.WorkloadPlan, int]:
    """The workload plan and the default max_tokens of a file's lines; a file is validated now."""
    prompt_range = wl.parse_range(o.prompt_tokens, "--prompt-tokens") if o.prompt_tokens else None
    output_range = wl.parse_range(o.max_tokens, "--max-tokens") if o.max_tokens else None
    default_max = wl.DEFAULT_MAX_TOKENS
    if o.workload not in wl.BUILTIN:
        if prompt_range is not None:
            raise PlanError("--prompt-tokens applies to built-in workloads; a file's prompts are used as "
                            "written")
        if output_range is not None:
            if output_range.low != output_range.high:
                raise PlanError("with a workload file, --max-tokens takes one number "
                                "(the default for lines without one)")
            default_max = output_range.low
        output_range = None
        wl.load_jsonl(o.workload, default_max)  # nothing is launched or written on a bad file
    if o.num_prompts is not None and o.num_prompts < 1:
        raise PlanError("--num-prompts must be at least 1")
    prompts = o.num_prompts or (per_level * num_runs if per_level else 1000)
    return wl.WorkloadPlan(o.workload, prompts, o.seed, prompt_range, output_range), default_max


def _launch_plan(o: BenchOptions) -> LaunchPlan:
    chosen = parse_variants(o.variants)
    names = [n or v for n, v in zip([o.label_a, o.label_b][: len(chosen)], chosen)]
    if len(set(names)) != len(names):
        raise PlanError("the two servers need different labels; pass --label-a and --label-b")
    from proxima.serve_checks import kv_dtype_problem

    for variant in chosen:  # before a server starts: stock's would fail a minute in, in its log
        problem = kv_dtype_problem(o.vllm_args or (), variant)
        if problem:
            raise PlanError(f"--variants {o.variants}: {problem}")
    logs = o.log_dir or (o.out / "logs" if o.out else Path.cwd() / "proxima-bench-logs")
    return LaunchPlan(o.launch or "", chosen, tuple(names), tuple(o.vllm_args or ()), o.side_by_side, logs)


def parse_variants(text: str) -> tuple[str, ...]:
    from proxima.server_process import VARIANTS

    variants = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not 1 <= len(variants) <= 2:
        raise PlanError(
            f"--variants takes one or two of {', '.join(VARIANTS)} separated by a comma (e.g. block,token); "
            f"got {text!r}"
        )
    return variants


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise PlanError(f"{option} takes comma-separated positive integers, e.g. 4,8,16; got {text!r}")
    return sorted(set(values))


def _floats(text: str, option: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise PlanError(f"{option} takes comma-separated positive numbers (requests/s), e.g. 2,4,8; "
                        f"got {text!r}")
    return sorted(set(values))


def unwritable(out: Path) -> str | None:
    """Why `out` could not be written at the end, judged now (nothing is created before a run)."""
    if out.exists():
        if not out.is_dir():
            return "exists and is not a directory"
        return None if os.access(out, os.W_OK | os.X_OK) else "is not writable"
    parent = out.parent
    while not parent.exists():  # the nearest existing ancestor is where mkdir will start
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, so no directory can be made there"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable"
