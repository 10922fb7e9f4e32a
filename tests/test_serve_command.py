"""`proxima serve`'s command line for vLLM: what it adds, what it leaves to the user."""

from __future__ import annotations

import pytest

from proxima.engine.launch import FULL_CUDA_GRAPHS, build_serve_command
from proxima.engine.settings import ProximaConfigError


def _argv(allocator: str, args: list[str], cuda: bool) -> list[str]:
    return build_serve_command("m", allocator, args, cuda=cuda).argv


def test_token_allocator_on_cuda_serves_slot_attention_with_full_cuda_graphs():
    argv = _argv("token", [], cuda=True)
    assert argv[argv.index("--block-size") + 1] == "1"
    assert argv[argv.index("--attention-backend") + 1] == "CUSTOM"
    assert argv[argv.index("--compilation-config") + 1] == FULL_CUDA_GRAPHS
    # Prefix caching stays vLLM's default (on): token slots serve it, token-exact.
    assert not any("prefix-caching" in a for a in argv)


def test_prefix_caching_follows_vllms_own_flag():
    on = build_serve_command("m", "token", [], cuda=False)
    off = build_serve_command("m", "token", ["--no-enable-prefix-caching"], cuda=False)
    assert "--no-enable-prefix-caching" in off.argv
    assert any("prefix cache: on" in n for n in on.notes)
    assert any("prefix cache: off" in n for n in off.notes)


@pytest.mark.parametrize("flags", [
    ["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'],
    ["--compilation-config.cudagraph_mode=FULL_AND_PIECEWISE"],
    ["-cc", '{"level": 3}'],
    ["-O3"],
    ["--optimization-level", "2"],
    ["--enforce-eager"],
])
def test_a_users_graph_or_compilation_choice_stands(flags):
    argv = _argv("token", flags, cuda=True)
    assert FULL_CUDA_GRAPHS not in argv
    assert argv.count("--compilation-config") == flags.count("--compilation-config")


@pytest.mark.parametrize(("allocator", "cuda"), [("token", False), ("block", True)])
def test_cpu_and_the_stock_allocator_keep_vllms_defaults(allocator, cuda):
    argv = _argv(allocator, [], cuda=cuda)
    assert "--compilation-config" not in argv
    assert "--attention-backend" not in argv


@pytest.mark.parametrize("value", ["fast", "-1", "nan", "61"])
def test_a_bad_telemetry_interval_is_refused_with_the_fix(monkeypatch, value):
    monkeypatch.setenv("PROXIMA_TELEMETRY_INTERVAL_S", value)
    with pytest.raises(ProximaConfigError,
                       match="PROXIMA_TELEMETRY_INTERVAL_S=.* is not a number of seconds"):
        build_serve_command("m", "token", [], cuda=False)


@pytest.mark.parametrize(("value", "seconds"), [("", 0.05), ("0", 0.0), ("0.5", 0.5)])
def test_telemetry_interval_from_the_environment(monkeypatch, value, seconds):
    from proxima.engine.settings import ProximaSettings

    monkeypatch.setenv("PROXIMA_TELEMETRY_INTERVAL_S", value)
    assert ProximaSettings.from_env().telemetry_interval_s == seconds
