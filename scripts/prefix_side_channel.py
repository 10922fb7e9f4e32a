"""The prefix-cache side channel, run as an attacker would: can one client read another's prompt?

A victim sends `known + [secret] + rest` (token ids). An attacker who knows `known` sends
`known + [guess] + filler` for the secret and many wrong guesses, max_tokens 1, one at a time,
and after each reads everything a client can read: every series of `/metrics` (open without the
API key, as vLLM leaves it), the usage block (`cached_tokens` under
`--enable-prompt-tokens-details`), and the time to first token. A channel "tells the secret
apart" when the secret's reading differs from every wrong guess's while the wrong guesses agree.

Series that describe the attacker's own exchange or the machine, not the cache, are left out:
HTTP server statistics (`http_*`: its own request and response sizes, scrape counts), process and
Python runtime series, and every latency (`*_seconds`): time is measured separately, as TTFT,
by how often the secret is the fastest of an attack's probes (a binomial test against chance).

  python scripts/prefix_side_channel.py http://127.0.0.1:8000 --model DIR [--api-key K] [--timing 30]

tests/test_prefix_side_channel.py runs `attack` against `proxima serve` (block-granular figures,
the default: nothing tells the secret apart) and with --proxima-exact-kv-figures (it leaks).
docs/security.md records the figures.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

_IGNORED_PREFIXES = ("http_", "process_", "python_")
_IDLE_SERIES = ("vllm:num_requests_running", "proxima_kv_requests_holding_slots")


@dataclass
class Reading:
    """What one probe changed, as the attacker sees it."""

    metrics: dict[str, float]  # series -> change over the probe
    cached_tokens: int | None
    ttft_s: float


@dataclass
class AttackReport:
    secret: Reading
    wrong: list[Reading]
    # Channels (a series, "cached_tokens") whose reading tells the secret from every wrong guess.
    leaking: list[str] = field(default_factory=list)
    # Channels whose readings vary among the wrong guesses themselves (noise, not a verdict).
    unstable: list[str] = field(default_factory=list)


def series(text: str) -> dict[str, float]:
    """Every sample of an exposition but the ignored families, keyed by name and labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(_IGNORED_PREFIXES) or family.name.endswith("_seconds"):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def settled(client: httpx.Client, url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics once the server is idle and two reads in a row agree (the engine publishes its
    figures on the idle step after the last request)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        now = series(client.get(f"{url}/metrics").text)
        idle = all(v == 0 for k, v in now.items() if k.split("{")[0] in _IDLE_SERIES)
        if idle and now == last:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/metrics did not settle within {timeout_s:.0f} s")
        last = now
        time.sleep(0.1)


def complete(client: httpx.Client, url: str, model: str, prompt: list[int]) -> tuple[int | None, float]:
    """Send one greedy 1-token completion; its cached_tokens (None if not reported) and TTFT."""
    start = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    ttft = time.perf_counter() - start
    r.raise_for_status()
    details = r.json().get("usage", {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens"), ttft


def attack(url: str, model: str, *, num_wrong: int = 48, known_len: int = 24, rest_len: int = 12,
           filler_len: int = 12, vocab: tuple[int, int] = (3, 500), api_key: str | None = None,
           attacker_key: str | None = None, seed: int = 0) -> AttackReport:
    """Plant a secret after `known_len` known tokens, then probe it and `num_wrong` wrong guesses."""
    rng = random.Random(seed)
    lo, hi = vocab
    pool = rng.sample(range(lo, hi), num_wrong + 1 + known_len + rest_len + filler_len)
    secret, guesses = pool[0], pool[1:num_wrong + 1]
    known = pool[num_wrong + 1:num_wrong + 1 + known_len]
    rest = pool[num_wrong + 1 + known_len:num_wrong + 1 + known_len + rest_len]
    filler = pool[-filler_len:]
    victim = httpx.Client(timeout=120, headers=_auth(api_key))
    attacker = httpx.Client(timeout=120, headers=_auth(attacker_key or api_key))
    with victim, attacker:
        complete(victim, url, model, known + [secret] + rest)
        order = guesses + [secret]
        rng.shuffle(order)
        readings: dict[int, Reading] = {}
        before = settled(attacker, url)
        for guess in order:
            cached, ttft = complete(attacker, url, model, known + [guess] + filler)
            after = settled(attacker, url)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}
            readings[guess] = Reading({k: v for k, v in delta.items() if v}, cached, ttft)
            before = after
    report = AttackReport(readings[secret], [readings[g] for g in guesses])
    channels = {k for r in readings.values() for k in r.metrics} | {"cached_tokens"}
    for channel in sorted(channels):
        wrong = {_value(r, channel) for r in report.wrong}
        if len(wrong) > 1:
            report.unstable.append(channel)
        elif _value(report.secret, channel) not in wrong:
            report.leaking.append(channel)
    return report


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def _value(reading: Reading, channel: str) -> float | None:
    return reading.cached_tokens if channel == "cached_tokens" else reading.metrics.get(channel, 0.0)


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key")
    ap.add_argument("--wrong", type=int, default=48, help="wrong guesses per attack")
    ap.add_argument("--timing", type=int, default=0,
                    help="repeat the attack N times with fresh secrets and test the TTFT difference")
    args = ap.parse_args()
    report = attack(args.url, args.model, num_wrong=args.wrong, api_key=args.api_key)
    print(f"channels that tell the secret apart: {', '.join(report.leaking) or 'none'}")
    if report.unstable:
        print(f"channels that vary among wrong guesses (noise): {', '.join(report.unstable)}")
    if args.timing:
        secret_ttft, wrong_ttft, hits = [], [], 0
        for seed in range(1, args.timing + 1):
            r = attack(args.url, args.model, num_wrong=args.wrong, api_key=args.api_key, seed=seed)
            secret_ttft.append(r.secret.ttft_s)
            wrong_ttft.extend(w.ttft_s for w in r.wrong)
            # The attacker's best timing guess: the fastest probe.
            hits += min([r.secret, *r.wrong], key=lambda x: x.ttft_s) is r.secret
        chance = 1 / (args.wrong + 1)
        p = binomial_tail(hits, args.timing, chance)
        print(f"TTFT over {args.timing} attacks: secret median "
              f"{statistics.median(secret_ttft) * 1e3:.2f} ms, "
              f"wrong guesses' median {statistics.median(wrong_ttft) * 1e3:.2f} ms; the fastest probe was "
              f"the secret in {hits}/{args.timing} attacks (chance {args.timing * chance:.1f}; "
              f"P(at least {hits} by chance) = {p:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
