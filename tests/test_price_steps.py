"""scripts/price_steps.py: step costs fitted from a GPU run's step log, and a schedule priced in them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_gpu_e2e_options import load

price_steps = load(Path(__file__).resolve().parents[1] / "scripts" / "price_steps.py", "price_steps_script")


def gpu_run(tmp_path, graph_tokens: int = 512):
    # [running, waiting, tokens, preemptions, ms]: graph steps of 8 and 10 ms, eager of 40 and 50,
    # large steps at 0.02 and 0.03 ms a token
    steps = [[9, 0, 9, 0, 8.0], [9, 0, 300, 0, 10.0], [9, 0, 700, 0, 40.0], [9, 0, 900, 0, 50.0],
             [0, 9, 5000, 0, 100.0], [0, 9, 8000, 0, 240.0], [9, 0, 12, 0, 9.0]]
    path = tmp_path / "proxima.json"
    run = {"steps": steps, "output_tokens": 90, "running_mean": 9.0, "preemptions": 0}
    path.write_text(json.dumps({"graph_tokens": graph_tokens, "tight": run}))
    return path


def test_the_fit_takes_each_kinds_median_and_prices_a_step_by_its_kind(tmp_path):
    costs = price_steps.fit([gpu_run(tmp_path)])
    assert (costs.graph_ms, costs.eager_ms, costs.graph_tokens) == (9.0, 45.0, 512)
    assert costs.ms_per_token == pytest.approx(0.025)
    assert costs.price(300, 512) == 9.0  # a graph step
    assert costs.price(700, 512) == 45.0  # eager: the host's floor
    assert costs.price(700, 2048) == pytest.approx(17.5)  # in a graph: its tokens' GEMMs
    assert costs.price(10000, 2048) == pytest.approx(250.0)


def test_a_run_without_a_capture_size_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="graph_tokens"):
        price_steps.fit([gpu_run(tmp_path, graph_tokens=0)])
