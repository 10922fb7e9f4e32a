"""`proxima bench`: A/B load test of two servers (or one), given by URL or launched here.

Parses options into a `BenchPlan`, runs it (`proxima.bench.runner`) under a progress bar, then
prints the table and verdict and writes `--out`. A user's mistake ends in one line and exit 2
before anything is sent or written.
"""

from __future__ import annotations

from pathlib import Path

import typer

from proxima.cli.errors import fail

DEFAULT_CONCURRENCY = "4,8,16,32,64,128"


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        fail(f"{option} takes comma-separated positive integers, e.g. 4,8,16; got {text!r}")
    return sorted(set(values))


def _floats(text: str, option: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        fail(f"{option} takes comma-separated positive numbers (requests/s), e.g. 2,4,8; got {text!r}")
    return sorted(set(values))


def _command(ctx: typer.Context) -> str:
    """The invocation, rebuilt from the parsed options (for the record in results.json)."""
    import shlex

    parts = ["proxima", "bench"]
    extra: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name == "vllm_args":
            extra = list(value or [])
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
        help="short-chat, long-doc, mixed, shared-prefix, multi-turn, or a JSONL file of {\"prompt\", \"max_tokens\"}."),
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
    out: Path | None = typer.Option(None, "--out", "-o", help="Directory for results, workload and report."),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="With --launch: server logs (default OUT/logs)."),
) -> None:
    """A/B load test: stock vLLM against Proxima."""
    from proxima.bench import workload as wl

    given = [x for x in (url, a, b) if x]
    if launch and given:
        fail("use either --launch MODEL or server URLs (--url, or --a and --b), not both")
    if url and (a or b):
        fail("use --url for one server, or --a URL --b URL for an A/B, not both")
    if bool(a) != bool(b):
        fail("an A/B needs both --a URL and --b URL (or use --url for one server)")
    if not launch and not given:
        fail("say which server to load: --url URL, --a URL --b URL, or --launch MODEL")
    if vllm_args and not launch:
        fail(f"unexpected argument {vllm_args[0]!r}: vLLM flags after `--` are only used with --launch")
    if (label_a or label_b) and url:
        fail("--label-a/--label-b name the servers of an A/B; with --url there is one server")
    if out is not None:
        problem = _unwritable(out)
        if problem:
            fail(f"--out {out}: {problem}; choose a writable directory")
    if requests is not None and requests < 1:
        fail("--requests must be at least 1")
    if duration is not None and duration <= 0:
        fail("--duration must be a positive number of seconds")
    if slo_p95 <= 0 or timeout <= 0 or avalanche_factor <= 0:
        fail("--slo-p95, --timeout and --avalanche-factor must be positive")
    if sample_interval < 0:
        fail("--sample-interval is seconds between metrics samples (0 turns sampling off)")
    if not 0 <= max_error_rate < 1:
        fail("--max-error-rate is a fraction in [0, 1), e.g. 0.1 for 10%")

    from proxima.bench.sweep import SweepParams, levels_to_run

    conc = _ints(concurrency, "--concurrency") if concurrency else []
    rates = _floats(rate, "--rate") if rate else []
    if not conc and not rates:
        conc = _ints(DEFAULT_CONCURRENCY, "--concurrency")
    levels = levels_to_run(conc, rates)
    per_level = requests if requests is not None else (None if duration else 100)

    try:
        is_file = workload not in wl.BUILTIN
        prompt_range = wl.parse_range(prompt_tokens, "--prompt-tokens") if prompt_tokens else None
        output_range = wl.parse_range(max_tokens, "--max-tokens") if max_tokens else None
        default_max = wl.DEFAULT_MAX_TOKENS
        if is_file:
            if prompt_range is not None:
                fail("--prompt-tokens applies to built-in workloads; a file's prompts are used as written")
            if output_range is not None:
                if output_range.low != output_range.high:
                    fail("with a workload file, --max-tokens takes one number "
                         "(the default for lines without one)")
                default_max = output_range.low
            output_range = None
            wl.load_jsonl(workload, default_max)  # validate now: nothing is launched or written on a bad file
    except wl.WorkloadError as err:
        fail(str(err))
    if num_prompts is not None and num_prompts < 1:
        fail("--num-prompts must be at least 1")
    prompts = num_prompts or (per_level * len(levels) if per_level else 1000)
    plan_workload = wl.WorkloadPlan(workload, prompts, seed, prompt_range, output_range)

    from proxima.bench.launch import LaunchPlan, parse_variants
    from proxima.bench.runner import BenchPlan

    launch_plan = None
    urls: list[str] = []
    labels: list[str | None] = []
    if launch:
        try:
            chosen = parse_variants(variants)
        except ValueError as err:
            fail(str(err))
        names = [label_a, label_b][: len(chosen)]
        names = [n or v for n, v in zip(names, chosen)]
        if len(set(names)) != len(names):
            fail("the two servers need different labels; pass --label-a and --label-b")
        logs = log_dir or (out / "logs" if out else Path.cwd() / "proxima-bench-logs")
        launch_plan = LaunchPlan(launch, chosen, tuple(names), tuple(vllm_args or ()), side_by_side, logs)
    else:
        urls = [url] if url else [a, b]
        labels = [None] if url else [label_a, label_b]
        from proxima.fetch import normalize_url

        try:
            urls = [normalize_url(u) for u in urls]
        except ValueError as err:
            fail(str(err))

    params = SweepParams(per_level, duration, slo_p95, max_error_rate, avalanche_factor,
                         request_timeout_s=timeout, sample_interval_s=sample_interval, seed=seed)
    plan = BenchPlan(plan_workload, levels, params, urls, labels, launch_plan, default_max, _command(ctx),
                     interleave)
    _run(plan, out)


def _unwritable(out: Path) -> str | None:
    """Why `out` could not be written at the end, judged now (nothing is created before a run)."""
    import os

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


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(plan, out: Path | None) -> None:
    import signal
    import sys

    from rich.console import Console

    from proxima.bench import report
    from proxima.bench.client import ServerUnreachable
    from proxima.bench.launch import LaunchError
    from proxima.bench.runner import BenchInterrupted, run_bench
    from proxima.bench.workload import WorkloadError

    # Piped or captured output gets a fixed, wide table rather than one squeezed into 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    progress = report.ProgressObserver.make(Console(stderr=True))
    # SIGTERM ends the run like Ctrl-C does, so servers bench launched are stopped, not orphaned.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    interrupted = False
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
    finally:
        signal.signal(signal.SIGTERM, previous)
    # The figures reach the terminal before anything touches the disk, and a failed write falls
    # back to a fresh temporary directory: a finished measurement is never lost.
    for table in report.terminal_tables(result):
        console.print(table)
    console.print(report.verdict_panel(result))
    written, write_error = _write(report, result, work, out)
    for path in written:
        console.print(f"wrote {path}", markup=False, highlight=False)
    if write_error:
        fail(write_error, code=1)
    if interrupted:
        fail("interrupted: the levels that finished are reported above"
             + (" and written" if written else "") + "; launched servers were stopped", code=130)
