"""`proxima doctor` end to end: the real command against real vLLM servers on CPU.

Servers: the session's `proxima_server` and `stock_server`, plus two of our own for the fault
cases, started together in the background as soon as the first test needs them:
  leak      token slots with PROXIMA_FAULT_LEAK_SLOTS=3 (every freed request leaks 3 slots), serving
            a tiny model with different weights (seed 1): also the `--compare` server that
            determinism must find divergent from `proxima_server`;
  small-kv  1 MiB of KV (1024 token slots) under --max-num-seqs 64 and --max-model-len 1024.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from proxima.load import LoadDriver, make_prompt
from proxima.probes.allocator import MAX_STEP_P99_S
from proxima.probes.runner import CHECKS
from proxima.scrape import scrape_sync
from proxima.server_process import ManagedServer, ServerSpec, free_port
from tests.conftest import SERVER_ARGS, own_cores

WINDOW = "3"
SMALL_KV_ARGS = (
    "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 20),
    "--enforce-eager", "--max-num-seqs", "64",
)


def doctor(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "proxima.cli.main", "doctor", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def doctor_json(*args: str) -> tuple[int, dict, dict]:
    code, out, err = doctor(*args, "--json", "--window", WINDOW)
    assert out.strip(), f"no JSON on stdout; stderr: {err}"
    report = json.loads(out)
    return code, report, {c["check"]: c for c in report["checks"]}


@pytest.fixture(scope="module")
def fault_servers(tiny_model, server_logs, tmp_path_factory):
    """Start both fault servers at once (start-up mostly waits on child processes); join on use."""
    from proxima.tiny_model import TinyModelSpec, build_tiny_model

    other_weights = str(build_tiny_model(tmp_path_factory.mktemp("tiny-seed1"), TinyModelSpec(seed=1)))
    servers = {
        "leak": ManagedServer(ServerSpec(other_weights, "token", args=SERVER_ARGS,
                                         env={"PROXIMA_FAULT_LEAK_SLOTS": "3",
                                              "PROXIMA_ENABLE_TEST_FAULTS": "1", **own_cores(0, 2)},
                                         log_path=server_logs / "doctor-leak.log")),
        "small-kv": ManagedServer(ServerSpec(tiny_model, "token", args=SMALL_KV_ARGS, env=own_cores(1, 2),
                                             log_path=server_logs / "doctor-small-kv.log")),
    }
    pool = ThreadPoolExecutor(max_workers=len(servers))
    started: dict[str, Future] = {name: pool.submit(s.start) for name, s in servers.items()}
    try:
        yield started
    finally:
        for future in started.values():
            future.exception()  # wait for each start to end before stopping its process group
        for server in servers.values():
            server.stop()
        pool.shutdown()


def _wait_quiet(url: str, timeout_s: float = 30.0) -> bool:
    """True once the server has no request running or waiting and generates no tokens for 2 s.

    The token counter matters: on a starved CPU a scrape mostly lands between engine waves, when
    `running` reads 0 even under load, so the gauges alone cannot prove that the load stopped.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        first = scrape_sync(url)
        time.sleep(2.0)
        last = scrape_sync(url)
        if (first.ok and last.ok and last.running == 0 and last.waiting == 0
                and last.generation_tokens_total == first.generation_tokens_total):
            return True
    return False


def test_unreachable_server_exits_3_with_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = doctor(url, "--window", WINDOW)
    assert code == 3
    assert out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot reach" in lines[0] and "connection refused" in lines[0], err

    code, out, _ = doctor(url, "--json")
    report = json.loads(out)
    assert code == 3 and report["exit_code"] == 3
    assert [c["check"] for c in report["checks"]] == list(CHECKS)
    assert all(c["status"] == "error" for c in report["checks"])


def test_bad_arguments_are_usage_errors():
    code, _, err = doctor("http://127.0.0.1:1", "--checks", "leak,nosuch")
    assert code == 2
    assert "nosuch" in err and "valid checks: " + ", ".join(CHECKS) in err and len(err.splitlines()) == 1
    code, _, err = doctor("127.0.0.1:8000")
    assert code == 2 and "must start with http://" in err and "Traceback" not in err


