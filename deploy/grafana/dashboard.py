"""Generate the shardps Grafana dashboard (``deploy/grafana/shardps.json``) from the panel list below.

    python deploy/grafana/dashboard.py            # write shardps.json next to this file
    python deploy/grafana/dashboard.py --check    # exit 1 if shardps.json differs from the generator's output

Plain dicts, no Grafana SDK: the output is the JSON model Grafana (10.x and
later) imports (Dashboards > New > Import, or file provisioning). Every
query goes to the Prometheus data source chosen in the ``datasource``
variable and uses ``$__rate_interval``, which Grafana sets from the data
source's scrape interval. ``render.py`` draws the same queries with
matplotlib; tests/deploy/test_monitoring.py runs each of them against a real
Prometheus scraping a real training job.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: Where the generated JSON lives (committed; tests compare it with :func:`render_json`).
DASHBOARD_PATH = Path(__file__).resolve().with_name("shardps.json")

SHARDS = 'job="shardps-shards"'
WORKERS = 'job="shardps-workers"'
REPLICAS = 'job="shardps-replicas"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel and its legend (Grafana's ``{{label}}`` templating)."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """A time-series panel: ``unit`` is a Grafana unit id (``s``, ``Bps``, ``ops``, ``short``, ``none``)."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    decimals: int | None = None
    extra_defaults: dict = field(default_factory=dict)


def _quantiles(metric: str, selector: str, by: str, label: str) -> tuple[Query, ...]:
    """p50 and p99 of histogram ``metric`` aggregated ``by`` (plus ``le``)."""
    group = f"{by}, le" if by else "le"
    return tuple(
        Query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
              f"{name} {label}".strip())
        for q, name in ((0.5, "p50"), (0.99, "p99"))
    )


