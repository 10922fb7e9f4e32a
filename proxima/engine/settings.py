"""Proxima's engine switches, read from the environment in every vLLM process.

The environment (not a config file) carries them because vLLM spawns its EngineCore and worker
processes itself; `proxima serve` sets the variables once and every process inherits them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ALLOCATOR_ENV = "PROXIMA_ALLOCATOR"
ALLOCATORS = ("token", "block")
# "off" skips the per-step KV statistics and their export (for measuring their overhead).
TELEMETRY_ENV = "PROXIMA_TELEMETRY"
# Seconds between two refreshes of the KV gauges while the engine is busy (0: every step).
TELEMETRY_INTERVAL_ENV = "PROXIMA_TELEMETRY_INTERVAL_S"
# Scrapes come seconds apart and `proxima top` refreshes at 2 Hz: 20 Hz keeps every reader current
# while a busy engine (a step every few ms) pays the collection and export on one step in several.
DEFAULT_TELEMETRY_INTERVAL_S = 0.05
# "exact" publishes token-exact prefix-cache figures; the default, "block", publishes every figure
# that depends on what other requests cached no finer than whole 16-token blocks (docs/security.md).
KV_FIGURES_ENV = "PROXIMA_KV_FIGURES"
KV_FIGURES = ("block", "exact")
# Seconds without a step after which the worker gives glibc's freed heap back (0: never); see
# heap_trim.py. Long enough that the gaps inside a burst do not trim, short enough that a server
# between bursts has returned its fragments within seconds.
IDLE_TRIM_ENV = "PROXIMA_IDLE_TRIM_S"
DEFAULT_IDLE_TRIM_S = 1.0
# "off" keeps CPU decodes on the torch path instead of the compiled in-place kernel
# (attention/slot_decode_cpu.py): for an A/B of the two, or where no C++ compiler is wanted.
CPU_KERNEL_ENV = "PROXIMA_CPU_KERNEL"
# Which kernel attends an int4 cache's decodes (attention/launch_args.INT4_DECODE). "gluon": on an
# H100, 0.69-0.99x the Triton kernel's decode time at 15 of 16 grid points (1.04x at 1 x 2,048),
# and the 1 GiB burst's tok/s within the Triton kernel's run-to-run spread (docs/benchmarks.md).
INT4_DECODE_ENV = "PROXIMA_INT4_DECODE"
INT4_DECODE_KERNELS = ("gluon", "triton")
DEFAULT_INT4_DECODE = "gluon"


class ProximaConfigError(ValueError):
    """A configuration Proxima cannot serve; the message names the option and the fix."""


@dataclass(frozen=True, slots=True)
class ProximaSettings:
    allocator: str | None  # None: Proxima is installed but not switched on
    telemetry: bool = True
    telemetry_interval_s: float = DEFAULT_TELEMETRY_INTERVAL_S
    exact_kv_figures: bool = False
    idle_trim_s: float = DEFAULT_IDLE_TRIM_S

    @property
    def token_slots(self) -> bool:
        return self.allocator == "token"

    @classmethod
    def from_env(cls) -> ProximaSettings:
        value = os.environ.get(ALLOCATOR_ENV, "").strip().lower() or None
        if value is not None and value not in ALLOCATORS:
            raise ProximaConfigError(
                f"{ALLOCATOR_ENV}={value!r} is not an allocator; use one of {', '.join(ALLOCATORS)}"
            )
        telemetry = os.environ.get(TELEMETRY_ENV, "on").strip().lower() not in ("off", "0", "false")
        figures = os.environ.get(KV_FIGURES_ENV, "").strip().lower() or KV_FIGURES[0]
        if figures not in KV_FIGURES:
            raise ProximaConfigError(
                f"{KV_FIGURES_ENV}={figures!r} is not a figure mode; use one of {', '.join(KV_FIGURES)}"
            )
        return cls(allocator=value, telemetry=telemetry, telemetry_interval_s=telemetry_interval_from_env(),
                   exact_kv_figures=figures == "exact", idle_trim_s=idle_trim_from_env())


def int4_decode_from_env() -> str:
    """`INT4_DECODE_ENV`'s kernel (unset: `DEFAULT_INT4_DECODE`), or a one-line ProximaConfigError."""
    value = os.environ.get(INT4_DECODE_ENV, "").strip().lower() or DEFAULT_INT4_DECODE
    if value not in INT4_DECODE_KERNELS:
        raise ProximaConfigError(f"{INT4_DECODE_ENV}={value!r} is not an int4 decode kernel; use one of "
                                 f"{', '.join(INT4_DECODE_KERNELS)} (or leave it unset)")
    return value


def telemetry_interval_from_env() -> float:
    return _seconds_from_env(TELEMETRY_INTERVAL_ENV, DEFAULT_TELEMETRY_INTERVAL_S, 60,
                             "or 0 to refresh the KV gauges every step")


def idle_trim_from_env() -> float:
    return _seconds_from_env(IDLE_TRIM_ENV, DEFAULT_IDLE_TRIM_S, 3600,
                             "or 0 to leave freed memory in the worker's heap")


def _seconds_from_env(name: str, default: float, most: float, zero_means: str) -> float:
    """A number of seconds from 0 to `most` in variable `name` (unset: `default`), or a one-line
    ProximaConfigError naming the variable and the fix."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= most:  # also refuses nan and inf
        raise ProximaConfigError(
            f"{name}={raw!r} is not a number of seconds from 0 to {most:g}; use e.g. "
            f"{default} (the default), {zero_means}"
        )
    return seconds
