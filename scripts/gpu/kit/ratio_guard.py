"""The attention regression guard: Proxima/FA3 time ratios of one GPU run against recorded ones.

Ratios, not times: FA3 runs in the same process on the same data, so a ratio carries over between
H200s whose clocks differ by a few percent, where raw microseconds do not. It does not carry over
between GPU models (an H100's HBM3 slows FA3's reads more than Proxima's int4 loop, which is bound
by latency), so the file keeps one record per device name and a run is judged against its own
device's record; a device with none fails, naming the command that records it. A case regresses when
its ratio exceeds the recorded one by more than the tolerance (10%); a case measured now but not
recorded is reported as new, and one recorded but missing now fails (a shape no longer measured
is a shape no longer guarded). `scripts/gpu/bench_mixed.py --guard FILE` runs this; `--record
FILE` writes the ratios of a run; `--include FP8.json` adds bench_fp8.py's decode grid,
`--include PTH.json` bench_pth.py's int4 grid (against stock's int4 kernel and FA3 over bf16).
Pure Python: tested on CPU (tests/test_gpu_ratio_guard.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from proxima.files import write_atomic

TOLERANCE = 0.10


@dataclass(frozen=True, slots=True)
class Verdict:
    case: str
    measured: float | None
    recorded: float | None

    @property
    def status(self) -> str:
        if self.recorded is None:
            return "new"
        if self.measured is None or not math.isfinite(self.measured):
            return "missing"
        return "slower" if self.measured > self.recorded * (1 + TOLERANCE) else "ok"


def ratios(result: dict) -> dict[str, float]:
    """Case name -> Proxima/FA3 time ratio, from bench_mixed's JSON (cases lacking either are left out)."""
    out: dict[str, float] = {}

    def put(name: str, px: float | None, fa3: float | None) -> None:
        if px and fa3:
            out[name] = round(px / fa3, 3)

    for r in result.get("mixed", []):
        put(f"eager: {r['case']}", r.get("proxima_attn_us"), r.get("fa3_attn_us"))
        put(f"graph: {r['case']}", r.get("proxima_graph_us"), r.get("fa3_graph_us"))
    for r in result.get("graph_decode", []):
        put(f"graph decode {r['batch']} x {r['context']}", r.get("proxima_graph_us"), r.get("fa3_graph_us"))
    for r in result.get("fp8_graph_decode", []):  # bench_fp8.py's, against FA3 fp8
        put(f"fp8 graph decode {r['batch']} x {r['context']}", r.get("proxima_fp8_graph_us"),
            r.get("fa3_fp8_graph_us"))
    for r in result.get("pth_decode", []):  # bench_pth.py's: int4 against stock int4 (TRITON_ATTN)
        put(f"int4 graph decode {r['batch']} x {r['context']} (vs stock int4)",
            r.get("proxima_int4_graph_us"), r.get("stock_int4_graph_us"))
        # and against FA3 over bf16, the "0.6x FA3" target
        put(f"int4 graph decode {r['batch']} x {r['context']} (vs FA3 bf16)",
            r.get("proxima_int4_graph_us"), r.get("fa3_bf16_graph_us"))
    return out


def judge(measured: dict[str, float], recorded: dict[str, float]) -> list[Verdict]:
    names = list(recorded) + [n for n in measured if n not in recorded]
    return [Verdict(n, measured.get(n), recorded.get(n)) for n in names]


def report(verdicts: list[Verdict]) -> tuple[str, bool]:
    """A table of every case and whether the run passes (nothing slower, nothing missing)."""
    lines = [f"{'case':<64} {'ratio':>7} {'recorded':>8}  verdict"]
    for v in verdicts:
        measured = f"{v.measured:7.2f}" if v.measured is not None else f"{'-':>7}"
        recorded = f"{v.recorded:8.2f}" if v.recorded is not None else f"{'-':>8}"
        lines.append(f"{v.case:<64} {measured} {recorded}  {v.status}")
    failed = [v for v in verdicts if v.status in ("slower", "missing")]
    lines.append(f"{len(failed)} of {len(verdicts)} cases more than {TOLERANCE:.0%} worse than recorded or "
                 "missing" if failed else
                 f"all {len(verdicts)} cases within {TOLERANCE:.0%} of the recorded ratios")
    return "\n".join(lines), not failed


def load(path: Path, device: str) -> dict[str, float] | None:
    """The ratios recorded for `device` (torch.cuda.get_device_name()), None if it has none."""
    record = json.loads(Path(path).read_text())["devices"].get(device)
    return None if record is None else record["ratios"]


def save(path: Path, device: str, measured: dict[str, float], note: str) -> None:
    """`device`'s record replaced by this run's ratios; other devices' records kept."""
    path = Path(path)
    devices = json.loads(path.read_text())["devices"] if path.exists() else {}
    devices[device] = {"note": note, "ratios": measured}
    write_atomic(path, json.dumps({"devices": devices}, indent=1) + "\n")
