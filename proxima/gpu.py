"""GPU readings through NVML (nvidia-ml-py), for `top`, `doctor` and `bench`.

Never raises: no driver, no GPU or an NVML error yields an empty tuple or None fields, which the
tools show as "N/A". One init per process, guarded, because nvmlInit is not free.

NVML sees every GPU of the host; CUDA_VISIBLE_DEVICES (indices or UUIDs), when set, limits the
readings to the GPUs a server started from this environment would use, so a tool watching a
server on GPU 1 does not count what runs on GPU 0.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, object] = {"ready": None}


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    index: int
    name: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_pct: float | None
    power_watts: float | None
    driver_version: str | None = None

    @property
    def memory_fraction(self) -> float | None:
        if self.memory_used_bytes is None or not self.memory_total_bytes:
            return None
        return self.memory_used_bytes / self.memory_total_bytes


def _nvml():
    with _lock:
        if _state["ready"] is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _state["ready"] = pynvml
            except Exception as err:  # any failure means "no GPU readings here", by design
                logger.debug("NVML unavailable: %s", err)
                _state["ready"] = False
        return _state["ready"] or None


def _read(fn, *args):
    try:
        return fn(*args)
    except Exception:  # a field the driver does not report stays None ("N/A")
        return None


def read_gpus() -> tuple[GpuSnapshot, ...]:
    nvml = _nvml()
    if nvml is None:
        return ()
    count = _read(nvml.nvmlDeviceGetCount) or 0
    driver = _text(_read(nvml.nvmlSystemGetDriverVersion)) or None
    handles = [_read(nvml.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
    uuids = [_text(_read(nvml.nvmlDeviceGetUUID, h)) if h is not None else "" for h in handles]
    gpus = []
    for i in visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids):
        handle = handles[i]
        if handle is None:
            continue
        name = _read(nvml.nvmlDeviceGetName, handle)
        mem = _read(nvml.nvmlDeviceGetMemoryInfo, handle)
        util = _read(nvml.nvmlDeviceGetUtilizationRates, handle)
        power = _read(nvml.nvmlDeviceGetPowerUsage, handle)
        gpus.append(
            GpuSnapshot(
                index=i,
                name=_text(name) or "GPU",
                memory_used_bytes=int(mem.used) if mem is not None else None,
                memory_total_bytes=int(mem.total) if mem is not None else None,
                utilization_pct=float(util.gpu) if util is not None else None,
                power_watts=power / 1000.0 if power is not None else None,
                driver_version=driver,
            )
        )
    return tuple(gpus)


def memory_used_bytes(gpus: Sequence[GpuSnapshot]) -> int | None:
    """Memory used on these GPUs together (None when none reports it: shown as N/A)."""
    used = [g.memory_used_bytes for g in gpus if g.memory_used_bytes is not None]
    return sum(used) if used else None


def visible_indices(cuda_visible_devices: str | None, uuids: list[str]) -> list[int]:
    """NVML indices of the GPUs CUDA_VISIBLE_DEVICES names (all when unset), in its order.

    Entries are indices or (prefixes of) UUIDs, as CUDA accepts; like CUDA, the list ends at the
    first entry that names no GPU.
    """
    if cuda_visible_devices is None:
        return list(range(len(uuids)))
    picked: list[int] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit() and int(entry) < len(uuids):
            index = int(entry)
        else:
            index = next((i for i, u in enumerate(uuids) if entry and u.startswith(entry)), -1)
        if index < 0 or index in picked:
            break
        picked.append(index)
    return picked


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)
