"""The engine harness without an engine: the command line it builds (proxima serve's own), the
environment it gives an engine, its recorder, and its child processes. The harness driving real
engines is exercised by every engine scenario (test_engine_equivalence, _metrics, _fp8)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from proxima.harness import (
    EngineProcess,
    EngineProcessError,
    EngineRecorder,
    EngineSpec,
    HarnessError,
    open_engine,
    registry_of,
    run_isolated,
    vllm_flags,
)
from proxima.harness import engine as harness_engine
from proxima.metrics.kv_stats import KVStats
from proxima.metrics.sink import SchedulerStep
from proxima.serve_command import SCHEDULER_CLS

MODEL = "/models/tiny"


def test_flags_from_keywords_as_vllm_parses_them():
    assert vllm_flags(enforce_eager=True, enable_prefix_caching=False, block_size=None, max_num_seqs=8,
                      compilation_config={"cudagraph_mode": "FULL"}) == (
        "--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "8",
        "--compilation-config", '{"cudagraph_mode": "FULL"}')


def test_token_and_block_engines_get_proxima_serves_command_line():
    argv, env = harness_engine.engine_command(EngineSpec(MODEL, "token", ("--max-num-seqs", "8"),
                                                         env={"PROXIMA_TELEMETRY_INTERVAL_S": "0"}))
    assert argv[:2] == ["--model", MODEL] and argv[argv.index("--block-size") + 1] == "1"
    assert argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    # Figures in whole blocks, as `proxima serve` discloses them by default (docs/security.md).
    assert env == {"PROXIMA_ALLOCATOR": "token", "PROXIMA_TELEMETRY_INTERVAL_S": "0",
                   "PROXIMA_KV_FIGURES": "block"}
    argv, env = harness_engine.engine_command(EngineSpec(MODEL, "block", ("--block-size", "32")))
    assert argv.count("--block-size") == 1 and argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert env == {"PROXIMA_ALLOCATOR": "block", "PROXIMA_KV_FIGURES": "block"}


def test_stock_engines_run_vllms_scheduler_observed_or_nothing_of_proximas():
    from proxima.engine.observed import OBSERVED_SCHEDULER_CLS

    argv, env = harness_engine.engine_command(EngineSpec(MODEL, "stock", ("--block-size", "32")))
    assert argv == ["--model", MODEL, "--block-size", "32", "--scheduler-cls", OBSERVED_SCHEDULER_CLS]
    assert env == {}
    argv, _ = harness_engine.engine_command(EngineSpec(MODEL, "stock", record=False))
    assert argv == ["--model", MODEL]
    with pytest.raises(HarnessError, match="unknown engine variant 'paged'"):
        harness_engine.engine_command(EngineSpec(MODEL, "paged"))


def test_llm_gets_what_vllms_server_parser_makes_of_the_command_line(tiny_model):
    argv, _ = harness_engine.engine_command(EngineSpec(tiny_model, "token", vllm_flags(
        dtype="float32", kv_cache_memory_bytes=1 << 20, enable_prefix_caching=False)))
    kwargs = harness_engine._llm_kwargs(argv)
    assert kwargs["model"] == tiny_model and kwargs["dtype"] == "float32" and kwargs["block_size"] == 1
    assert kwargs["scheduler_cls"] == SCHEDULER_CLS and kwargs["enable_prefix_caching"] is False
    assert kwargs["kv_cache_memory_bytes"] == 1 << 20
    assert "disable_log_stats" not in kwargs  # LLM's offline default (stats off) stands


def test_the_engine_sees_exactly_its_specs_proxima_switches(monkeypatch):
    monkeypatch.setenv("PROXIMA_TELEMETRY", "off")  # the caller's: not the engine's
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with harness_engine._engine_environment({"PROXIMA_ALLOCATOR": "token"}):
        assert os.environ["PROXIMA_ALLOCATOR"] == "token" and "PROXIMA_TELEMETRY" not in os.environ
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["PROXIMA_TELEMETRY"] == "off" and "PROXIMA_ALLOCATOR" not in os.environ
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_an_engine_of_the_other_registry_is_refused_before_anything_starts(monkeypatch):
    from proxima import plugin

    monkeypatch.setattr(plugin, "registered_backend", lambda: "slots")
    assert registry_of("stock") == registry_of("block") == "stock" != registry_of("token")
    with pytest.raises(HarnessError, match="a stock engine needs a process of its own"):
        open_engine(EngineSpec(MODEL, "stock"))


STATS = KVStats(allocator="token", granularity=1, slots_total=64, slots_used=10, slots_cached=0,
                live_tokens=8, requests_holding_slots=2, reference_block=16, reference_block_slots=32,
                occupancy=(0.5,), largest_free_run=54)


def _step(running: int, scheduled: dict[str, int], waiting: int = 0) -> SchedulerStep:
    return SchedulerStep(0.002, 0.0001, running, waiting, scheduled, sum(scheduled.values()))


def test_the_recorder_files_each_steps_preemptions_timings_and_kv_figures_under_it():
    recorder, seen = EngineRecorder(), []
    recorder.listeners.append(lambda step: seen.append(dict(step.num_scheduled_tokens)))
    recorder.set_static("token", 1, 1024, 65536)
    recorder.count_preemption()
    recorder.observe_latencies("allocate", [1e-6, 2e-6])
    recorder.observe_latencies("step", [5e-3])  # the step event carries its own time
    recorder.publish(STATS)
    recorder.step_scheduled(_step(2, {"a": 5, "b": 1}))
    recorder.step_scheduled(_step(0, {}))
    first, second = recorder.steps
    assert (first.num_running, first.num_scheduled_tokens, first.preemptions, first.kv) == (2, 6, 1, STATS)
    assert first.allocator_seconds == pytest.approx(3e-6) and first.telemetry_seconds == 0.0001
    assert (second.preemptions, second.kv, second.allocator_seconds) == (0, None, 0.0)
    assert seen == [{"a": 5, "b": 1}, {}]
    assert recorder.running_mean() == 2 and recorder.running_peak() == 2
    assert recorder.slot_efficiency() == pytest.approx(0.8) and recorder.static.bytes_per_token == 1024
    recorder.reset()
    assert recorder.steps == [] and recorder.preemptions == 0 and recorder.static is not None


def test_each_steps_period_runs_to_the_next_steps_event_and_the_last_to_the_runs_end():
    recorder = EngineRecorder()
    recorder.step_scheduled(_step(1, {"a": 1}))
    time.sleep(0.02)
    recorder.step_scheduled(_step(1, {"a": 1}))
    time.sleep(0.01)
    ended = time.perf_counter()
    first, second = recorder.steps
    assert recorder.step_periods(ended) == [second.started - first.started, ended - second.started]
    assert recorder.step_periods(ended)[0] >= 0.02 and recorder.step_periods(ended)[1] >= 0.01


def test_the_running_mean_while_requests_wait_leaves_out_the_ramp_and_drain():
    recorder = EngineRecorder()
    for running, waiting in [(4, 6), (10, 2), (8, 1), (6, 0), (2, 0), (0, 0)]:
        recorder.step_scheduled(_step(running, {"a": running}, waiting))
    assert recorder.running_mean_while_waiting() == (pytest.approx(22 / 3), 3)
    assert recorder.running_mean() == pytest.approx(30 / 5)
    recorder.reset()
    assert recorder.running_mean_while_waiting() == (0.0, 0)


def test_a_listeners_error_is_kept_for_the_caller_not_lost_in_the_guards_log():
    recorder = EngineRecorder()
    recorder.listeners.append(lambda step: 1 / 0)
    recorder.step_scheduled(_step(1, {"a": 1}))  # inside the engine: must not raise
    assert len(recorder.steps) == 1
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        recorder.check()
    recorder.check()  # reported once


def environment_of_child(name: str) -> tuple[str | None, str | None, int]:
    return os.environ.get(name), os.environ.get("PROXIMA_ALLOCATOR"), os.getpid()


def fails() -> None:
    raise ValueError("from the child")


def dies() -> None:
    os._exit(3)


def sleeps() -> None:
    import time

    time.sleep(30)


def test_a_child_process_runs_calls_with_a_clean_environment_and_reports_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("PROXIMA_ALLOCATOR", "token")
    with EngineProcess(env={"HARNESS_TEST": "1"}, log_path=tmp_path / "child.log") as child:
        value, allocator, pid = child.call(environment_of_child, "HARNESS_TEST")
        assert (value, allocator) == ("1", None) and pid != os.getpid()
        with pytest.raises(EngineProcessError, match="ValueError: from the child"):
            child.call(fails)
        assert child.call(environment_of_child, "HARNESS_TEST")[2] == pid  # the same child goes on
        with pytest.raises(EngineProcessError, match="died during dies"):
            child.call(dies)
        assert child.call(environment_of_child, "HARNESS_TEST")[2] != pid  # a fresh one after
    assert run_isolated(environment_of_child, "HARNESS_TEST", env={"HARNESS_TEST": "2"})[0] == "2"


def test_a_call_past_its_timeout_fails_and_the_child_is_stopped():
    """Stopped, not waited for: the child is still in the call, and waiting for it to end would
    block the caller as long as the overrun lasts (forever, for a hung engine)."""
    child = EngineProcess().start()
    proc = child._proc
    try:
        with pytest.raises(EngineProcessError, match="no reply within 1 s"):
            child.call(sleeps, timeout=1)
        assert child._proc is None
        assert proc.returncode == -signal.SIGTERM  # ended by the harness, not by finishing its sleep
    finally:
        child.close()
        child.remove_log()


def test_a_script_run_as_main_is_loaded_by_path_in_the_child(tmp_path):
    import subprocess

    (tmp_path / "sibling.py").write_text("VALUE = 41\n")
    (tmp_path / "bench_x.py").write_text(
        "from sibling import VALUE\n\nfrom proxima.harness import run_isolated\n\n\n"
        "def answer():\n    return VALUE + 1\n\n\n"
        "if __name__ == '__main__':\n    print(run_isolated(answer))\n")
    done = subprocess.run([sys.executable, "bench_x.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.stdout.strip() == "42", done.stderr[-2000:]
