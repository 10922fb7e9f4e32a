"""Thin layer over grafana-foundation-sdk: panels, variables and dashboards with stable ids.

Why a layer: every panel of every Proxima dashboard shares the same data source variable, the
same legend/tooltip conventions and one rule that must never drift from the queries: a panel
whose queries read `proxima_*` series says so in its description, because such a panel is
empty when the dashboard points at stock vLLM. That note is derived from the expressions here
(`promql.needs_proxima`), never written by hand.

Ids are assigned in insertion order by `Board`, so regenerating gives byte-identical JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, text, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import text as text_m

from dashboards import promql

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE_INTERVAL = "$__rate_interval"
TAGS = ["proxima", "vllm"]
REF_IDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

NEEDS_PROXIMA = "Needs Proxima (proxima_* metrics); empty on stock vLLM."
PARTLY_PROXIMA = (
    "Series from proxima_* metrics need Proxima; on stock vLLM only the vllm:* series appear."
)


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str


def proxima_note(targets: Sequence[Target]) -> str:
    """The note a panel's description carries, from what its queries read ("" for none)."""
    flags = [promql.needs_proxima(t.expr) for t in targets]
    if flags and all(flags):
        return NEEDS_PROXIMA
    return PARTLY_PROXIMA if any(flags) else ""


def _describe(description: str, targets: Sequence[Target]) -> str:
    note = proxima_note(targets)
    return f"{description}\n\n{note}" if note else description


def _with_targets(panel, title: str, description: str, targets: Sequence[Target]):
    panel = panel.title(title).description(_describe(description, targets)).datasource(DATASOURCE)
    if len(targets) > len(REF_IDS):
        raise ValueError(f"panel {title!r} has {len(targets)} queries; at most {len(REF_IDS)}")
    for ref, target in zip(REF_IDS, targets, strict=False):
        panel = panel.with_target(
            prometheus.Dataquery().expr(target.expr).legend_format(target.legend).ref_id(ref)
        )
    return panel


def _legend() -> common_b.VizLegendOptions:
    return (common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM).show_legend(True))


def _tooltip() -> common_b.VizTooltipOptions:
    return common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(
        common.SortOrder.DESCENDING)


def timeseries_panel(title: str, description: str, targets: Sequence[Target], unit: str, *,
                     width: int = 12, height: int = 8, min_val: float | None = None,
                     max_val: float | None = None, draw_bars: bool = False):
    panel = (timeseries.Panel().unit(unit).span(width).height(height).legend(_legend())
             .tooltip(_tooltip()).fill_opacity(10).line_width(1)
             .show_points(common.VisibilityMode.NEVER))
    if draw_bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(60)
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    return _with_targets(panel, title, description, targets)


def stat_panel(title: str, description: str, targets: Sequence[Target], unit: str, *,
               width: int = 4, height: int = 4, name_only: bool = False):
    """A big number per series; `name_only` shows the legend alone (for info-style metrics)."""
    text_mode = common.BigValueTextMode.NAME if name_only else common.BigValueTextMode.VALUE_AND_NAME
    panel = (stat.Panel().unit(unit).span(width).height(height)
             .graph_mode(common.BigValueGraphMode.NONE if name_only else common.BigValueGraphMode.AREA)
             .color_mode(common.BigValueColorMode.VALUE)
             .text_mode(text_mode)
             .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    return _with_targets(panel, title, description, targets)


def occupancy_panel(title: str, description: str, targets: Sequence[Target], *, rows: int,
                    width: int = 24, height: int = 14):
    """A state timeline with one row per KV segment, coloured by the fraction in use; `rows`
    sets the page size so that all segments show on one page."""
    color = dash_b.FieldColor().mode(dash_m.FieldColorModeId.CONTINUOUS_GR_YL_RD)
    panel = (statetimeline.Panel().span(width).height(height).unit("percentunit")
             .min(0).max(1).color_scheme(color).show_value(common.VisibilityMode.NEVER)
             .merge_values(False).row_height(0.95).line_width(0).fill_opacity(90).per_page(rows)
             .legend(common_b.VizLegendOptions().show_legend(False)
                     .display_mode(common.LegendDisplayMode.HIDDEN)
                     .placement(common.LegendPlacement.BOTTOM)))
    return _with_targets(panel, title, description, targets)


def text_panel(title: str, content: str, *, width: int = 24, height: int = 4):
    return (text.Panel().title(title).content(content).mode(text_m.TextMode.MARKDOWN)
            .span(width).height(height))


def datasource_variable() -> dash_b.DatasourceVariable:
    return dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(name: str, label: str, query: str, *, multi: bool) -> dash_b.QueryVariable:
    variable = (dash_b.QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
                .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(dash_m.VariableSort.ALPHABETICAL_ASC))
    if multi:
        variable = (variable.multi(True).include_all(True).all_value(".*")
                    .current(dash_m.VariableOption(selected=True, text="All", value="$__all")))
    return variable


class Board:
    """A dashboard under construction; panel ids follow insertion order (stable across runs)."""

    def __init__(self, uid: str, title: str, description: str) -> None:
        self._next_id = 1
        self._builder = (
            dash_b.Dashboard(title).uid(uid).description(description).tags(TAGS).editable()
            .tooltip(dash_m.DashboardCursorSync.CROSSHAIR).refresh("10s").time("now-1h", "now")
            .timezone("browser")
            .link(dash_b.DashboardLink("Proxima dashboards").type(dash_m.DashboardLinkType.DASHBOARDS)
                  .tags(["proxima"]).as_dropdown(True).include_vars(True).keep_time(True))
            .with_variable(datasource_variable())
        )

    def variable(self, variable) -> Board:
        self._builder = self._builder.with_variable(variable)
        return self

    def row(self, title: str) -> Board:
        self._builder = self._builder.with_row(dash_b.Row(title).id(self._take_id()))
        return self

    def add(self, *panels) -> Board:
        for panel in panels:
            self._builder = self._builder.with_panel(panel.id(self._take_id()))
        return self

    def json(self) -> str:
        """The dashboard as Grafana JSON: sorted keys, 2-space indent, final newline."""
        return JSONEncoder(sort_keys=True, indent=2).encode(self._builder.build()) + "\n"

    def _take_id(self) -> int:
        taken, self._next_id = self._next_id, self._next_id + 1
        return taken


def panel_targets(dashboard_json: dict) -> list[tuple[dict, dict]]:
    """(panel, target) for every query target of a dashboard's JSON, rows included."""
    found = []
    for panel in dashboard_json.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            found.extend((inner, target) for target in inner.get("targets", []))
    return found


def load(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
