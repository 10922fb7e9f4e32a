"""Grafana dashboards and Prometheus alert rules for Proxima, generated from the metrics catalog.

Not an installed package: a build tool run from the repository root
(`python -m dashboards.generate`), whose outputs are committed:
  dashboards/grafana/*.json                      Grafana 11 dashboards
  dashboards/prometheus/proxima-alerts.yml       alert rules
  dashboards/prometheus/proxima-alerts.test.yml  promtool unit tests for those rules

Layers: `promql` writes expressions from catalog specs (no metric name is spelled here),
`panels` wraps grafana-foundation-sdk builders (stable ids, the "needs Proxima" note),
`kv_memory`/`serving`/`ab` compose dashboards, `alerts` defines the rules and
`alert_tests` their promtool scenarios; `generate` writes everything deterministically.
"""

# Where the runbook links in dashboards and alerts point (relative to the repository, unless
# `generate --runbook-base` says otherwise); defined here, the one place both read.
DEFAULT_RUNBOOK_BASE = "runbooks/"
