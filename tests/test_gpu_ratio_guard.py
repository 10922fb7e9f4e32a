"""The attention regression guard's verdicts (scripts/gpu/kit/ratio_guard.py), on made-up runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "kit" / "ratio_guard.py"
_spec = importlib.util.spec_from_file_location("ratio_guard", _PATH)
guard = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = guard  # dataclasses look their module up there
_spec.loader.exec_module(guard)

RUN = {
    "mixed": [{"case": "46 decodes", "proxima_attn_us": 30.0, "fa3_attn_us": 32.0, "proxima_graph_us": 28.0,
               "fa3_graph_us": 30.0},
              {"case": "fa3 failed", "proxima_attn_us": 10.0, "fa3_error": "RuntimeError"}],
    "graph_decode": [{"batch": 8, "context": 8192, "proxima_graph_us": 55.0, "fa3_graph_us": 50.0}],
}


def test_ratios_pair_each_case_with_fa3_in_the_same_run() -> None:
    assert guard.ratios(RUN) == {"eager: 46 decodes": 0.938, "graph: 46 decodes": 0.933,
                                 "graph decode 8 x 8192": 1.1}


def test_fp8_decode_grid_is_guarded_beside_the_bf16_cases() -> None:
    run = {"fp8_graph_decode": [{"batch": 8, "context": 32768, "proxima_fp8_graph_us": 242.0,
                                 "fa3_fp8_graph_us": 200.0}]}
    assert guard.ratios(run) == {"fp8 graph decode 8 x 32768": 1.21}


def test_int4_decode_is_guarded_against_stock_int4_and_fa3_bf16() -> None:
    run = {"pth_decode": [{"batch": 64, "context": 4096, "proxima_int4_graph_us": 120.0,
                           "stock_int4_graph_us": 400.0, "fa3_bf16_graph_us": 200.0},
                          {"batch": 1, "context": 2048, "proxima_int4_graph_us": 20.0,
                           "stock_int4_error": "RuntimeError"}]}
    assert guard.ratios(run) == {"int4 graph decode 64 x 4096 (vs stock int4)": 0.3,
                                 "int4 graph decode 64 x 4096 (vs FA3 bf16)": 0.6}


def test_a_ratio_past_the_tolerance_fails_and_one_within_passes() -> None:
    measured = guard.ratios(RUN)
    recorded = {"eager: 46 decodes": 0.85, "graph: 46 decodes": 0.90, "graph decode 8 x 8192": 1.05}
    verdicts = {v.case: v.status for v in guard.judge(measured, recorded)}
    assert verdicts == {"eager: 46 decodes": "slower", "graph: 46 decodes": "ok",
                        "graph decode 8 x 8192": "ok"}
    text, passed = guard.report(guard.judge(measured, recorded))
    assert not passed and "1 of 3 cases" in text


def test_a_recorded_case_not_measured_fails_and_a_new_one_does_not() -> None:
    verdicts = guard.judge({"new case": 1.5}, {"old case": 1.0})
    assert [(v.case, v.status) for v in verdicts] == [("old case", "missing"), ("new case", "new")]
    assert guard.report(verdicts)[1] is False
    assert guard.report(guard.judge({"new case": 1.5}, {}))[1] is True


def test_each_device_keeps_its_own_record(tmp_path: Path) -> None:
    """Ratios do not carry over between GPU models: a record is per device name, saving one keeps
    the others, and a device with none gets None (the guard then fails, naming --record)."""
    path = tmp_path / "ratios.json"
    guard.save(path, "NVIDIA H200", {"a": 0.9}, "H200, today")
    guard.save(path, "NVIDIA H100 80GB HBM3", {"a": 0.8}, "H100, today")
    guard.save(path, "NVIDIA H200", {"a": 0.7}, "H200, later")
    assert guard.load(path, "NVIDIA H200") == {"a": 0.7}
    assert guard.load(path, "NVIDIA H100 80GB HBM3") == {"a": 0.8}
    assert guard.load(path, "NVIDIA A100-SXM4-80GB") is None
    assert not list(tmp_path.glob("*.tmp"))


def test_the_recorded_file_has_a_record_for_each_device_measured() -> None:
    recorded = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "attention_ratios.json"
    for device in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        ratios = guard.load(recorded, device)
        assert ratios and all(0 < r < 5 for r in ratios.values()), device
