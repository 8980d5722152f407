"""The Grafana dashboard (deploy/grafana/tether-dashboard.json) against the server's real metrics.

The JSON parses and is laid out sanely; every PromQL expression parses (promql-parser, once Grafana's $variables
are substituted) and selects only series that tether.server.metrics.ServiceMetrics exposes (Counter `x` as
`x_total`, Histogram `x` as `x_bucket` / `x_sum` / `x_count`), with label matchers and `by (...)` groupings on
labels those metrics have (or the scrape's own: instance, job, le); and every metric the server exposes is shown.
"""

import json
import re
from pathlib import Path

import pytest

from tether.server.metrics import ServiceMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tether-dashboard.json"
SCRAPE_LABELS = {"instance", "job", "le", "namespace", "pod"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exposed() -> dict[str, set[str]]:
    """Every series name the server exposes -> its labels."""
    metrics = ServiceMetrics()
    out = {}
    for attr in [*vars(metrics).values(), *vars(metrics.http).values()]:  # the HTTP API's series are grouped apart
        if hasattr(attr, "_type") and hasattr(attr, "_name"):
            labels = set(getattr(attr, "_labelnames", ()))
            for suffix in SUFFIXES[attr._type]:
                out[attr._name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    # The registry is the source of truth: a family no attribute accounts for is a collector of its own (the per-round
    # series, tether.server.round_tally), read from what it collects.
    families = list(metrics.registry.collect())
    assert families
    for f in families:
        if not any(n.startswith(f.name) for n in out):
            labels = {k for s in f.samples for k in s.labels} - {"le"}
            for suffix in SUFFIXES[f.type]:
                out[f.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def expressions(d: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(d) for t in p.get("targets", [])]


def substitute(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", "x", expr)


def test_dashboard_is_importable_json_with_unique_ids_and_no_overlaps():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ps = panels(d)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids))
    boxes = [(p["gridPos"]["x"], p["gridPos"]["y"], p["gridPos"]["w"], p["gridPos"]["h"]) for p in ps]
    assert all(x >= 0 and w > 0 and x + w <= 24 for x, _, w, _ in boxes)
    for i, (x1, y1, w1, h1) in enumerate(boxes):
        for x2, y2, w2, h2 in boxes[i + 1 :]:
            assert x1 + w1 <= x2 or x2 + w2 <= x1 or y1 + h1 <= y2 or y2 + h2 <= y1, "panels overlap"
    for p in ps:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"]


def test_every_expression_parses_and_uses_only_metrics_the_server_exposes():
    promql = pytest.importorskip("promql_parser")
    series = exposed()
    seen = set()
    for title, expr in expressions(dashboard()):
        tree = promql.parse(substitute(expr))
        selectors = []
        groupings: list[str] = []

        def visit(node, selectors=selectors, groupings=groupings):
            if isinstance(node, promql.VectorSelector):
                selectors.append(node)
            if isinstance(node, promql.AggregateExpr) and node.modifier is not None:
                groupings.extend(node.modifier.labels)

        promql.walk(tree, visit)
        assert selectors, f"{title}: {expr} selects nothing"
        names = {s.name for s in selectors}
        for s in selectors:
            assert s.name in series, f"{title}: {s.name} is not a metric of server/metrics.py"
            for m in s.matchers.matchers:
                assert m.name in series[s.name] | SCRAPE_LABELS, f"{title}: {s.name} has no label {m.name}"
        labels = set().union(*(series[n] for n in names)) | SCRAPE_LABELS
        assert set(groupings) <= labels, f"{title}: grouping by {set(groupings) - labels}"
        seen |= names
    # Every metric the server exposes is on the dashboard.
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in series}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in seen}
    assert families <= shown, families - shown


def test_the_operators_questions_have_panels():
    titles = {p["title"] for p in panels(dashboard())}
    for wanted in ("Rounds / s", "Acceptance length tau", "Tokens / s", "Verify latency", "Batch size", "Sessions",
                   "KV pool usage", "Evictions / s", "Errors / s by code", "Bytes out / s by kind",
                   "Resyncs / s by outcome"):  # fmt: skip
        assert wanted in titles
    exprs = " ".join(e for _, e in expressions(dashboard()))
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(tether_" in exprs