PANELS: tuple[Panel, ...] = (
    Panel("Rounds per second", "Rounds each shard applies per second (async/ssp: one per applied push).",
          "ops", (Query(f"sum by (shard) (rate(shardps_shard_rounds_total{{{SHARDS}}}[{RATE}]))", "shard {{shard}}"),)),
    Panel("Samples per second", "Training samples the workers process per second, in all and per worker.",
          "short", (
              Query(f"sum(rate(shardps_worker_samples_total{{{WORKERS}}}[{RATE}]))", "all workers"),
              Query(f"sum by (instance) (rate(shardps_worker_samples_total{{{WORKERS}}}[{RATE}]))", "{{instance}}"),
          )),
    Panel("Worker step time", "One training step (forward, backward, the round trip), from the end of a step() "
          "to the end of the next, over all workers (p50, p99).", "s",
          _quantiles("shardps_worker_step_seconds", WORKERS, "", "step")),
    Panel("Push / pull latency", "Time a step's gradients take to reach the shards (push) and from step start "
          "until its parameters are in (pull), over all workers.", "s",
          _quantiles("shardps_worker_push_seconds", WORKERS, "", "push")
          + _quantiles("shardps_worker_pull_seconds", WORKERS, "", "pull")),
    Panel("Push / pull bytes per second", "Gradient bytes each shard receives (push) and parameter bytes it "
          "sends (pull); unequal shards point to an unbalanced partition plan.", "Bps", (
              Query(f"sum by (shard) (rate(shardps_shard_received_bytes_total{{{SHARDS}}}[{RATE}]))",
                    "push to shard {{shard}}"),
              Query(f"sum by (shard) (rate(shardps_shard_sent_bytes_total{{{SHARDS}}}[{RATE}]))",
                    "pull from shard {{shard}}"),
          )),
    Panel("Staleness", "Versions between the parameters a contribution was computed from and the version it "
          "was applied to (sync: always 0; ssp: at most --staleness).", "short",
          _quantiles("shardps_shard_staleness_versions", SHARDS, "shard", "shard {{shard}}")),
    Panel("Live workers", "Workers holding a lease on each shard, and the --min-workers setting.", "short", (
        Query(f"max by (shard) (shardps_shard_live_workers{{{SHARDS}}})", "shard {{shard}}"),
        Query(f"max(shardps_shard_min_workers{{{SHARDS}}})", "min workers"),
    ), decimals=0),
    Panel("Shard versions", "Each shard's version (sync: the global step); shards of one job move together.",
          "short", (Query(f"max by (shard) (shardps_shard_version{{{SHARDS}}})", "shard {{shard}}"),), decimals=0),
    Panel("RPC errors by code", "Shard calls per second that ended with a status other than OK, by gRPC code "
          "(CANCELLED: the worker gave up the call, e.g. a pull it no longer needs).", "ops", (
              Query(f"sum by (code) (rate(shardps_shard_rpcs_total{{{SHARDS}, code!=\"OK\"}}[{RATE}]))", "{{code}}"),
          )),
    Panel("Shard call latency p99", "99th percentile duration of shardps.v1.Shard calls by method, waiting "
          "for the round included.", "s", (
              Query("histogram_quantile(0.99, sum by (method, le) "
                    f"(rate(shardps_shard_rpc_seconds_bucket{{{SHARDS}}}[{RATE}])))", "{{method}}"),
          )),
    Panel("Checkpoint age", "Seconds since each shard's newest checkpoint (shards that never checkpointed "
          "are not shown).", "s", (
              Query(f"time() - max by (shard) (shardps_shard_last_checkpoint_timestamp_seconds{{{SHARDS}}} > 0)",
                    "shard {{shard}}"),
          )),
    Panel("Optimizer update time", "Time the shard's optimizer update of one round takes (p50, p99).", "s",
          _quantiles("shardps_shard_update_seconds", SHARDS, "shard", "shard {{shard}}")),
    Panel("Serving: state age", "Freshness of each serving replica: seconds since it swapped in the state it "
          "serves (a refresh every --period; it grows while refreshes fail, and the replica answers from its "
          "last state).", "s", (
              Query(f"max by (instance) (shardps_serving_state_age_seconds{{{REPLICAS}}})", "{{instance}}"),
          )),
    Panel("Serving: call latency", "Duration of shardps.v1.Serving calls on the replicas by method (p50, p99).",
          "s", _quantiles("shardps_serving_call_seconds", REPLICAS, "method", "{{method}}")),
    Panel("Serving: calls per second", "Serving calls the replicas answered per second, by method and gRPC code "
          "(UNAVAILABLE: before the first state; INVALID_ARGUMENT, NOT_FOUND: bad requests).", "ops", (
              Query(f"sum by (method, code) (rate(shardps_serving_calls_total{{{REPLICAS}}}[{RATE}]))",
                    "{{method}} {{code}}"),
          )),
    Panel("Serving: delta bytes per second", "Row and id bytes each replica's refreshes receive from the training "
          "shards (touched rows only; a table read whole counts whole).", "Bps", (
              Query(f"sum by (instance) (rate(shardps_serving_delta_bytes_total{{{REPLICAS}}}[{RATE}]))",
                    "{{instance}}"),
          )),
    Panel("Serving: age of the newest event served", "Freshness by events, for jobs trained exactly once from a "
          "Redis stream: seconds since the newest event that every training shard's rows hold in the state a "
          "replica serves entered the broker (its offset is the entry id, ms << 20 | seq). The state's age plus "
          "the training latency; per event, see the panel beside.", "s", (
              Query(f"time() - max by (instance, partition) (shardps_serving_stream_offset{{{REPLICAS}}}) "
                    "/ 1048576 / 1000", "{{instance}} {{partition}}"),
          )),
    Panel("Serving: event freshness", "Per event, for jobs trained from a Redis stream with replicas started "
          "with --freshness-redis: seconds from an event's broker time to the swap of the first replica state "
          "that holds it (p50, p99 over the events every replica made visible, by partition; "
          "shardps_serving_event_freshness_seconds).", "s", _quantiles("shardps_serving_event_freshness_seconds", REPLICAS, "partition",
                                       "{{partition}}")),
)

_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_COLUMNS, _WIDTH, _HEIGHT = 2, 12, 8


def _panel(index: int, panel: Panel) -> dict:
    defaults: dict = {
        "unit": panel.unit,
        "min": 0,
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                   "spanNulls": False},
    }
    if panel.decimals is not None:
        defaults["decimals"] = panel.decimals
    defaults.update(panel.extra_defaults)
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": _DATASOURCE,
        "gridPos": {"h": _HEIGHT, "w": _WIDTH, "x": (index % _COLUMNS) * _WIDTH, "y": (index // _COLUMNS) * _HEIGHT},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": _DATASOURCE, "expr": q.expr, "legendFormat": q.legend,
             "range": True, "instant": False}
            for i, q in enumerate(panel.queries)
        ],
    }


def build() -> dict:
    """The dashboard's JSON model (a dict), panels two to a row in :data:`PANELS` order."""
    return {
        "title": "shardps",
        "uid": "shardps",
        "description": "shardps parameter server: shards (job shardps-shards), workers (job shardps-workers) and "
                       "serving replicas (job shardps-replicas).",
        "tags": ["shardps", "pytorch", "parameter-server"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": "",
        }]},
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


def render_json() -> str:
    """:func:`build` as the text committed in ``shardps.json`` (2-space indent, trailing newline)."""
    return json.dumps(build(), indent=2) + "\n"


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every target of every panel of a dashboard JSON model."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DASHBOARD_PATH, help=f"output (default {DASHBOARD_PATH.name})")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    text = render_json()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is not the generator's output: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
