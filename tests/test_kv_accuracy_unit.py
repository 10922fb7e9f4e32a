"""The accuracy benchmark's assembly (scripts/bench_kv_accuracy.py, proxima/accuracy_engines.py,
proxima/accuracy_report.py) on made-up engine measurements: which engines run where, the flags
each gets on CPU and on CUDA, which comparisons are made, the figures, the table and the record.
No engine starts."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from proxima.accuracy_engines import (
    CONFIGS_BY_NAME,
    AccuracyConfig,
    EngineMeasurement,
    RunParams,
    ScoredPassage,
    configurations,
    engine_spec,
)
from proxima.accuracy_report import (
    assemble,
    check_measurement,
    render_table,
    to_json,
    wanted_comparisons,
    write_json,
)
from proxima.harness.engine import engine_command
from proxima.serve_command import build_serve_command
from proxima.serve_graphs import GRAPH_TOKENS

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_kv_accuracy.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_kv_accuracy", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(args: tuple[str, ...], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_cpu_runs_what_stock_serves_there_and_cuda_adds_stock_per_token_head():
    cpu = [c.name for c in configurations(cuda=False)]
    assert cpu == ["proxima-auto", "proxima-fp8", "proxima-int8_per_token_head",
                   "proxima-fp8_per_token_head", "proxima-int4_per_token_head", "stock-auto", "stock-fp8"]
    cuda = [c.name for c in configurations(cuda=True)]
    assert cuda == cpu + ["stock-int8_per_token_head", "stock-fp8_per_token_head",
                          "stock-int4_per_token_head"]
    # A subset brings its references along, references first.
    assert [c.name for c in configurations(False, ["proxima-int4_per_token_head"])] == [
        "proxima-auto", "proxima-int4_per_token_head"]
    assert [c.name for c in configurations(False, ["stock-fp8"])] == ["stock-auto", "stock-fp8"]
    with pytest.raises(ValueError, match="only on CUDA"):
        configurations(False, ["stock-int4_per_token_head"])
    with pytest.raises(ValueError, match="unknown configuration"):
        configurations(False, ["proxima-int3"])


def test_cpu_specs_differ_only_in_the_kv_dtype_and_stock_block():
    params = RunParams(model="/m")
    specs = {c.name: engine_spec(c, params) for c in configurations(cuda=False)}
    for name, spec in specs.items():
        args = spec.args
        assert _flag(args, "--dtype") == "bfloat16" and _flag(args, "--max-logprobs") == "200"
        assert _flag(args, "--kv-cache-dtype") == name.split("-", 1)[1]
        assert "--enforce-eager" in args and "--attention-backend" not in args
        assert spec.variant == ("stock" if name.startswith("stock") else "token")
        assert _flag(args, "--block-size") == ("32" if name.startswith("stock") else None)
        assert spec.record == (spec.variant == "token")  # stock runs unobserved
    # Everything but the KV dtype and stock's block size is the same in every engine.
    common = {tuple(a for a in s.args if a not in {_flag(s.args, "--kv-cache-dtype"), "--kv-cache-dtype",
                                                   "--block-size", "32"}) for s in specs.values()}
    assert len(common) == 1
    # Proxima's engine is `proxima serve`'s: token slots, one-token blocks, its scheduler.
    argv, env = engine_command(specs["proxima-int4_per_token_head"])
    assert _flag(tuple(argv), "--block-size") == "1" and env["PROXIMA_ALLOCATOR"] == "token"


def test_cuda_specs_run_graphs_stock_per_token_head_on_triton_and_proxima_as_serve_does():
    params = RunParams(model="/m", cuda=True)
    specs = {c.name: engine_spec(c, params) for c in configurations(cuda=True)}
    for name, spec in specs.items():
        assert "--enforce-eager" not in spec.args and "--block-size" not in spec.args
        per_token_head = name.endswith("per_token_head")
        expected = "TRITON_ATTN" if per_token_head and name.startswith("stock") else None
        assert _flag(spec.args, "--attention-backend") == expected
    # On CUDA `proxima serve`'s command builder adds the CUSTOM backend and FULL graphs.
    served = build_serve_command("/m", "token", list(specs["proxima-int4_per_token_head"].args), cuda=True)
    assert _flag(tuple(served.argv), "--attention-backend") == "CUSTOM"
    assert json.loads(_flag(tuple(served.argv), "--compilation-config")) == {
        "cudagraph_mode": "FULL", "max_cudagraph_capture_size": GRAPH_TOKENS}


def test_wanted_comparisons():
    names = ["proxima-auto", "proxima-fp8", "proxima-int4_per_token_head", "stock-auto", "stock-fp8"]
    assert wanted_comparisons(names) == [
        ("proxima-auto", "stock-auto"),
        ("proxima-fp8", "proxima-auto"), ("proxima-fp8", "stock-auto"), ("proxima-fp8", "stock-fp8"),
        ("proxima-int4_per_token_head", "proxima-auto"), ("proxima-int4_per_token_head", "stock-auto"),
        ("stock-fp8", "stock-auto")]
    # A reference that did not run leaves its comparisons out.
    assert wanted_comparisons(["proxima-fp8", "stock-fp8"]) == [("proxima-fp8", "stock-fp8")]


def _passage(token_ids: list[int], dists: list[dict[int, float]]) -> ScoredPassage:
    ids, lps, offsets = [], [], [0]
    for d in dists:
        ids += list(d)
        lps += [math.log(p) for p in d.values()]
        offsets.append(len(ids))
    return ScoredPassage(np.array(token_ids), np.array(ids), np.array(lps, dtype=np.float32),
                         np.array(offsets))


def _measurement(name: str, p_first: float, answers: list[list[int]]) -> EngineMeasurement:
    # Three positions; the first one's distribution is the engine's knob, the others are fixed.
    dists = [{5: p_first, 6: 1 - p_first}, {6: 0.5, 7: 0.25}, {7: 0.9, 8: 0.1}]
    return EngineMeasurement(config=CONFIGS_BY_NAME[name], passages=[_passage([4, 5, 6, 7], dists)],
                             answers=answers, answer_texts=[str(a) for a in answers],
                             bytes_per_token=1000.0, preemptions=None, start_s=1.0, score_s=2.0, chat_s=3.0)


def test_assemble_figures_table_and_record(tmp_path):
    runs = {"proxima-auto": _measurement("proxima-auto", 0.8, [[1, 2, 3], [4, 5]]),
            "proxima-int4_per_token_head": _measurement("proxima-int4_per_token_head", 0.4,
                                                        [[1, 2, 0], [4, 5]])}
    report = assemble(runs)
    ref, test = report.configs
    # Perplexity pooled over the three positions' actual tokens (5, 6, 7).
    assert ref.perplexity == pytest.approx(math.exp(-(math.log(0.8) + math.log(0.5) + math.log(0.9)) / 3))
    assert ref.num_positions == 3 and ref.num_chats == 2
    (c,) = report.comparisons
    assert (c.test, c.reference) == ("proxima-int4_per_token_head", "proxima-auto")
    first_kl = 0.8 * math.log(0.8 / 0.4) + 0.2 * math.log(0.2 / 0.6)
    assert c.kl.mean == pytest.approx(first_kl / 3, rel=1e-5) and c.kl.num_positions == 3
    # The first position's top token flips from 5 to 6; the others agree.
    assert c.num_top1_equal == 2 and c.top1_share == pytest.approx(2 / 3)
    assert c.greedy.num_identical == 1 and c.greedy.num_prompts == 2

    table = render_table(report)
    assert table.count("\n") == 3  # header, rule, one row per configuration here
    assert "| proxima-int4_per_token_head | 1,000 |" in table and "| 1 / 2 |" in table and "66.67%" in table

    record = to_json(report, answers={n: m.answer_texts for n, m in runs.items()}, command="x")
    path = tmp_path / "deep" / "run.json"
    write_json(path, record)
    back = json.loads(path.read_text())
    assert back["command"] == "x" and back["comparisons"][0]["top1_equal"] == 2
    assert back["configs"]["proxima-auto"]["timings"] == {"start_s": 1.0, "score_s": 2.0, "chat_s": 3.0}
    assert back["answers"]["proxima-int4_per_token_head"] == ["[1, 2, 0]", "[4, 5]"]
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]  # no temporary file left


def test_assemble_refuses_runs_over_different_text():
    a = _measurement("proxima-auto", 0.8, [[1]])
    first = a.passages[0]
    other = ScoredPassage(np.array([4, 5, 7, 8]), first.token_ids, first.logprobs, first.offsets)
    b = dataclasses.replace(_measurement("stock-auto", 0.8, [[1]]), passages=[other])
    with pytest.raises(ValueError, match="not the same token sequence"):
        assemble({"proxima-auto": a, "stock-auto": b})


def test_an_engine_with_nan_logprobs_fails_alone(tmp_path, monkeypatch):
    """One engine answering NaN prompt logprobs (stock CPU fp8 KV did, at 448-token prefill chunks) is
    that engine's failure, named; the run goes on, and the others' figures are reported."""
    good = _measurement("stock-auto", 0.8, [[1]])
    bad = _measurement("stock-fp8", 0.8, [[1]])
    first = bad.passages[0]
    nan_logprobs = first.logprobs.copy()
    nan_logprobs[0] = np.nan
    bad = dataclasses.replace(bad, passages=[dataclasses.replace(first, logprobs=nan_logprobs)])
    with pytest.raises(ValueError, match="not a log probability: nan"):
        check_measurement(bad)
    check_measurement(good)
    script = _script()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    runs = {"stock-auto": good, "stock-fp8": bad}
    monkeypatch.setattr(script, "run_isolated", lambda measure, config, *a, **k: runs[config.name])
    out = tmp_path / "run.json"
    assert script.main(["--model", str(model), "--device", "cpu", "--configs", "stock-fp8",
                        "--json", str(out)]) == 1
    record = json.loads(out.read_text())
    assert list(record["configs"]) == ["stock-auto"] and record["complete"]
    assert "not a log probability: nan" in record["failures"]["stock-fp8"]


def test_script_parses_help_and_sizes_a_quick_run(capsys):
    script = _script()
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--help"])
    assert exit_info.value.code == 0 and "--quick" in capsys.readouterr().out
    quick = script.run_params(script.parse_args(["--quick", "--chats", "8"]), cuda=False)
    assert (quick.num_passages, quick.passage_chars, quick.num_chats,
            quick.max_new_tokens) == (4, 1200, 8, 32)
    full = script.run_params(script.parse_args(["--device", "cuda"]), cuda=True)
    assert full.num_chats == 120 and full.num_passages == script.DEFAULTS["num_passages"] and full.cuda


def test_script_refuses_a_missing_model_and_a_config_the_device_lacks(tmp_path, capsys):
    script = _script()
    assert script.main(["--model", str(tmp_path)]) == 2
    assert "proxima model smol" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert script.main(["--model", str(tmp_path), "--device", "cpu",
                        "--configs", "stock-int4_per_token_head"]) == 2
    assert "only on CUDA" in capsys.readouterr().err


def test_config_names_and_references():
    config = AccuracyConfig("stock", "int4_per_token_head", cuda_only=True)
    assert config.name == "stock-int4_per_token_head" and config.reference == "stock-auto"
    with pytest.raises(ValueError):
        RunParams(model="/m", num_chats=0)
