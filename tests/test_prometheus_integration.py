"""Every dashboard query and every alert rule, evaluated by a real Prometheus scraping real servers.

One Prometheus (the `prometheus` binary, started here on a free loopback port with its TSDB in
a temp dir, no service manager) scrapes a Proxima server and a stock vLLM server every second
and evaluates the alert rules every second, while completions run against both for ~18 s.
Then, at one fixed evaluation time:

- dashboards: every target of every panel, with Grafana's variables substituted, must return
  series. Against the stock server, exactly the targets that read `proxima_*` metrics (those
  whose panel carries the "needs Proxima" note) must come back empty.
- alert rules: Prometheus itself loaded and evaluated them (all healthy); each rule's full
  expression is valid, and each condition's *signal* (the measured side, without its threshold,
  see dashboards/alerts.py) returns series for the Proxima server. Thresholds are not crossed
  on demand here; promtool's unit tests (test_alerts.py) prove the firing logic.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("grafana_foundation_sdk", reason="pip install grafana-foundation-sdk (test extra)")

from dashboards import alerts, panels, promql  # noqa: E402 (after the sys.path set-up above)
from proxima.metrics import catalog as c  # noqa: E402
from proxima.scrape import scrape_sync  # noqa: E402
from proxima.server_process import free_port  # noqa: E402

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="prometheus not installed: run scripts/prometheus.sh (CI does)"),
]

logger = logging.getLogger(__name__)
GRAFANA = ROOT / "dashboards" / "grafana"
RULES = ROOT / "dashboards" / "prometheus" / "proxima-alerts.yml"
TRAFFIC_S = 18.0
MAX_REQUESTS_PER_SERVER = 500
CONCURRENCY = 4
# Grafana would pick max(4 x scrape interval, step + scrape interval); 15 s of 1 s scrapes
# lies inside the traffic window, so rates and quantiles see requests.
RATE_INTERVAL = "15s"
VARIABLE = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")
LABEL_VALUES = re.compile(r"^label_values\((.+), (\w+)\)$")


@dataclass(frozen=True, slots=True)
class Scraped:
    url: str
    proxima_instance: str
    stock_instance: str
    model: str
    at: float  # evaluation time: the end of the traffic

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/query",
                             params={"query": expr, "time": at or self.at}, timeout=30)
        body = response.json()
        assert body.get("status") == "success", f"{expr}\n-> {body.get('error', body)}"
        return body["data"]["result"]


def _instance(server) -> str:
    return server.url.removeprefix("http://")


def _config(tmp: Path, targets: list[str]) -> Path:
    lines = [
        "global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "  evaluation_interval: 1s",
        "rule_files:", f"  - {RULES}",
        "scrape_configs:", "  - job_name: vllm", "    static_configs:", "      - targets:",
        *(f"          - {t}" for t in targets),
    ]
    path = tmp / "prometheus.yml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"prometheus not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def _wait_scraped(url: str, instances: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = httpx.get(f"{url}/api/v1/query", params={"query": "up == 1"}, timeout=5).json()
        up = {r["metric"]["instance"] for r in result["data"]["result"]}
        if set(instances) <= up:
            return
        time.sleep(0.5)
    raise RuntimeError(f"prometheus did not scrape {instances} within {timeout:.0f}s")


def _wait_counted(url: str, finished: dict[str, float], timeout: float = 60.0) -> None:
    """Until Prometheus's latest sample of each instance's finished requests is the server's own."""
    deadline = time.monotonic() + timeout
    query = f"sum by (instance) ({c.Vllm.REQUEST_SUCCESS})"
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        result = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5).json()
        seen = {r["metric"]["instance"]: float(r["value"][1]) for r in result["data"]["result"]}
        if all(seen.get(i, 0.0) >= n for i, n in finished.items()):
            return
        time.sleep(0.5)
    raise RuntimeError(f"prometheus did not scrape the finished requests within {timeout:.0f}s: "
                       f"has {seen}, servers {finished}")


async def _drive(servers: list[str], model: str) -> dict[str, int]:
    """Completions against every server until TRAFFIC_S passes (bounded in count and time)."""
    sent = {url: 0 for url in servers}
    done = {url: 0 for url in servers}
    deadline = time.monotonic() + TRAFFIC_S

    async def worker(client: httpx.AsyncClient, url: str, index: int) -> None:
        while time.monotonic() < deadline and sent[url] < MAX_REQUESTS_PER_SERVER:
            sent[url] += 1  # counted before the await, so the workers never pass the cap
            prompt = " ".join(["the quick brown fox"] * (1 + (index + sent[url]) % 6))
            response = await client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0})
            response.raise_for_status()
            done[url] += 1

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(worker(client, url, i) for url in servers for i in range(CONCURRENCY)))
    return done


