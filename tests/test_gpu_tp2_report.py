"""The TP=2 check's verdicts (scripts/gpu/tp2.py): greedy comparison and the metric checks, read
from the recorded H200 run and from copies of it with one fault put in. Runs on CPU."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_tp2", _ROOT / "scripts" / "gpu" / "tp2.py")
tp2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tp2)
RUN = _ROOT / "docs" / "results" / "h200-2026-11-30-session5" / "tp2" / "tp2.json"


def seq(tokens: str, top2: list[list[float]]) -> dict:
    return {"tokens": list(tokens), "top2": top2}


def test_compare_greedy_counts_equal_sequences_and_reports_the_gap_where_one_diverges() -> None:
    ref = [seq("abc", [[-1.0, -2.0], [-0.5, -0.6], [-0.1, -3.0]]), seq("xy", [[-1.0, -1.5], [-2.0, -2.0]])]
    ours = [seq("abc", [[-1.0 + 3e-5, -2.0], [-0.5, -0.6], [-0.1, -3.0]]),
            seq("xz", [[-1.0, -1.5], [-2.0, -2.0]])]
    same, max_diff, notes = tp2.compare_greedy(ours, ref)
    assert same == 1
    assert max_diff == pytest.approx(3e-5)
    assert notes == "token 1: reference top-2 gap 0.00e+00"


def test_the_recorded_run_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert tp2.report(json.loads(RUN.read_text())) == 0
    out = capsys.readouterr().out
    assert "32/32 sequences" in out and "FAIL" not in out


@pytest.mark.parametrize("fault", ["leaked_slot", "second_engine", "diverged", "extra_allocate"])
def test_each_fault_fails_its_check(fault: str, capsys: pytest.CaptureFixture[str]) -> None:
    run = copy.deepcopy(json.loads(RUN.read_text()))
    m = run["proxima"]["metrics"]
    if fault == "leaked_slot":
        m["after"]["slots_used"] = 1
    elif fault == "second_engine":
        m["engines"] = ["0", "1"]
    elif fault == "diverged":
        first = run["proxima"]["greedy"][0]["tokens"]
        first[5] = first[5] + "?"
    else:
        m["after"]["allocate_calls"] += 1
    assert tp2.report(run) == 1
    assert capsys.readouterr().out.count("FAIL") == 1
