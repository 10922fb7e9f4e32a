"""The servers `proxima bench --launch MODEL` brings up to compare, through `proxima.server_process`.

Same model, same vLLM flags, only the allocator differs. By default one at a time: the first
server is stopped and its GPU memory seen released (when NVML can see it) before the second
starts, so neither measures in the other's leftovers; `side_by_side` runs both at once (each
then needs its share of memory, and GPU readings cover both).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from proxima.bench.plan import LaunchPlan
from proxima.gpu import memory_used_bytes, read_gpus
from proxima.server_process import ManagedServer, ServerSpec, ServerStartError

logger = logging.getLogger(__name__)

# Memory above the pre-launch baseline that still counts as "released" (driver caches, other users).
RELEASE_SLACK_BYTES = 512 << 20


class LaunchError(RuntimeError):
    """A launched server did not come up; the message names the variant and its log."""


@dataclass(slots=True)
class Launched:
    label: str
    variant: str
    url: str
    info: dict = field(default_factory=dict)
    pid: int | None = None


def gpu_memory_bytes() -> int | None:
    """Memory used on all GPUs of this host (None without NVML)."""
    return memory_used_bytes(read_gpus())


def wait_memory_released(baseline_bytes: int | None, timeout_s: float = 60.0) -> float | None:
    """Seconds until GPU memory is back near `baseline_bytes` (None: no GPU readings here)."""
    if baseline_bytes is None:
        return None
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        used = gpu_memory_bytes()
        if used is None or used <= baseline_bytes + RELEASE_SLACK_BYTES:
            return time.monotonic() - start
        time.sleep(0.5)
    logger.warning("GPU memory still %d MiB above its pre-launch level after %.0fs",
                   ((gpu_memory_bytes() or 0) - baseline_bytes) >> 20, timeout_s)
    return time.monotonic() - start


def _file_safe(label: str) -> str:
    """A label as part of a file name: any text may name a server, "a/b" included."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "server"


def _server(plan: LaunchPlan, variant: str, label: str) -> ManagedServer:
    log_path = plan.log_dir / f"server-{_file_safe(label)}.log"
    spec = ServerSpec(model=plan.model, variant=variant, args=plan.vllm_args, log_path=log_path)
    return ManagedServer(spec)


def _start(server: ManagedServer, plan: LaunchPlan, info: dict, say: Callable[[str], None]) -> None:
    say(f"starting the {server.spec.variant} server ({plan.model}; vLLM takes a minute or more to start, "
        f"longer on CPU; log: {server.spec.log_path})")
    info["started_at"] = time.time()
    try:
        server.start(timeout=plan.startup_timeout_s)
    except ServerStartError as err:
        last = [ln for ln in str(err).splitlines() if ln.strip()]
        raise LaunchError(
            f"the {server.spec.variant} server did not start ({last[0] if last else 'no output'}); "
            f"see {server.spec.log_path}"
        ) from None
    info["ready_at"] = time.time()
    say(f"the {server.spec.variant} server is ready ({info['ready_at'] - info['started_at']:.0f} s)")


def _stop(server: ManagedServer, info: dict, baseline: int | None) -> None:
    server.stop()
    info["stopped_at"] = time.time()
    info["memory_release_wait_s"] = wait_memory_released(baseline)


def launched(plan: LaunchPlan, say: Callable[[str], None] = lambda text: None) -> Iterator[list[Launched]]:
    """Yield the servers that are up together, ready to use: one at a time (each stopped when the
    caller asks for the next), or, side by side, all of them at once. `say` hears each start."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    if plan.side_by_side:
        yield from _side_by_side(plan, say)
        return
    for variant, label in zip(plan.variants, plan.labels):
        server = _server(plan, variant, label)
        info: dict = {"variant": variant, "log": str(server.spec.log_path), "side_by_side": False}
        baseline = gpu_memory_bytes()
        try:
            _start(server, plan, info, say)
            yield [Launched(label, variant, server.url, info, server.pid)]
        finally:
            _stop(server, info, baseline)


def _side_by_side(plan: LaunchPlan, say: Callable[[str], None]) -> Iterator[list[Launched]]:
    servers = [_server(plan, v, lab) for v, lab in zip(plan.variants, plan.labels)]
    infos = [{"variant": s.spec.variant, "log": str(s.spec.log_path), "side_by_side": True} for s in servers]
    baseline = gpu_memory_bytes()
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(_start, s, plan, i, say) for s, i in zip(servers, infos)]
            for f in futures:
                f.result()
        yield [Launched(label, server.spec.variant, server.url, info, server.pid)
               for server, info, label in zip(servers, infos, plan.labels)]
    stopped_at = time.time()
    for info in infos:
        info["stopped_at"] = stopped_at
        info["memory_release_wait_s"] = wait_memory_released(baseline)