@pytest.fixture(scope="module")
def scraped(proxima_server, stock_server, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    instances = [_instance(proxima_server), _instance(stock_server)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "prometheus.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [shutil.which("prometheus"), f"--config.file={_config(tmp, instances)}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    try:
        _wait_ready(url, proc, log)
        _wait_scraped(url, instances)
        done = asyncio.run(_drive([proxima_server.url, stock_server.url], tiny_model))
        assert all(n > 0 for n in done.values()), done
        # Evaluate once Prometheus holds every finished request: on two loaded cores a scrape of a
        # busy server can pass its 1 s timeout, so the last sample may come well after the traffic.
        _wait_counted(url, {i: scrape_sync(s.url).requests_finished_total
                            for i, s in zip(instances, (proxima_server, stock_server), strict=True)})
        at = time.time()
        time.sleep(1.5)  # one more scrape and rule evaluation at or after `at`
        logger.info("prometheus up, scraped and driven in %.1f s; requests %s",
                    time.monotonic() - started, done)
        yield Scraped(url, instances[0], instances[1], tiny_model, at)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's interpolation for the variables these dashboards use; unknown ones fail."""
    def one(match: re.Match) -> str:
        name = match.group(1)
        assert name in values, f"no test value for ${name} in {expr}"
        return values[name]

    return VARIABLE.sub(one, expr)


def dashboard_targets() -> list[tuple[str, dict, dict]]:
    found = []
    for path in sorted(GRAFANA.glob("*.json")):
        found.extend((path.name, p, t) for p, t in panels.panel_targets(panels.load(path)))
    assert len(found) >= 40
    return found


def _series_for(result: list[dict], instance: str | None) -> list[dict]:
    # Aggregations like sum(...) drop `instance`; those queries select one instance already.
    return [r for r in result if instance is None or r["metric"].get("instance", instance) == instance]


def test_every_dashboard_query_returns_data_for_proxima(scraped):
    values = {"instance": scraped.proxima_instance, "instance_a": scraped.proxima_instance,
              "instance_b": scraped.proxima_instance, "model_name": scraped.model,
              "__rate_interval": RATE_INTERVAL}
    empty = []
    for name, panel, target in dashboard_targets():
        if not scraped.query(substitute(target["expr"], values)):
            empty.append(f"{name} / {panel['title']} / {target['refId']}: {target['expr']}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_on_stock_vllm_only_the_proxima_marked_queries_are_empty(scraped):
    """$instance (and the A/B baseline $instance_b) pointed at stock vLLM."""
    values = {"instance": scraped.stock_instance, "instance_a": scraped.proxima_instance,
              "instance_b": scraped.stock_instance, "model_name": scraped.model,
              "__rate_interval": RATE_INTERVAL}
    wrong, empties = [], 0
    for name, panel, target in dashboard_targets():
        expr = target["expr"]
        reads_stock = "$instance_a" not in expr
        expect_empty = reads_stock and promql.needs_proxima(expr)
        got = scraped.query(substitute(expr, values))
        if expect_empty:
            empties += 1
            assert panels.NEEDS_PROXIMA in panel["description"] or \
                panels.PARTLY_PROXIMA in panel["description"], panel["title"]
        if bool(got) == expect_empty:
            wrong.append(f"{name} / {panel['title']} / {target['refId']}: expected "
                         f"{'no data' if expect_empty else 'data'}: {expr}")
    assert not wrong, "\n".join(wrong)
    assert empties >= 15, "the KV memory dashboard is mostly Proxima-only"


def test_dashboard_variables_list_both_servers_and_the_model(scraped):
    for path in sorted(GRAFANA.glob("*.json")):
        for variable in panels.load(path)["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = LABEL_VALUES.match(variable["query"])
            assert match, variable["query"]
            selector = substitute(match.group(1), {"model_name": scraped.model})
            response = httpx.get(f"{scraped.url}/api/v1/label/{match.group(2)}/values",
                                 params={"match[]": selector, "start": scraped.at - 60,
                                         "end": scraped.at}, timeout=10).json()
            listed = set(response["data"])
            if match.group(2) == "instance":
                assert {scraped.proxima_instance, scraped.stock_instance} <= listed, path.name
            else:
                assert listed == {scraped.model}, path.name


def test_prometheus_loaded_and_evaluated_every_rule(scraped):
    groups = httpx.get(f"{scraped.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r.name for r in alerts.RULES}
    for name, rule in loaded.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
        assert rule["annotations"]["runbook_url"].startswith("runbooks/")


@pytest.mark.parametrize("rule", alerts.RULES, ids=lambda r: r.name)
def test_alert_expression_is_valid_and_its_signals_have_data(scraped, rule):
    scraped.query(rule.expr)  # asserts Prometheus accepted it
    for signal_expr in rule.signals:
        result = scraped.query(signal_expr)
        assert _series_for(result, scraped.proxima_instance), f"{rule.name}: no data for {signal_expr}"


def test_prometheus_sees_what_the_scrape_layer_sees(scraped, proxima_server):
    snapshot = scrape_sync(proxima_server.url)
    assert snapshot.ok and snapshot.proxima is not None
    slots = scraped.query(f'{c.SLOTS_TOTAL.name}{{instance="{scraped.proxima_instance}"}}')
    assert float(slots[0]["value"][1]) == snapshot.proxima.slots_total > 0
    finished = scraped.query(
        f'sum(increase({c.Vllm.REQUEST_SUCCESS}{{instance="{scraped.proxima_instance}"}}[1m]))')
    assert float(finished[0]["value"][1]) > 0
    latency = scraped.query(f'sum({c.ALLOCATOR_LATENCY.name}_count{{op="step", '
                            f'instance="{scraped.proxima_instance}"}})')
    assert float(latency[0]["value"][1]) > 0
