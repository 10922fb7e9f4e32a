"""scripts/gpu/e2e.py's burst options and its summary of several bursts an engine (no GPU, no vLLM)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "scripts" / "gpu"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


cli = load(GPU / "e2e.py", "gpu_e2e_cli")
report = load(GPU / "kit" / "e2e_report.py", "gpu_e2e_report")


def test_shared_prefix_lengths_parse_and_bad_ones_name_the_fix():
    assert cli.prefix_lengths("300") == (300,)
    assert cli.prefix_lengths("0,300") == (0, 300)
    for bad in ("a", "300,300", "-5", "0,,300"):
        with pytest.raises(argparse.ArgumentTypeError, match="e.g. 0,300"):
            cli.prefix_lengths(bad)


def burst(tok_s: float) -> dict:
    # steps: [running, waiting, tokens, preemptions]: two decode-only, one mixed, one over 512 tokens
    steps = [[4, 9, 700, 0], [10, 3, 300, 0], [12, 0, 12, 1], [12, 0, 12, 0]]
    return {"output_tok_s": tok_s, "running_mean": 10.0, "running_peak": 20, "preemptions": 1, "steps": steps,
            "wall_s": 1.0, "wrapper_steps": 5, "repeat_tok_s": [tok_s, tok_s + 2],
            "repeat_running_mean": [10.0, 10.0], "output_tok_s_median": tok_s + 1}


def test_the_summary_prints_each_burst_of_each_engine(tmp_path, capsys):
    engines = {"proxima-1g-int4-full": None, "stock-triton-1g-int4": None}
    for name, base in (("proxima-1g-int4-full", 100), ("stock-triton-1g-int4", 50)):
        result = {"engine": name, "init_s": 3.0, "tight": burst(base), "tight-shared300": burst(base + 7)}
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    report.summarize(tmp_path, engines)
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if "tok/s" in line]
    firsts = [(words[0], words[1], words[3]) for words in lines if words[2] == "tok/s" and words[3] != "of"]
    assert sorted(firsts) == [("tight", "proxima-1g-int4-full", "100"),
                              ("tight", "stock-triton-1g-int4", "50"),
                              ("tight-shared300", "proxima-1g-int4-full", "107"),
                              ("tight-shared300", "stock-triton-1g-int4", "57")]
    assert [w[0] for w in lines if w[0].startswith("tight")][:2] == ["tight", "tight"]  # unshared first


def test_a_bursts_steps_are_counted_by_kind():
    line = report.step_mix(burst(1.0)["steps"], 512)
    assert line == ("steps: 2 decode-only, 1 mixed of <= 512 tokens, 1 over 512 (no CUDA graph) "
                    "scheduling 700 of 1,024 tokens")
    assert report.step_mix(burst(1.0)["steps"], 0) == (
        "steps (no CUDA graphs): 2 decode-only, 2 with prompt tokens; 1,024 tokens")
