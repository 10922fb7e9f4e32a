"""e2e.py's summary: greedy agreement between engines, throughput, and where a step's time went.

Reads the per-engine JSON files `kit.e2e.run` wrote; pure Python (no GPU, no vLLM). A stored run
is summarised again, with what this summary prints today, by
`python3 scripts/gpu/kit/e2e_report.py DIR [DIR...]` (e.g. docs/results/h100-2026-12-07b/e2e-chats).

Several folders are several starts of the same engines (`e2e.py --starts N` writes start1/,
start2/, ...; or one folder per device call): a burst's tok/s moves more between two starts of one
engine than between repeats in one start (docs/results/h100-2026-12-07c: Proxima's short-chat
medians 5,969 and 6,995 in two starts, each start's repeats within 3%), so a tok/s ratio needs
starts, paired in time.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(out_dir: Path, engines) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in out_dir.glob("*.json") if p.stem in engines}


def summarize(out_dir: Path, engines) -> None:
    res = load(out_dir, engines)
    for ours, theirs in (("proxima-8g", "stock-triton-8g"), ("proxima-seeded", "stock-triton-seeded"),
                         ("proxima-seeded", "stock-fa3-seeded"), ("stock-fa3-seeded", "stock-triton-seeded"),
                         ("proxima-seeded-fp8", "stock-triton-seeded-fp8"),
                         ("proxima-seeded-fp8", "stock-fa3-seeded-fp8"),
                         ("stock-fa3-seeded-fp8", "stock-triton-seeded-fp8"),
                         ("proxima-seeded-fp8", "proxima-seeded")):
        if ours in res and theirs in res and "greedy" in res[ours]:
            compare_greedy(ours, theirs, res[ours]["greedy"], res[theirs]["greedy"])
    summarize_throughput(res)


def compare_greedy(ours: str, theirs: str, a: list, b: list) -> None:
    same_tokens = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra["tokens"], rb["tokens"]))
    total = sum(len(r["tokens"]) for r in a)
    identical = sum(ra["tokens"] == rb["tokens"] for ra, rb in zip(a, b))
    first_div = [next((i for i, (x, y) in enumerate(zip(ra["tokens"], rb["tokens"])) if x != y), None)
                 for ra, rb in zip(a, b)]
    # Logprobs compared up to (excluding) the first divergence, where both saw the same prefix.
    diffs = [abs(x - y) for ra, rb, d in zip(a, b, first_div)
             for x, y in list(zip(ra["logprobs"], rb["logprobs"]))[: d if d is not None else None]]
    distinct = len({t for r in a for t in r["tokens"]})
    print(f"greedy {ours} vs {theirs}: {distinct} distinct tokens generated; "
          f"{identical}/{len(a)} sequences identical; {same_tokens}/{total} positions equal; "
          f"first divergences at {sorted(x for x in first_div if x is not None)[:10]}; "
          f"max |logprob diff| before divergence {max(diffs, default=0):.4f}, "
          f"mean {sum(diffs) / max(len(diffs), 1):.5f}")


def summarize_throughput(res: dict) -> None:
    bursts = sorted({k for r in res.values() for k in r if k.startswith("tight")}, key=lambda k: (len(k), k))
    for job in ("ample", *bursts):
        for name, r in res.items():
            if job in r:
                j = r[job]
                extra = ""
                if j.get("recorded_steps"):
                    extra = (f"  [telemetry: {j['recorded_steps']} publishes, "
                             f"requests mean {j['requests_mean']:.1f} "
                             f"peak {j['requests_peak']}, slot efficiency {j['slot_efficiency']:.3f}]")
                print(f"{job:>6} {name:<16} tok/s {j['output_tok_s']:>9.0f}  "
                      f"running mean {j['running_mean']:>6.1f} peak {j['running_peak']:>4}  "
                      + (f"while waiting {j['running_mean_while_waiting']:>6.1f} over {j['waiting_steps']} "
                         "steps  " if "waiting_steps" in j else "") +
                      f"preemptions {j['preemptions']:>5}  wall {j['wall_s']:.1f}s "
                      f"init {r['init_s']:.0f}s  wrapper steps {j.get('wrapper_steps')}{extra}"
                      + (f"  int4 decode switch: {r['int4_decode_switch']}"
                         if "int4_decode_switch" in r else ""))
                if "repeat_tok_s" in j:
                    print(f"{'':>6} {name:<16} tok/s of {len(j['repeat_tok_s'])} runs "
                          + " ".join(f"{t:.0f}" for t in j["repeat_tok_s"])
                          + f"  median {j['output_tok_s_median']:.0f}  running mean "
                          + " ".join(f"{m:.1f}" for m in j["repeat_running_mean"]))
                if j.get("steps"):
                    # Runs before 2026-12-08 did not record it: vLLM's default then, min(2 x 512 seqs, 512).
                    print(f"{'':>6} {name:<16} {step_mix(j['steps'], r.get('graph_tokens', 512))}")
                summarize_profile(j)


def step_mix(steps: list, graph_tokens: int) -> str:
    """A burst's steps by kind, from the per-step [running, waiting, tokens, preemptions[, period
    ms]] rows: a step of more than `graph_tokens` (the engine's largest CUDA graph; 0: none) runs
    without graphs. Rows with a period (runs since 2026-12-07) add each kind's mean ms a step."""
    def kind(running: int, tokens: int) -> str:
        if tokens <= running:
            return "decode"
        return "big" if graph_tokens and tokens > max(graph_tokens, running) else "mixed"

    kinds: dict[str, list[list]] = {"decode": [], "mixed": [], "big": []}
    for row in steps:
        kinds[kind(row[0], row[2])].append(row)
    total = sum(row[2] for row in steps)
    decode, mixed, big = (len(kinds[k]) for k in ("decode", "mixed", "big"))
    if not graph_tokens:
        line = (f"steps (no CUDA graphs): {decode} decode-only, {mixed} with prompt tokens; "
                f"{total:,} tokens")
    else:
        line = (f"steps: {decode} decode-only, {mixed} mixed of <= {graph_tokens} tokens, {big} over "
                f"{graph_tokens} (no CUDA graph) scheduling {sum(row[2] for row in kinds['big']):,} of "
                f"{total:,} tokens")
    if steps and all(len(row) > 4 for row in steps):
        labels = ("decode-only", "mixed" if graph_tokens else "with prompt tokens", "over")
        means = [(label, sum(row[4] for row in rows) / len(rows))
                 for label, rows in zip(labels, kinds.values()) if rows]
        line += "; ms a step: " + ", ".join(f"{label} {ms:.1f}" for label, ms in means)
    return line


def summarize_profile(j: dict) -> None:
    steps = max(j.get("wrapper_steps") or 1, 1)
    if "host" in j:
        print(f"         ms per step {1e3 * j['wall_s'] / steps:.2f}; host: " + "; ".join(
            f"{label} {h['ms_per_step']:.2f} ms/step ({h['us_per_call']:.1f} us x {h['calls']})"
            for label, h in j["host"].items()))
    if "kernels" in j:
        k = j["kernels"]
        kinds = ", ".join(f"{kind} {ms / steps:.2f}" for kind, ms in sorted(k["gpu_ms_by_kind"].items()))
        print(f"         GPU ms per step (profiled pass): total {k['gpu_ms_total'] / steps:.2f} = {kinds}; "
              f"profiled wall {k['wall_ms'] / steps:.2f} ms/step")
        for ms, count, kname in k["top_kernels"][:8]:
            print(f"           {ms:9.1f} ms  x{count:<7} {kname}")
    if "cprofile" in j:
        print("         host self time under cProfile (third pass):")
        lines = j["cprofile"].splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        for line in lines[start:start + 26]:
            print("           " + line.replace(str(Path(sys.prefix)), "")[:150])


def burst_tok_s(burst: dict) -> list[float]:
    """Every timed run's tok/s of one burst in one start (one run before repeats were recorded)."""
    return list(burst.get("repeat_tok_s") or [burst["output_tok_s"]])


def faster_starts(ours: list[float], theirs: list[float]) -> str:
    """Whether the first engine is the faster one with starts, not runs, as the unit (a start moves
    tok/s more than the runs within it: docs/results/h100-2026-12-07c): the one-sided Mann-Whitney U
    test over start medians. Its smallest p is 1 / C(n + m, n): 0.33 for two starts of each, 0.05
    for three, 0.014 for four."""
    try:
        from scipy.stats import mannwhitneyu
    except ImportError:  # the GPU machine's stack has no scipy: the folders can be read here
        return "p: needs scipy"
    p = mannwhitneyu(ours, theirs, alternative="greater", method="exact").pvalue
    return f"faster over starts: p = {p:.3f} (one-sided Mann-Whitney U, {len(ours)} against {len(theirs)})"


def summarize_starts(starts: list[dict]) -> None:
    """Each engine's tok/s across starts (each a `load` of one folder), and Proxima's ratio to each
    other engine: of the medians over every run, and start by start (starts run in turn, so start i
    of two engines ran minutes apart). Running requests are a schedule, the same in every start:
    a start that differs is named."""
    names = sorted({name for res in starts for name in res})
    bursts = sorted({k for res in starts for r in res.values() for k in r if k.startswith("tight")},
                    key=lambda k: (len(k), k))
    print(f"over {len(starts)} starts:")
    for key in bursts:
        medians: dict[str, list[float]] = {}
        everything: dict[str, list[float]] = {}
        for name in names:
            found = [res[name][key] for res in starts if key in res.get(name, {})]
            if not found:
                continue
            medians[name] = [statistics.median(burst_tok_s(b)) for b in found]
            everything[name] = [t for b in found for t in burst_tok_s(b)]
            running = sorted({round(b["running_mean"], 1) for b in found})
            print(f"{key:>6} {name:<26} tok/s median {statistics.median(everything[name]):>7.0f} of "
                  f"{len(everything[name])} runs; start medians "
                  + " ".join(f"{m:.0f}" for m in medians[name])
                  + f"; running mean {' / '.join(f'{m:.1f}' for m in running)}"
                  + ("  (differs between starts)" if len(running) > 1 else ""))
        for ours in (n for n in medians if n.startswith("proxima")):
            for theirs in (n for n in medians if not n.startswith("proxima")):
                paired = [a / b for a, b in zip(medians[ours], medians[theirs])]
                ratio = statistics.median(everything[ours]) / statistics.median(everything[theirs])
                print(f"{key:>6} {ours} / {theirs}: {ratio:.2f}x; start by start "
                      + " ".join(f"{r:.2f}" for r in paired) + "; "
                      + faster_starts(medians[ours], medians[theirs]))


def main(folders: list[Path]) -> None:
    engines = {p.stem for folder in folders for p in folder.glob("*.json")}
    if len(folders) == 1:
        summarize(folders[0], engines)
    else:
        summarize_starts([load(folder, engines) for folder in folders])


if __name__ == "__main__":
    given = [Path(a) for a in sys.argv[1:]]
    if not given or not all(p.is_dir() for p in given):
        sys.exit("usage: python3 scripts/gpu/kit/e2e_report.py DIR [DIR...] (folders of e2e.py's JSON "
                 "files; several: one start of the engines each)")
    main(given)
