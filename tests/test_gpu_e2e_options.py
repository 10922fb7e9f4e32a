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
    timed = [[*row, ms] for row, ms in zip(burst(1.0)["steps"], (40.0, 20.0, 10.0, 12.0))]
    assert report.step_mix(timed, 512) == (
        "steps: 2 decode-only, 1 mixed of <= 512 tokens, 1 over 512 (no CUDA graph) scheduling 700 of "
        "1,024 tokens; ms a step: decode-only 11.0, mixed 20.0, over 40.0")
    assert report.step_mix(timed, 0).endswith("; ms a step: decode-only 11.0, with prompt tokens 30.0")


def write_start(folder: Path, tok_s: dict[str, list[float]], running: float = 10.0) -> None:
    folder.mkdir()
    for name, runs in tok_s.items():
        tight = {**burst(runs[0]), "repeat_tok_s": runs, "running_mean": running}
        (folder / f"{name}.json").write_text(json.dumps({"engine": name, "init_s": 1.0, "tight": tight}))


def test_starts_are_summarised_together_and_paired_start_by_start(tmp_path, capsys):
    ours, theirs = "proxima-1g-int4-full", "stock-triton-1g-int4-full"
    write_start(tmp_path / "s1", {ours: [120, 110, 130], theirs: [100]})
    write_start(tmp_path / "s2", {ours: [90], theirs: [60, 60]}, running=10.04)  # 10.0 printed: the same
    report.main([tmp_path / "s1", tmp_path / "s2"])
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    # Proxima: runs 120 110 130 90, median 115, start medians 120 90; stock: 100 60 60, median 60.
    assert lines == ["over 2 starts:",
                     f"tight {ours} tok/s median 115 of 4 runs; start medians 120 90; running mean 10.0",
                     f"tight {theirs} tok/s median 60 of 3 runs; start medians 100 60; running mean 10.0",
                     f"tight {ours} / {theirs}: 1.92x; start by start 1.20 1.50; faster over starts: "
                     "p = 0.333 (one-sided Mann-Whitney U, 2 against 2)"]


def test_only_starts_faster_every_time_make_a_small_p():
    # Start medians, the unit: all three of ours above all three of theirs is the strongest
    # evidence three starts can give (1 / C(6, 3) = 0.05); one overlap is not evidence.
    stock = [5900, 5300, 6000]
    assert report.faster_starts([8100, 7000, 6900], stock).startswith("faster over starts: p = 0.050")
    assert report.faster_starts([8100, 5800, 6900], stock).startswith("faster over starts: p = 0.200")


def test_a_start_with_another_schedule_is_named(tmp_path, capsys):
    write_start(tmp_path / "s1", {"stock-triton-1g-int4": [100]})
    write_start(tmp_path / "s2", {"stock-triton-1g-int4": [100]}, running=11.0)
    report.main([tmp_path / "s1", tmp_path / "s2"])
    assert "running mean 10.0 / 11.0  (differs between starts)" in capsys.readouterr().out


def test_starts_must_be_counted_from_one(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["e2e.py", "/tmp/model", "/tmp/out", "--starts", "0"])
    with pytest.raises(SystemExit):
        cli.main()
    assert "--repeats and --starts take a count of 1 or more" in capsys.readouterr().err


def test_starts_run_in_turn_each_other_one_reversed(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(GPU))
    from kit import e2e

    ran: list[tuple[str, str]] = []

    def fake_engine(job, spec, name, *args, log_path, **kwargs):
        ran.append((log_path.parent.name, name))
        runs = [100.0] if name.startswith("stock") else [150.0]
        return {"engine": name, "init_s": 1.0, "tight": {**burst(runs[0]), "repeat_tok_s": runs}}

    monkeypatch.setattr(e2e, "run_isolated", fake_engine)
    pair = ["stock-triton-1g-int4-full", "proxima-1g-int4-full"]  # ENGINES order
    e2e.run(str(tmp_path / "model"), tmp_path / "out", set(pair), False, starts=3)
    assert ran == [("start1", pair[0]), ("start1", pair[1]), ("start2", pair[1]), ("start2", pair[0]),
                   ("start3", pair[0]), ("start3", pair[1])]
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*.json")) == \
        sorted(f"start{i}/{name}.json" for i in (1, 2, 3) for name in pair)
    assert f"tight {pair[1]} / {pair[0]}: 1.50x; start by start 1.50 1.50 1.50" in \
        " ".join(capsys.readouterr().out.split())


def test_a_graph_size_below_one_token_is_refused_before_any_engine_starts(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["e2e.py", "model", "out", "--graph-tokens", "0"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert "--graph-tokens takes a token count of 1 or more" in capsys.readouterr().err
