"""One in-process vLLM engine, built as `proxima serve` would build the server's.

Layer: tools, beside `serve_command` (which it reuses: `build_serve_command` decides Proxima's
flags, `preflight` refuses what the token allocator cannot serve, `parse_server_args` is vLLM's
own parser). vLLM is imported only inside `open_engine`. Variants, as `proxima.server_process`:

  token  `proxima serve`: Proxima's slot allocator, its attention backend and telemetry
  block  `proxima serve --proxima-allocator block`: vLLM's block allocator, Proxima's telemetry
  stock  plain vLLM; with `record`, its scheduler is `ObservedScheduler` (reports each step and
         preemption, changes nothing else); without it nothing of Proxima's runs at all

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a recorder
(`EngineRecorder`) hangs on the scheduler's `kv_sinks`, the sink protocol every exporter uses:
steps, preemptions and KV figures arrive as events, and the scheduler's methods stay vLLM's.
Proxima's environment switches for the engine are exactly the spec's while it is built (the
caller's PROXIMA_* are set aside, then restored).

One process, one kind of attention registry: vLLM loads the plugin once per process, and with
`token` it points the CPU and CUSTOM backends at Proxima's for good. So `token` engines and
`block`/`stock` engines never share a process (`open_engine` refuses the mix, naming the way
out); `process.EngineProcess` runs each kind in a child. Engines of one kind may follow each
other in one process: after the first, an engine starts in about 2 s instead of about a minute.

Modelled on vLLM's `LLM` entry (one constructor, everything from EngineArgs) and its tests'
`VllmRunner` fixture (a context manager that owns the engine and tears it down).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxima.harness.recorder import EngineRecorder
from proxima.metrics.sink import SchedulerStep
from proxima.server_process import VARIANTS

if TYPE_CHECKING:
    from vllm import LLM

logger = logging.getLogger(__name__)

# The tiny model on CPU as every script and test runs it: float32, so greedy outputs of two
# engines compare exactly, and eager, for a quick start-up.
TINY_CPU_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--enforce-eager")


class HarnessError(RuntimeError):
    """An engine the harness cannot build here; the message names the way out."""


def vllm_flags(**values: Any) -> tuple[str, ...]:
    """vLLM command-line flags from keyword values: `enforce_eager=True` -> `--enforce-eager`,
    `enable_prefix_caching=False` -> `--no-enable-prefix-caching`, dicts as JSON."""
    flags: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return tuple(flags)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Which engine: the model, the variant, vLLM's flags as on `proxima serve`'s command line,
    Proxima's switches (PROXIMA_TELEMETRY_INTERVAL_S, PROXIMA_CHECK_INVARIANTS, ...) and whether
    a recorder listens."""

    model: str
    variant: str = "token"
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    record: bool = True

    @property
    def registry(self) -> str:
        return registry_of(self.variant)


def registry_of(variant: str) -> str:
    """The attention registry an engine of `variant` needs in its process: "slots" or "stock"
    (plugin.registered_backend); engines of one registry may share a process."""
    return "slots" if variant == "token" else "stock"


def engine_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """(`--model MODEL [flags]`, Proxima's environment) for the spec: what `proxima serve` (token,
    block) or plain vLLM (stock) would run, less the server's own flags."""
    if spec.variant not in VARIANTS:
        raise HarnessError(f"unknown engine variant {spec.variant!r}; use one of {', '.join(VARIANTS)}")
    if spec.variant == "stock":
        argv = ["--model", spec.model, *spec.args]
        if spec.record:
            from proxima.engine.observed import OBSERVED_SCHEDULER_CLS

            argv += ["--scheduler-cls", OBSERVED_SCHEDULER_CLS]
        return argv, dict(spec.env)
    from proxima.serve_command import build_serve_command

    command = build_serve_command(spec.model, spec.variant, list(spec.args))
    for note in command.notes:
        logger.debug("engine %s: %s", spec.variant, note)
    argv = command.argv[command.argv.index("--model"):]
    return argv, {**command.env, **spec.env}


