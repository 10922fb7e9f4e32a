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


class ProximaConfigError(ValueError):
    """A configuration Proxima cannot serve; the message names the option and the fix."""


@dataclass(frozen=True, slots=True)
class ProximaSettings:
    allocator: str | None  # None: Proxima is installed but not switched on
    telemetry: bool = True

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
        return cls(allocator=value, telemetry=telemetry)
