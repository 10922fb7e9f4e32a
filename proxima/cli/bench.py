"""`proxima bench`: A/B load test of two servers (or one), given by URL or launched here.

Parses options into a checked `BenchPlan` (`proxima.bench.plan`), runs it (`proxima.bench.runner`)
under a progress bar, then prints the table and verdict and writes `--out`. A user's mistake ends
in one line and exit 2 before anything is sent or written.
"""

from __future__ import annotations

from pathlib import Path

import typer

from proxima.bench.plan import DEFAULT_CONCURRENCY
from proxima.cli.errors import fail


def _command(ctx: typer.Context, given: dict) -> str:
    """The invocation, rebuilt from the parsed options (for the record in results.json)."""
    import shlex

    parts = ["proxima", "bench"]
    extra: list[str] = []
    for param in ctx.command.params:
        value = given.get(param.name)
        if param.name == "vllm_args":
            extra = list(value or [])
        elif param.name == "api_key" and value:
            parts += [param.opts[0], "KEY"]  # a secret: never written to results.json
        elif value not in (None, False) and value != param.default and param.opts:
            parts += [param.opts[0]] if value is True else [param.opts[0], str(value)]
    return shlex.join(parts + (["--", *extra] if extra else []))


def bench(
    ctx: typer.Context,
    vllm_args: list[str] | None = typer.Argument(
        None, metavar="[-- VLLM_FLAGS...]", help="With --launch: vLLM flags for both servers, after `--`."),
    url: str | None = typer.Option(None, "--url", help="Benchmark one server at this URL."),
    a: str | None = typer.Option(None, "--a", help="A/B: the baseline server's URL (e.g. stock vLLM)."),
    b: str | None = typer.Option(None, "--b", help="A/B: the server compared with it (e.g. Proxima)."),
    label_a: str | None = typer.Option(None, "--label-a", help="Name of A (default: from its metrics)."),
    label_b: str | None = typer.Option(None, "--label-b", help="Name of B (default: from its metrics)."),
    launch: str | None = typer.Option(
        None, "--launch", metavar="MODEL",
        help="Start the servers here: same model and flags, allocators differ."),
    variants: str = typer.Option(
        "block,token", "--variants", help="With --launch: A,B among token, block, stock (or just one)."),
    side_by_side: bool = typer.Option(
        False, "--side-by-side",
        help="With --launch: run both servers at once instead of one after the other."),
    interleave: bool = typer.Option(
        True, "--interleave/--no-interleave",
        help="Servers up at the same time (two URLs, --side-by-side) take turns level by level."),
    workload: str = typer.Option(
        "short-chat", "--workload", "-w",
        help="short-chat, long-doc, mixed, shared-prefix, multi-turn, or a JSONL file of "
        "{\"prompt\", \"max_tokens\"}."),
    num_prompts: int | None = typer.Option(
        None, "--num-prompts", help="Generated prompts (default: enough that no level repeats one)."),
    prompt_tokens: str | None = typer.Option(
        None, "--prompt-tokens", help="Override the prompt length of a built-in workload: N or LOW-HIGH."),
    max_tokens: str | None = typer.Option(
        None, "--max-tokens",
        help="Output tokens: N or LOW-HIGH for built-in workloads; "
        "for a file, the default for lines without one."),
    seed: int = typer.Option(0, "--seed", help="Seed for the workload and the Poisson arrivals."),
    concurrency: str | None = typer.Option(
        None, "--concurrency", "-c",
        help=f"Concurrency levels (default {DEFAULT_CONCURRENCY} if no --rate)."),
    rate: str | None = typer.Option(
        None, "--rate", help="Poisson request-rate levels, requests/s, e.g. 2,4,8."),
    requests: int | None = typer.Option(None, "--requests", "-n", help="Requests per level (default 100)."),
    duration: float | None = typer.Option(
        None, "--duration", help="Seconds per level (with --requests: first wins)."),
    slo_p95: float = typer.Option(2.0, "--slo-p95", help="Latency SLO: P95 end-to-end seconds."),
    max_error_rate: float = typer.Option(
        0.10, "--max-error-rate", help="Stop a level when more than this share of requests fail."),
    avalanche_factor: float = typer.Option(
        3.0, "--avalanche-factor", help="Stop a level when P95 E2E exceeds this many times the SLO."),
    timeout: float = typer.Option(120.0, "--timeout", help="Per-request deadline in seconds."),
    sample_interval: float = typer.Option(
        0.5, "--sample-interval",
        help="Seconds between samples of the servers' metrics during a level (0: off; no peaks then)."),
    repeat: int = typer.Option(
        1, "--repeat", help="Run each level this many times: means with 95% intervals; servers whose "
        "intervals overlap are called tied."),
    warmup: int = typer.Option(
        8, "--warmup", help="Unmeasured requests (the workload's prompt length, at most 32 tokens out, "
        "prompts of their own) each server gets before its first level, so no level measures a cold "
        "start (0: none)."),
    check_answers: bool = typer.Option(
        False, "--check-answers",
        help="Before each server's sweep, send it 120 fixed greedy prompts; report how many answers the "
        "servers share (a broken engine shows in the same run)."),
    client_workers: int | None = typer.Option(
        None, "--client-workers",
        help="Processes sending the load (default: one per 24 streams or req/s, at most half the cores; "
        "1: bench's own event loop)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Directory for results, workload and report."),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="With --launch: server logs (default OUT/logs)."),
    api_key: str | None = typer.Option(
        None, "--api-key", help="Bearer key for servers started with --api-key (default: $VLLM_API_KEY, "
        "else $OPENAI_API_KEY); never written to the results."),
) -> None:
    """A/B load test: stock vLLM against Proxima."""
    # The typed parameters, never ctx.params: some typer releases leave those as click parsed them
    # (a str where a Path is declared), and the plan needs the declared types.
    given = {name: value for name, value in locals().items() if name != "ctx"}
    from proxima.bench.plan import BenchOptions, BenchPlan, PlanError

    options = BenchOptions(**given)
    try:
        plan = BenchPlan.from_options(options, _command(ctx, given))
    except PlanError as err:
        fail(str(err))
    _run(plan, options.out)


