"""`proxima serve` refuses what it cannot serve in one line, before vLLM is imported where it can:
a model that is not there and a port that is taken in well under 10 s (vLLM found them after 29 s
and 39 s, in a traceback), a flag vLLM does not know as vLLM's own last line (not 250 lines of
usage first)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from proxima.engine.compat import PER_TOKEN_HEAD_KV_CACHE_DTYPES
from proxima.installed import cpu_build_of_vllm
from proxima.serve_checks import kv_dtype_problem, model_problem, port_problem

BOUND_S = 10.0


def _serve(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "proxima.cli.main", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("model", ["/no/such/model", "./no-such-dir", "not a model id", "a/b/c"])
def test_a_model_that_is_not_there_is_refused_in_one_line_at_once(model):
    proc, took = _serve(model, "--port", "1")
    line = _one_line(proc)
    assert repr(model) in line and "no such file or directory" in line
    assert took < BOUND_S, took


def test_a_port_in_use_is_refused_in_one_line_at_once(tiny_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, took = _serve(tiny_model, "--host", "127.0.0.1", "--port", str(port))
        every, took_every = _serve(tiny_model, "--port", str(port))  # vLLM's default host: all of them
    assert f"127.0.0.1:{port} is already in use" in _one_line(proc)
    assert f"port {port} (every interface) is already in use" in _one_line(every)
    assert max(took, took_every) < BOUND_S, (took, took_every)


def test_an_unknown_vllm_flag_is_vllms_last_line_only(tiny_model):
    proc, _ = _serve(tiny_model, "--port", "1", "--no-such-flag", "3", "--check")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("proxima: error: vLLM: unrecognized arguments: --no-such-flag")
    assert "usage:" not in proc.stderr  # vLLM's 250 lines of usage stay out; --help has them


def test_model_and_port_rules(tmp_path):
    assert model_problem("meta-llama/Llama-3.1-8B-Instruct") is None  # a hub id: vLLM fetches it
    assert model_problem("gpt2") is None
    assert model_problem(str(tmp_path)) is not None  # a directory without config.json
    (tmp_path / "config.json").write_text("{}")
    assert model_problem(str(tmp_path)) is None
    assert port_problem(["--uds", "/tmp/s"]) is None
    assert port_problem(["--port", "70000"]) == "--port 70000 is not a port number (0-65535)"
    assert "not an address of this machine" in port_problem(["--host", "192.0.2.1", "--port", "0"])


@pytest.mark.skipif(not cpu_build_of_vllm(), reason="the refusal is for vLLM's CPU build")
def test_a_kv_dtype_stock_attention_cannot_serve_on_cpu_is_refused_in_one_line_at_once(tiny_model):
    # Without the check, vLLM's CPU backend fails a minute in with a tensor-shape error in its log.
    proc, took = _serve(tiny_model, "--proxima-allocator", "block", "--kv-cache-dtype", "int4_per_token_head",
                        "--port", "1")
    line = _one_line(proc)
    assert "--kv-cache-dtype int4_per_token_head: vLLM's CPU backend does not serve it" in line
    assert "use the token allocator" in line
    assert took < BOUND_S, took


def test_kv_dtype_rule(monkeypatch):
    import proxima.serve_checks as checks

    monkeypatch.setattr(checks, "cpu_build_of_vllm", lambda: True)
    for dtype in PER_TOKEN_HEAD_KV_CACHE_DTYPES:
        for args in (["--kv-cache-dtype", dtype], [f"--kv-cache-dtype={dtype}"]):
            assert dtype in kv_dtype_problem(args, "block")
            assert dtype in kv_dtype_problem(tuple(args), "stock")
            assert kv_dtype_problem(args, "token") is None  # token slots serve it on CPU
    for args in ([], ["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "auto"]):
        assert kv_dtype_problem(args, "block") is None
    monkeypatch.setattr(checks, "cpu_build_of_vllm", lambda: False)  # a GPU build: stock serves them
    assert kv_dtype_problem(["--kv-cache-dtype", "int4_per_token_head"], "block") is None
