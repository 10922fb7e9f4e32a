"""The probe contract: what a check receives (`ProbeContext`) and what it returns (`ProbeResult`).

Layer: probes (between the scrape/GPU collectors and the `doctor` command, which only renders).
A probe is a module with `async def run(ctx: ProbeContext) -> ProbeResult`, made of three steps
of the same shape in every probe and chained by `run_steps`:
  `gather(ctx) -> Readings`  all the I/O: readings, load, samples; the figures as `evidence`.
                             It raises `Unmeasured` when there is nothing to judge (an error,
                             or a skip such as "Proxima not loaded");
  `judge(readings) -> Verdict`  pure: the status and the summary line, and the `findings`
                             that decided (plus any figure the judging itself derived);
  `advise(readings, verdict)`  pure: what to do about those findings, one line per step.
Invariants:
  - server metrics come only from `proxima.scrape` snapshots, over time through
    `ctx.sampler()` (`proxima.sampling`); GPU readings only from `proxima.gpu.read_gpus()`, and
    taken as the server's only when it runs on this host (`ctx.server_here`);
  - traffic goes only to `ctx.url` and `ctx.compare_url`, through `ctx.load`, and every load a
    probe starts is cancelled before `run` returns;
  - a server's condition is a verdict, never an exception: `run` raises only on a bug, and the
    runner turns that into status "error".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

import httpx

from proxima import fmt
from proxima.sampling import Sampler

if TYPE_CHECKING:
    from proxima.load import LoadDriver
    from proxima.scrape import ServerSnapshot

Evidence = dict[str, float | int | str | None]

# The scrape layer's default total budget (5 s) suits `top`'s refreshes; the doctor samples a
# server it is loading itself, whose /metrics can take seconds to answer on shared CPU cores,
# and a phase with too few readings is an error, so its samples get more time.
SAMPLE_TIMEOUT_S = 20.0


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    check: str
    status: Status
    summary: str
    evidence: Evidence = field(default_factory=dict)
    runbook: str | None = None
    advice: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "check": self.check,
            "status": self.status.value,
            "summary": self.summary,
            "evidence": dict(self.evidence),
            "runbook": self.runbook,
            "advice": list(self.advice),
        }

    @classmethod
    def from_dict(cls, data: dict) -> ProbeResult:
        return cls(data["check"], Status(data["status"]), data["summary"], dict(data.get("evidence") or {}),
                   data.get("runbook"), tuple(data.get("advice") or ()))


class Unmeasured(Exception):
    """Raised by a probe's `gather` when there is nothing to judge; becomes its result as is."""

    def __init__(self, status: Status, summary: str, evidence: Evidence | None = None,
                 runbook: str | None = None) -> None:
        super().__init__(summary)
        self.status, self.summary, self.evidence, self.runbook = status, summary, evidence or {}, runbook


@dataclass(frozen=True, slots=True)
class Verdict:
    """What `judge` decided; `findings` name the rules that fired, for `advise`."""

    status: Status
    summary: str
    findings: tuple[str, ...] = ()  # the rules that fired, in the order they were checked
    runbook: str | None = None  # when not the check's own
    evidence: Evidence = field(default_factory=dict)  # figures the judging derived, after the readings'


def advice_for(findings: Sequence[str], advice: dict[str, Sequence[str]]) -> tuple[str, ...]:
    """The advice lines of each finding, in the findings' order (a finding without advice has none)."""
    return tuple(line for finding in findings for line in advice.get(finding, ()))


def table_advice(advice: dict[str, Sequence[str]]) -> Callable[[object, Verdict], tuple[str, ...]]:
    """The advise step of a probe whose advice depends on its findings alone: a table lookup."""
    def advise(readings: object, verdict: Verdict) -> tuple[str, ...]:
        return advice_for(verdict.findings, advice)
    return advise


class Readings(Protocol):
    evidence: Evidence


R = TypeVar("R", bound=Readings)


async def run_steps(check: str, runbook: str, ctx: ProbeContext,
                    gather: Callable[[ProbeContext], Awaitable[R]], judge: Callable[[R], Verdict],
                    advise: Callable[[R, Verdict], Sequence[str]]) -> ProbeResult:
    """gather -> judge -> advise, as one `ProbeResult` (an `Unmeasured` one when gather says so)."""
    try:
        readings = await gather(ctx)
    except Unmeasured as nothing:
        return ProbeResult(check, nothing.status, nothing.summary, nothing.evidence,
                           nothing.runbook or runbook)
    verdict = judge(readings)
    return ProbeResult(check, verdict.status, verdict.summary, {**readings.evidence, **verdict.evidence},
                       verdict.runbook or runbook, tuple(advise(readings, verdict)))


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What the operator may tell the doctor that the server does not expose."""

    window_s: float = 10.0
    compare_url: str | None = None
    typical_tokens: int | None = None  # prompt + generation tokens of a typical request
    max_num_seqs: int | None = None  # not in /metrics: vLLM does not export its scheduler config
    api_key: str | None = field(default=None, repr=False)  # sent with every request; never reported


@dataclass(slots=True)
class ProbeContext:
    url: str
    client: httpx.AsyncClient
    options: DoctorOptions
    load: LoadDriver
    # The server as the doctor found it, before any probe sent traffic: the user's own history.
    baseline: ServerSnapshot | None = None
    model: str | None = None
    max_model_len: int | None = None
    server_error: str | None = None  # set when the server could not be reached at all
    server_pid: int | None = None  # local process listening on the URL's port, when there is one
    server_here: bool = False  # the server runs on this host: its GPUs and memory can be read

    def sampler(self, interval_s: float | None = None, t0: float | None = None) -> Sampler:
        """A sampler of this server on the doctor's client, with the doctor's scrape budget."""
        return Sampler(self.url, interval_s or self.sample_interval_s, client=self.client,
                       timeout_s=SAMPLE_TIMEOUT_S, here=self.server_here, pid=self.server_pid, t0=t0)

    @property
    def window_s(self) -> float:
        return self.options.window_s

    @property
    def compare_url(self) -> str | None:
        return self.options.compare_url

    @property
    def sample_interval_s(self) -> float:
        # ~20 samples per window, but at most 4 scrapes a second: a scrape costs the server ~30 ms.
        return min(2.0, max(0.25, self.window_s / 20))


# The probes' missing figures are readings that could not be taken: `fmt.NA`, in the one formatter.
fmt_bytes = partial(fmt.size, missing=fmt.NA)
pct = partial(fmt.pct, missing=fmt.NA)