def open_engine(spec: EngineSpec) -> Engine:
    """Build the engine in this process (use it as a context manager, or call `close`)."""
    from proxima import plugin

    registered = plugin.registered_backend()
    if registered is not None and registered != spec.registry:
        raise HarnessError(
            f"this process's vLLM already runs {registered} attention backends; a {spec.variant} "
            "engine needs a process of its own (proxima.harness.EngineProcess / run_isolated)"
        )
    argv, env = engine_command(spec)
    with _engine_environment(env):
        if spec.variant == "token":
            _preflight(argv, env)
        from vllm import LLM

        llm = LLM(**_llm_kwargs(argv))
    return Engine(spec, llm)


def _preflight(argv: list[str], env: dict[str, str]) -> None:
    from proxima.engine.settings import ProximaConfigError
    from proxima.serve_command import ServeCommand, preflight

    problems = preflight(ServeCommand(argv=argv, env=env))
    if problems:
        raise ProximaConfigError("Proxima cannot serve: " + "; ".join(problems))


def _llm_kwargs(argv: list[str]) -> dict[str, Any]:
    """`LLM(**kwargs)` for the command line: the EngineArgs vLLM's server parser makes of it,
    passed as the fields that differ from EngineArgs' defaults (LLM fills in the rest, as it does
    for any caller; it also leaves stats logging off, as offline use does)."""
    from vllm.engine.arg_utils import EngineArgs

    from proxima.serve_command import parse_server_args

    parsed = EngineArgs.from_cli_args(parse_server_args(argv))
    default = EngineArgs(model=parsed.model)
    return {f.name: getattr(parsed, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name == "model" or getattr(parsed, f.name) != getattr(default, f.name)}


@contextlib.contextmanager
def _engine_environment(env: Mapping[str, str]) -> Iterator[None]:
    """The engine core in this process, and exactly `env`'s Proxima switches, while it is built
    (its scheduler, manager and the plugin read them then); the caller's values come back after."""
    wanted = {**{k: None for k in os.environ if k.startswith("PROXIMA_")},
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    saved = {k: os.environ.get(k) for k in wanted}
    try:
        for key, value in wanted.items():
            _set_env(key, value)
        yield
    finally:
        for key, value in saved.items():
            _set_env(key, value)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


class Engine:
    """An engine `open_engine` built: vLLM's `LLM`, its scheduler (in this process) and the
    recorder on its sinks (None for an unrecorded stock engine)."""

    def __init__(self, spec: EngineSpec, llm: LLM) -> None:
        self.spec = spec
        self.llm = llm
        self.recorder: EngineRecorder | None = None
        self._guarded = None
        sinks = getattr(self.scheduler, "kv_sinks", None)
        if spec.record and sinks is not None:
            self.recorder = EngineRecorder()
            self._guarded = sinks.add("harness", self.recorder)

    @property
    def core(self):
        """vLLM's EngineCore, in this process."""
        client = self.llm.llm_engine.engine_core
        core = getattr(client, "engine_core", None)
        if core is None:
            raise HarnessError("the engine core runs in another process; open engines with open_engine")
        return core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_manager(self):
        return self.scheduler.kv_cache_manager

    @contextlib.contextmanager
    def listening(self, listener: Callable[[SchedulerStep], None]) -> Iterator[None]:
        """Call `listener` with every scheduler step meanwhile (e.g. tiles.ContextTiles)."""
        if self.recorder is None:
            raise HarnessError(f"a {self.spec.variant} engine opened with record=False reports no steps")
        self.recorder.listeners.append(listener)
        try:
            yield
        finally:
            self.recorder.listeners.remove(listener)
        self.recorder.check()

    def close(self) -> None:
        """Shut the engine down and free it, so another engine of the same kind can start here."""
        if self.llm is None:
            return
        if self._guarded is not None:
            self.scheduler.kv_sinks.remove(self._guarded)
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        if self.recorder is not None:
            self.recorder.check()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.recorder is not None:
            self.recorder.failure = None  # the run's own error is the one to see
        self.close()