def _write(report, result, work, out: Path | None) -> tuple[list[Path], str | None]:
    """Write --out; if that fails (disk full, directory removed), write a temporary directory."""
    import tempfile

    if out is None:
        return [], None
    try:
        return report.write_outputs(result, work, out), None
    except OSError as first:
        reason = first.strerror or str(first)
    try:
        fallback = Path(tempfile.mkdtemp(prefix="proxima-bench-"))
        written = report.write_outputs(result, work, fallback)
    except OSError as err:
        return [], (f"cannot write the results to {out} ({reason}) nor to a temporary directory "
                    f"({err.strerror or err}); the tables above are all that is left")
    return written, f"cannot write the results to {out} ({reason}); they were written to {fallback} instead"


class _BenchSignals:
    """Signals over one bench run. While it measures, SIGTERM ends it as Ctrl-C does (so servers
    bench launched are stopped, not orphaned); after ``hold()`` both wait, recorded in ``late``,
    so that what was measured is shown and written whole. On exit the handlers before are back,
    and at no moment in between is either signal left to its default."""

    def __enter__(self) -> _BenchSignals:
        import signal

        self.late: list[int] = []
        self._previous = {signal.SIGINT: signal.getsignal(signal.SIGINT),
                          signal.SIGTERM: signal.signal(signal.SIGTERM, self._interrupt)}
        return self

    def hold(self) -> None:
        import signal

        for sig in self._previous:
            signal.signal(sig, lambda signum, frame: self.late.append(signum))

    def __exit__(self, *exc) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def _interrupt(signum, frame) -> None:
        raise KeyboardInterrupt


def _run(plan, out: Path | None) -> None:
    import sys

    from rich.console import Console

    from proxima.bench import report
    from proxima.bench.client import ServerUnreachable
    from proxima.bench.runner import BenchInterrupted, run_bench
    from proxima.bench.servers import LaunchError
    from proxima.bench.workload import WorkloadError

    # Piped or captured output gets a fixed, wide table rather than one squeezed into 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    progress = report.ProgressObserver.make(Console(stderr=True))
    interrupted = False
    with _BenchSignals() as signals:
        try:
            with progress:
                result, work = run_bench(plan, report.ProgressObserver(progress))
        except BenchInterrupted as partial:
            result, work, interrupted = partial.result, partial.work, True
        except WorkloadError as err:
            fail(str(err))
        except ServerUnreachable as err:
            fail(str(err))
        except LaunchError as err:
            fail(str(err), code=1)
        except KeyboardInterrupt:
            fail("interrupted before any level finished; launched servers were stopped, nothing written",
                 code=130)
        # The figures reach the terminal before anything touches the disk, and a failed write falls
        # back to a fresh temporary directory: a finished measurement is never lost.
        signals.hold()
        for table in report.terminal_tables(result):
            console.print(table)
        console.print(report.verdict_panel(result))
        written, write_error = _write(report, result, work, out)
    interrupted = interrupted or bool(signals.late)
    for path in written:
        console.print(f"wrote {path}", markup=False, highlight=False)
    if write_error:
        fail(write_error, code=1)
    if interrupted:
        fail("interrupted: the levels that finished are reported above"
             + (" and written" if written else "") + "; launched servers were stopped", code=130)
