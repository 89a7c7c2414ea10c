"""The Grafana dashboard parses, and queries only metrics the engine and the operator export.

The exported names are read from the metrics modules themselves (their Prometheus registries),
so renaming a metric there without updating the dashboard fails here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.metrics import PrometheusStatLogger
from kvpilot.engine.stats import EngineStats
from kvpilot.operator.operator_metrics import OperatorMetrics

REPO = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "kvpilot" / "dashboards" / "kvpilot.json"

# PromQL words that are not metric names (functions are recognised by the "(" that follows).
PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip


def queried_metrics(expr: str) -> set[str]:
    """The series names a PromQL expression reads.

    Label matchers (``{...}``), range and subquery selectors (``[...]``), string literals,
    grouping label lists (``by (...)``), Grafana variables (``$name``), numbers and durations are
    dropped first; what remains is functions (a name and "("), keywords and metric names.
    """
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)
    expr = re.sub(r"(?<![A-Za-z0-9_:])\d[\w.]*", "", expr)  # numbers and durations (5m)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*(\s*\()?", expr):
        word = match.group(0).rstrip("( \t")
        if match.group(1) is None and word.lower() not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def test_queried_metrics_parses_promql() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket"
        '{namespace=~"$namespace", model_name=~"a|b"}[$__rate_interval]))) / on (pod) '
        "kvpilot:max_concurrency offset 5m > bool 0"
    )
    assert queried_metrics(expr) == {
        "vllm:time_to_first_token_seconds_bucket",
        "kvpilot:max_concurrency",
    }


def _panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_structure(dashboard: dict) -> None:
    assert dashboard["uid"] == "kvpilot"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len({p["id"] for p in _panels(dashboard)}) == len(_panels(dashboard))
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24


def _series_names(registry) -> set[str]:
    """Names of the series a registry exposes, read back from its exposition text."""
    text = prometheus_client.generate_latest(registry).decode()
    return {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }


def engine_series() -> set[str]:
    """Every series the engine's /metrics exposes once it has served a request."""
    registry = prometheus_client.CollectorRegistry()
    logger = PrometheusStatLogger(
        "model", registry, max_model_len=64, cache_config={"block_size": 16}
    )
    required = [
        f.name
        for f in dataclasses.fields(EngineStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    stats = EngineStats(**dict.fromkeys(required, 0))
    logger.record_stats(stats)
    return _series_names(registry)


def operator_series() -> set[str]:
    """Every series the operator's /metrics exposes once it has reconciled and failed once."""
    metrics = OperatorMetrics()
    with metrics.track("create"):
        pass
    with contextlib.suppress(RuntimeError), metrics.track("update"):
        raise RuntimeError("a failed reconcile")
    return _series_names(metrics.registry)


def test_dashboard_queries_only_exported_metrics(dashboard: dict) -> None:
    exported = engine_series() | operator_series()
    queried: set[str] = set()
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            queried |= queried_metrics(target["expr"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # Grafana's label_values(SELECTOR, LABEL): the selector is PromQL, the label is not.
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["definition"])
            queried |= queried_metrics(selector.group(1))
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
    # Both halves are on the board: the engine's KV pressure and the operator's reconciles.
    assert "vllm:kv_cache_usage_perc" in queried
    assert any(name.startswith("kvpilot_operator_") for name in queried)