@pytest.mark.engine
def test_healthy_proxima_server_passes(proxima_server, fault_servers):
    # `fault_servers` is requested only so that their start-up overlaps this test.
    code, report, checks = doctor_json(proxima_server.url)
    assert list(checks) == list(CHECKS)
    assert report["model"] and report["exit_code"] == code
    bad = {n: c["summary"] for n, c in checks.items() if c["status"] in ("fail", "error", "skip")}
    assert not bad, bad
    assert code in (0, 1)
    env = checks["environment"]
    assert env["status"] == "ok", env["summary"]
    assert env["evidence"]["proxima_plugin"] == "loaded" and env["evidence"]["allocator"] == "token"
    assert env["evidence"]["cache.block_size"] == "1" and env["evidence"]["max_model_len"] == 1024
    assert checks["leak"]["status"] == "ok" and checks["leak"]["evidence"]["slots_in_use_idle"] == 0
    assert checks["leak"]["evidence"]["requests_completed"] > 0
    assert checks["oom_risk"]["evidence"]["kv_capacity_tokens"] == 32768
    assert checks["determinism"]["evidence"]["repeat_divergent"] == "0/4"
    # Warnings only where the shared test machine justifies them.
    for name, check in checks.items():
        if check["status"] != "warn":
            continue
        if name == "allocator":  # step timing on 2 shared CPU cores, against a tiny model's ITL
            ev = check["evidence"]
            assert ev["step_share_of_itl"] > 0.10 or ev["step_p99_s"] > MAX_STEP_P99_S
        elif name == "oom_risk":  # other tests' traffic: earlier preemptions, or long typical requests
            ev = check["evidence"]
            assumed = str(ev["max_num_seqs"])
            assert ev["preemptions_before_doctor"] > 0 or (
                "assumed" in assumed and ev["typical_requests_kv_holds"] < int(assumed.split()[0]))
            assert ev["first_pressure_concurrency"] is None
        elif name == "determinism":  # batch-composition dependence only, never alone
            assert check["evidence"]["repeat_divergent"] == "0/4"
        elif name == "bottleneck":  # it replays the sizes of earlier tests' requests: their KV
            ev = check["evidence"]
            assert ev["request_shape"].startswith("observed")
            assert ev["kv_usage_peak"] >= 0.9 or ev["preemptions"] > 0
        else:
            pytest.fail(f"unjustified warning from {name}: {check['summary']}")
    assert _wait_quiet(proxima_server.url), "load still running after the doctor exited"

    code, out, _ = doctor(proxima_server.url, "--checks", "environment,allocator")
    assert code in (0, 1)
    for text in ("environment", "allocator", "OK", "proxima_plugin",
                 "runbook: proxima runbook startup-failure", "runbook: proxima runbook allocator-latency",
                 "exit code"):
        assert text in out, f"{text!r} missing from the human report:\n{out}"


# For a doctor that does not stop: SIGUSR1 makes it print its asyncio tasks' stacks and every
# thread's (faulthandler) on stderr, so that the failure says where it hung.
_DUMP_ON_SIGUSR1 = (
    "import asyncio, faulthandler\n"
    "def _dump(*_):\n"
    "    try:\n"
    "        tasks = asyncio.all_tasks(asyncio.get_running_loop())\n"
    "    except RuntimeError:\n"
    "        tasks = ()\n"
    "    for task in tasks:\n"
    "        task.print_stack(file=sys.stderr)\n"
    "    faulthandler.dump_traceback(all_threads=True)\n"
    "signal.signal(signal.SIGUSR1, _dump)\n"
)


def _dump_and_kill(proc: subprocess.Popen) -> str:
    """The stacks of a hung doctor child, then kill it; its stderr's last part."""
    proc.send_signal(signal.SIGUSR1)
    time.sleep(3)
    proc.kill()
    _, err = proc.communicate()
    return err[-12000:]


