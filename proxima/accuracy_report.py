"""The accuracy benchmark's figures, from the engines' raw measurements: which configurations are
compared with which, the figures of each comparison, the table and the JSON record.

Layer: tools, pure: no vLLM, no engine. Input: one `accuracy_engines.EngineMeasurement` per
configuration that ran; output: an immutable `AccuracyReport` that `render_table` and `to_json`
read (the script prints one and writes the other, nothing else). The formulas are
`proxima.accuracy`'s.

Comparisons (test against reference), for every configuration present:
  - each configuration against its own engine at KV `auto` (what the dtype costs in that engine);
  - each Proxima configuration against stock `auto` (what it costs against what users run);
  - each Proxima configuration against stock at the same dtype, where stock ran it: the same
    quantisation should give the same figures within the noise of two attention kernels, which
    `proxima-auto` against `stock-auto` measures.
A comparison whose reference did not run is left out (a failed engine is reported, not hidden).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from proxima.accuracy import (
    Agreement,
    KLSummary,
    PositionLogprobs,
    from_vllm,
    greedy_agreement,
    kl_summary,
    perplexity,
    top1_agreement,
)
from proxima.accuracy_engines import AUTO, EngineMeasurement


@dataclass(frozen=True, slots=True)
class ConfigFigures:
    name: str
    engine: str
    kv_cache_dtype: str
    bytes_per_token: float | None
    perplexity: float
    num_positions: int
    num_chats: int
    preemptions: int | None
    timings: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Comparison:
    test: str
    reference: str
    kl: KLSummary
    num_top1_equal: int
    greedy: Agreement

    @property
    def top1_share(self) -> float:
        return self.num_top1_equal / self.kl.num_positions


@dataclass(frozen=True, slots=True)
class AccuracyReport:
    configs: tuple[ConfigFigures, ...]
    comparisons: tuple[Comparison, ...]

    def config(self, name: str) -> ConfigFigures:
        return next(c for c in self.configs if c.name == name)


def wanted_comparisons(names: list[str]) -> list[tuple[str, str]]:
    """(test, reference) pairs among the configurations `names` (see the module docstring)."""
    present = set(names)
    pairs: list[tuple[str, str]] = []
    for name in names:
        engine, dtype = name.split("-", 1)
        candidates = [f"{engine}-{AUTO}"]
        if engine == "proxima":
            candidates += [f"stock-{AUTO}", f"stock-{dtype}"]
        for reference in dict.fromkeys(candidates):  # ordered, without repeats
            if reference != name and reference in present:
                pairs.append((name, reference))
    return pairs


def assemble(measurements: Mapping[str, EngineMeasurement]) -> AccuracyReport:
    """Every configuration's figures and every wanted comparison's, in `measurements`' order."""
    scored = {name: _positions(m) for name, m in measurements.items()}
    configs = tuple(
        ConfigFigures(name=name, engine=m.config.engine, kv_cache_dtype=m.config.kv_cache_dtype,
                      bytes_per_token=m.bytes_per_token, perplexity=perplexity(scored[name]),
                      num_positions=sum(len(p) for p in scored[name]), num_chats=len(m.answers),
                      preemptions=m.preemptions, timings=m.timings())
        for name, m in measurements.items())
    comparisons = []
    for test, reference in wanted_comparisons(list(measurements)):
        equal, _ = top1_agreement(scored[reference], scored[test])
        comparisons.append(Comparison(
            test=test, reference=reference, kl=kl_summary(scored[reference], scored[test]),
            num_top1_equal=equal,
            greedy=greedy_agreement(measurements[reference].answers, measurements[test].answers)))
    return AccuracyReport(configs=configs, comparisons=tuple(comparisons))


def check_measurement(m: EngineMeasurement) -> None:
    """ValueError naming what is wrong when one engine's prompt logprobs cannot be scored (NaN,
    positive, malformed): that engine failed, and the others' figures still stand."""
    _positions(m)


def _positions(m: EngineMeasurement) -> list[list[PositionLogprobs]]:
    return [from_vllm(p.prompt_token_ids.tolist(), p.positions()) for p in m.passages]


def render_table(report: AccuracyReport) -> str:
    """A Markdown table: one row per comparison, each configuration's own figures on its first row."""
    head = ("| configuration | KV bytes/token | perplexity | against | Δ perplexity | KL mean | KL p99 "
            "| top-1 equal | greedy answers equal | answer prefix equal |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for config in report.configs:
        own = [c for c in report.comparisons if c.test == config.name]
        first = [config.name, _int(config.bytes_per_token), f"{config.perplexity:.4f}"]
        if not own:
            lines.append("| " + " | ".join(first + ["—"] + [""] * 6) + " |")
        for index, c in enumerate(own):
            ref = report.config(c.reference)
            cells = (first if index == 0 else ["", "", ""]) + [
                c.reference, f"{config.perplexity / ref.perplexity - 1:+.2%}", f"{c.kl.mean:.3g}",
                f"{c.kl.p99:.3g}", f"{c.top1_share:.2%}",
                f"{c.greedy.num_identical} / {c.greedy.num_prompts}", f"{c.greedy.mean_common_prefix:.1%}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _int(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def to_json(report: AccuracyReport, answers: Mapping[str, list[str]] | None = None, **facts) -> dict:
    """The run's record: `facts` (command, model, parameters, durations), every configuration's
    figures, every comparison's, and optionally each configuration's answers as text."""
    configs = {c.name: {k: v for k, v in asdict(c).items() if k != "name"} | {"timings": dict(c.timings)}
               for c in report.configs}
    comparisons = [{"test": c.test, "reference": c.reference, "kl": asdict(c.kl),
                    "top1_equal": c.num_top1_equal, "top1_share": c.top1_share,
                    "greedy": asdict(c.greedy) | {"share_identical": c.greedy.share_identical}}
                   for c in report.comparisons]
    out = {**facts, "configs": configs, "comparisons": comparisons}
    if answers is not None:
        out["answers"] = dict(answers)
    return _finite(out)


def _finite(value):
    """JSON has no NaN or infinity: write them as null rather than an unreadable file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` whole or not at all: a temporary file beside it, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
