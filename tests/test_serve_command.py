"""`proxima serve`'s command line for vLLM: what it adds, what it leaves to the user."""

from __future__ import annotations

import pytest

from proxima.engine.settings import ProximaConfigError
from proxima.serve_command import build_serve_command, parse_server_args
from proxima.serve_graphs import FULL_CUDA_GRAPHS, GRAPH_TOKENS


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


def engine_args(argv: list[str]):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs.from_cli_args(parse_server_args(argv[argv.index("--model"):]))


def test_full_graphs_capture_steps_of_up_to_graph_tokens():
    args = engine_args(_argv("token", [], cuda=True))
    assert args.compilation_config.cudagraph_mode.name == "FULL"
    assert args.compilation_config.max_cudagraph_capture_size == GRAPH_TOKENS
    assert args.max_cudagraph_capture_size is None


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--max-cudagraph-capture-size", "512"], "max_cudagraph_capture_size", 512),
    (["--cudagraph-capture-sizes", "1", "2", "4"], "cudagraph_capture_sizes", [1, 2, 4]),
    (["--max_cudagraph_capture_size=256"], "max_cudagraph_capture_size", 256),
])
def test_a_users_capture_sizes_stand_beside_full_graphs(flags, field, value):
    """vLLM refuses a capture size set both in --compilation-config and by its own flag: the
    user's flag then stands alone, and the graphs stay FULL."""
    result = build_serve_command("m", "token", flags, cuda=True)
    args = engine_args(result.argv)
    assert args.compilation_config.cudagraph_mode.name == "FULL"
    assert args.compilation_config.max_cudagraph_capture_size is None
    assert args.compilation_config.cudagraph_capture_sizes is None
    assert getattr(args, field) == value
    assert any("at the capture sizes given" in n for n in result.notes)


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


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "3601"])
def test_a_bad_idle_trim_time_is_refused_with_the_fix(monkeypatch, value):
    monkeypatch.setenv("PROXIMA_IDLE_TRIM_S", value)
    with pytest.raises(ProximaConfigError, match="PROXIMA_IDLE_TRIM_S=.* is not a number of seconds"):
        build_serve_command("m", "token", [], cuda=False)


# ------------------------------------------------------------------ defaults (issue 16, section 5)

@pytest.mark.parametrize(("flags", "warned"), [
    ([], True), (["--host", "0.0.0.0"], True), (["--host=::"], True), (["--host", "example.org"], True),
    (["--host", "127.0.0.1"], False), (["--host", "localhost"], False), (["--host", "::1"], False),
    (["--api-key", "k"], False), (["--host", "0.0.0.0", "--api-key=k"], False),
])
def test_a_server_reachable_beyond_loopback_without_an_api_key_says_so(monkeypatch, flags, warned):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    notes = build_serve_command("m", "token", [*flags, "--kv-cache-memory-bytes", "1"], cuda=True).notes
    lines = [n for n in notes if "without --api-key" in n]
    assert len(lines) == int(warned), notes
    if warned:
        assert "--host 127.0.0.1" in lines[0] and "--api-key KEY" in lines[0]
    argv = build_serve_command("m", "token", flags, cuda=True).argv
    assert ("--host" in " ".join(argv)) == any(f.startswith("--host") for f in flags)  # vLLM's semantics kept


def test_the_api_key_from_vllms_environment_counts(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    notes = build_serve_command("m", "token", [], cuda=True).notes
    assert not [n for n in notes if "without --api-key" in n], notes
    # The key guards /v1 only: the note says what it leaves open (the prefix figures on /metrics).
    assert [n for n in notes if "--api-key guards /v1 only" in n], notes


def test_on_cpu_with_no_kv_size_a_bounded_default_is_chosen_and_said(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    command = build_serve_command("m", "token", ["--host", "127.0.0.1"], cuda=False)
    argv = command.argv
    size = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    import psutil

    assert 64 << 20 <= size <= min(4 << 30, psutil.virtual_memory().available)
    (note,) = [n for n in command.notes if n.startswith("CPU: KV cache")]
    assert f"--kv-cache-memory-bytes {size}" in note and "--gpu-memory-utilization" in note


@pytest.mark.parametrize("flags", [["--kv-cache-memory-bytes", "123"], ["--gpu-memory-utilization=0.5"]])
def test_a_users_kv_size_stands_on_cpu(monkeypatch, flags):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    command = build_serve_command("m", "block", flags, cuda=False)
    given = flags[0].count("--kv-cache-memory-bytes")
    assert " ".join(command.argv).count("--kv-cache-memory-bytes") == given
    assert not [n for n in command.notes if n.startswith("CPU: KV cache")]


def test_cpu_default_follows_free_memory_and_refuses_when_there_is_none(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv = build_serve_command("m", "token", [], cuda=False, available_bytes=2 << 30).argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(512 << 20)
    with pytest.raises(ProximaConfigError, match="pass --kv-cache-memory-bytes"):
        build_serve_command("m", "token", [], cuda=False, available_bytes=100 << 20)
    assert "--kv-cache-memory-bytes" not in build_serve_command("m", "token", [], cuda=True).argv