@pytest.mark.engine
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_interrupted_doctor_leaves_no_load(proxima_server, sig, code):
    # A shell without job control starts background children with SIGINT ignored, and Python
    # keeps it ignored; restore Python's own handler (what an interactive Ctrl-C meets).
    launch = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              f"{_DUMP_ON_SIGUSR1}sys.argv[0] = 'proxima'; from proxima.cli.main import app; app()")
    proc = subprocess.Popen(
        [sys.executable, "-c", launch, "doctor", proxima_server.url, "--checks", "bottleneck",
         "--window", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        start = scrape_sync(proxima_server.url).prompt_tokens_total
        deadline = time.monotonic() + 60
        def prompt_tokens() -> float:
            return scrape_sync(proxima_server.url).prompt_tokens_total

        while time.monotonic() < deadline and prompt_tokens() < start + 500:
            time.sleep(0.2)
        assert prompt_tokens() >= start + 500, "the doctor's load never started"
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the doctor still ran 60 s after {sig.name}; where it was:\n{_dump_and_kill(proc)}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code and "interrupted; all load stopped" in err, \
        f"exit code {proc.returncode}; stderr:\n{err[-4000:]}"
    assert _wait_quiet(proxima_server.url), "load still running after the doctor was interrupted"


@pytest.mark.engine
def test_leaking_server_fails_leak(fault_servers):
    server = fault_servers["leak"].result()
    code, _, checks = doctor_json(server.url, "--checks", "leak")
    leak = checks["leak"]
    assert code == 2 and leak["status"] == "fail", leak["summary"]
    ev = leak["evidence"]
    assert ev["slots_in_use_idle"] > 0
    assert ev["running_idle"] == 0 and ev["waiting_idle"] == 0 and ev["requests_holding_slots_idle"] == 0
    assert ev["leaked_slots_per_request"] >= 2.5  # 3 per freed request (cancelled ones leak too)
    assert leak["runbook"] == "runbooks/memory-leak.md"
    assert any("PROXIMA_FAULT_LEAK_SLOTS" in a for a in leak["advice"])


@pytest.mark.engine
def test_small_kv_budget_fails_oom_risk(fault_servers):
    server = fault_servers["small-kv"].result()  # a 1 MiB cache under max-num-seqs 64 does start
    code, _, checks = doctor_json(server.url, "--checks", "oom_risk", "--max-num-seqs", "64")
    oom = checks["oom_risk"]
    assert code == 2 and oom["status"] == "fail", oom["summary"]
    ev = oom["evidence"]
    assert ev["kv_capacity_tokens"] == 1024 and ev["kv_bytes_per_token"] == 1024
    assert ev["max_num_seqs"] == 64 and ev["typical_requests_kv_holds"] < 64
    assert "but --max-num-seqs admits 64" in oom["summary"]
    # The ramp usually finds preemptions too; when it does, it is within the ramp.
    assert ev["first_pressure_concurrency"] is None or ev["first_pressure_concurrency"] <= 64
    advice = " ".join(oom["advice"])
    assert f"--max-num-seqs down to {ev['typical_requests_kv_holds']} (now 64)" in advice
    assert "--kv-cache-memory-bytes up" in advice
    assert "--max-model-len down" in advice  # one 1024-token request takes the whole cache
    assert _wait_quiet(server.url)


@pytest.mark.engine
def test_determinism_finds_divergence_against_other_weights(proxima_server, fault_servers):
    other = fault_servers["leak"].result()  # same tokenizer, different weights (seed 1)
    code, _, checks = doctor_json(proxima_server.url, "--checks", "determinism", "--compare", other.url)
    det = checks["determinism"]
    assert code == 2 and det["status"] == "fail", det["summary"]
    ev = det["evidence"]
    assert ev["compared_as"] == "token ids"
    assert ev["repeat_divergent"] == "0/4"  # the server agrees with itself...
    num_divergent = int(ev["vs_compare_divergent"].split("/")[0])
    assert num_divergent >= 1  # ...but not with the other weights
    where = [v for k, v in ev.items() if k.startswith("vs_compare.prompt")]
    assert len(where) == num_divergent and all(w.startswith("diverges at token ") for w in where)
    assert "diverge vs compare at token" in det["summary"]
    # Fed the reference's own tokens, other weights pick other next tokens: not rounding drift.
    forced = [re.search(r"same next token at (\d+)/(\d+) positions", w) for w in where]
    assert all(m and int(m[2]) == 24 and int(m[1]) < 0.9 * 24 for m in forced), where


@pytest.mark.engine
def test_a_greedy_answer_fed_back_is_each_engines_first_choice_at_every_position(
        proxima_server, stock_server, tiny_model):
    """What the determinism check's teacher forcing reads: float32 engines computing the same thing
    rank every token of either one's greedy answer first."""
    async def ranks() -> list[tuple[int, ...] | None]:
        async with httpx.AsyncClient(timeout=60) as client:
            driver = LoadDriver(client, proxima_server.url, tiny_model)
            answer = await driver.complete(make_prompt(3, 20), 24, seed=1)
            assert answer.ok and answer.prompt_token_ids and len(answer.token_ids) == 24
            ids, start = (*answer.prompt_token_ids, *answer.token_ids), len(answer.prompt_token_ids)
            return [await driver.teacher_forced_ranks(ids, start, url=url) for url in
                    (proxima_server.url, stock_server.url)]

    assert asyncio.run(ranks()) == [(1,) * 24] * 2


@pytest.mark.engine
def test_stock_server_runs_with_proxima_checks_skipped(stock_server):
    code, _, checks = doctor_json(stock_server.url)
    assert list(checks) == list(CHECKS)
    env = checks["environment"]
    assert env["status"] == "warn" and "plugin not loaded" in env["summary"]
    assert env["evidence"]["allocator"] == "stock vLLM blocks"
    assert checks["allocator"]["status"] == "skip" and "Proxima not loaded" in checks["allocator"]["summary"]
    ran = {n: c for n, c in checks.items() if n not in ("environment", "allocator")}
    assert all(c["status"] in ("ok", "warn") for c in ran.values()), {n: c["summary"] for n, c in ran.items()}
    assert "kv_usage_idle" in checks["leak"]["evidence"]  # stock: judged on vLLM's KV usage
    block = checks["adoption"]["evidence"]["block_size_compared"]
    assert block == int(env["evidence"]["cache.block_size"]) > 1
    assert checks["adoption"]["evidence"]["capacity_ratio_token_vs_block"] > 1
    assert code == 1
