"""Run the doctor's checks against one server: discover it, run each probe in turn, collect results.

Layer: probes (orchestration). Probes run one after another, never together, because each one's
load would distort the others' readings. A probe that raises or overruns its time budget becomes
status "error"; an unreachable server makes every check "error" without sending any traffic.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from proxima.fetch import auth_headers, client_limits, describe_http_error, first_model, get_json
from proxima.hosts import find_server_pid, is_this_host
from proxima.load import LoadDriver
from proxima.probes.base import SAMPLE_TIMEOUT_S, DoctorOptions, ProbeContext, ProbeResult, Status
from proxima.scrape import scrape

logger = logging.getLogger(__name__)

# Order matters: the passive checks first, then those that drive load, heaviest last but one.
CHECKS: tuple[str, ...] = (
    "environment", "allocator", "oom_risk", "leak", "determinism", "bottleneck", "adoption",
)
DESCRIPTIONS = {
    "environment": "versions, GPU, plugin loaded, server configuration",
    "allocator": "Proxima's slot accounting and allocator latency (Proxima only)",
    "oom_risk": "KV headroom for the admitted concurrency; where preemptions start",
    "leak": "slots held with no request running; memory trend",
    "determinism": "temperature 0: same tokens alone, under load, and against --compare",
    "bottleneck": "memory-bound or compute-bound under load; what Proxima can gain",
    "adoption": "fragmentation of this traffic; capacity Proxima would add",
}


def parse_checks(text: str | None) -> tuple[str, ...]:
    """`a,b` -> ("a", "b") in the doctor's order; raises ValueError naming the valid checks."""
    if not text:
        return CHECKS
    asked = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in asked if name not in CHECKS]
    if unknown or not asked:
        raise ValueError(f"unknown check {', '.join(unknown) or repr(text)}; "
                         f"valid checks: {', '.join(CHECKS)}")
    return tuple(name for name in CHECKS if name in asked)


def probe_budget_s(window_s: float) -> float:
    """The most a probe may take before it is stopped and reported as "error"."""
    return 120.0 + 8 * window_s


@dataclass(frozen=True, slots=True)
class DoctorReport:
    url: str
    model: str | None
    compare_url: str | None
    window_s: float
    results: tuple[ProbeResult, ...]
    server_error: str | None = None

    @property
    def exit_code(self) -> int:
        return exit_code(self.results)

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "model": self.model,
            "compare_url": self.compare_url,
            "window_s": self.window_s,
            "server_error": self.server_error,
            "exit_code": self.exit_code,
            "checks": [r.to_dict() for r in self.results],
        }


def exit_code(results: Sequence[ProbeResult]) -> int:
    """0 all ok (skips included), 1 warnings, 2 failures, 3 could not run.

    A failure outranks an error: a diagnosed fault is the more useful thing to act on, even when
    another check could not run.
    """
    statuses = {r.status for r in results}
    if Status.FAIL in statuses:
        return 2
    if Status.ERROR in statuses:
        return 3
    if Status.WARN in statuses:
        return 1
    return 0


# /v1/models in all, however the server answers (a trickled or endless answer ends here).
DISCOVER_TIMEOUT_S = 10.0


async def discover(client: httpx.AsyncClient, url: str) -> tuple[str | None, int | None, str | None]:
    """(model name, max_model_len, error) from the server's /v1/models; the error is one line
    naming the server and what is wrong."""
    url = url.rstrip("/")
    try:
        model = first_model(await get_json(client, url + "/v1/models", DISCOVER_TIMEOUT_S))
    except (httpx.ConnectError, httpx.ConnectTimeout) as err:
        return None, None, f"cannot reach {url}: {describe_http_error(err)}; start the server or pass its URL"
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
        reason = describe_http_error(err)
        if "OpenAI" not in reason and "API key" not in reason and "lists no model" not in reason:
            reason += "; is this an OpenAI-compatible server?"
        return None, None, f"{url}/v1/models: {reason}"
    return model.id, model.max_model_len, None


async def open_context(client: httpx.AsyncClient, url: str, options: DoctorOptions) -> ProbeContext:
    model, max_model_len, error = await discover(client, url)
    ctx = ProbeContext(url=url.rstrip("/"), client=client, options=options,
                       load=LoadDriver(client, url, model), model=model, max_model_len=max_model_len,
                       server_error=error)
    if error is None:
        # Every check but determinism judges /metrics: a page that cannot be read (or is no vLLM
        # server's) ends the doctor here, in one line, rather than in checks "measured" on nothing.
        ctx.baseline = await scrape(client, ctx.url, SAMPLE_TIMEOUT_S)
        if not ctx.baseline.ok:
            ctx.server_error = f"{ctx.url}/metrics is unusable: {ctx.baseline.error}"
            return ctx
        ctx.server_here = is_this_host(ctx.url)
        ctx.server_pid = find_server_pid(ctx.url)
    return ctx


async def run_probe(name: str, ctx: ProbeContext) -> ProbeResult:
    module = importlib.import_module(f"proxima.probes.{name}")
    budget = probe_budget_s(ctx.window_s)
    try:
        # asyncio.timeout, not asyncio.wait_for: on Python 3.11 wait_for returns the result, and
        # drops the cancel, when Ctrl-C lands as the probe finishes; the doctor would go on.
        async with asyncio.timeout(budget):
            return await module.run(ctx)
    except TimeoutError:
        return ProbeResult(name, Status.ERROR, f"did not finish within {budget:.0f} s; its load was stopped")
    except Exception as err:  # a probe's bug must not hide the other checks' verdicts
        logger.debug("probe %s raised", name, exc_info=True)
        return ProbeResult(name, Status.ERROR, f"probe failed: {type(err).__name__}: {err}")


async def run_doctor(
    url: str,
    checks: Sequence[str] = CHECKS,
    options: DoctorOptions | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> DoctorReport:
    options = options or DoctorOptions()
    limits = client_limits(max_connections=256, max_keepalive_connections=64)
    headers = auth_headers(options.api_key)
    async with httpx.AsyncClient(limits=limits, timeout=30.0, headers=headers) as client:
        ctx = await open_context(client, url, options)
        results: list[ProbeResult] = []
        for i, name in enumerate(checks):
            if ctx.server_error is not None:
                results.append(ProbeResult(name, Status.ERROR, ctx.server_error))
                continue
            if on_progress is not None:
                on_progress(name, i, len(checks))
            results.append(await run_probe(name, ctx))
    return DoctorReport(ctx.url, ctx.model, options.compare_url, options.window_s, tuple(results),
                        ctx.server_error)
