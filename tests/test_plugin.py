"""The vLLM plugin entry point: idempotent, inert unless switched on, never fatal on a bad value.
Each case runs in a fresh interpreter, because vLLM's backend registry is per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import importlib.metadata as md
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
(ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "proxima"]
register = ep.load()
register(); register()
print(E.CPU_ATTN.get_path())
try:
    print(E.CUSTOM.get_path())
except ValueError:  # vLLM raises for an unregistered CUSTOM entry
    print("none")
"""


def _run(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env["VLLM_PLUGINS"] = ""  # load no plugin implicitly: the probe calls ours by hand
    if env_value is not None:
        env["PROXIMA_ALLOCATOR"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)


def _paths(proc) -> list[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-2:]


def test_token_allocator_takes_the_cpu_and_custom_backend_entries():
    cpu, custom = _paths(_run("token"))
    assert cpu == custom == "proxima.engine.attention.backend.ProximaSlotAttentionBackend"


@pytest.mark.parametrize("value", [None, "block"])
def test_plugin_changes_nothing_unless_token_allocator(value):
    cpu, custom = _paths(_run(value))
    assert cpu == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert custom == "none"


def test_bad_allocator_value_is_logged_and_leaves_vllm_stock():
    proc = _run("tokens")
    cpu, _ = _paths(proc)
    assert cpu == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert "PROXIMA_ALLOCATOR='tokens' is not an allocator" in proc.stderr + proc.stdout
