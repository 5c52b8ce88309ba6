"""Monitoring: the Prometheus configuration and alert rules, the Grafana dashboard, and both against real data.

Static checks run ``promtool`` (config, rules, the rules' unit tests in
``deploy/prometheus/alerts_test.yml``) and compare the committed dashboard
JSON with its generator. The live test starts a real ``prometheus`` that
scrapes real shards, a real ``shardps train digits`` job and a real ``shardps serve`` replica on loopback and
runs every dashboard query and every alert expression (its threshold removed) through the HTTP API.
The Prometheus tests need the ``prometheus`` package (``promtool`` and
``prometheus`` on PATH; ``.ci/run`` installs it) and fail without it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
PROMTOOL_TIMEOUT = 60  # seconds, each promtool run
DISCOVERY_TIMEOUT = 30  # seconds for Prometheus to pick up targets (it applies discovery every 5 s)
LIVE_TIMEOUT = 120  # seconds for every query of the live test to return data (a loaded 2-core CI machine)
RATE_INTERVAL = "5s"  # $__rate_interval for a 1 s scrape interval (Grafana: max(4 x scrape, step + scrape))
ALERTS = {"ShardDown", "ShardNoRoundProgress", "StalenessHigh", "LiveWorkersBelowMin", "CheckpointTooOld",
          "ShardErrorRate", "ReplicaStateStale"}


def _load(name: str):
    """A module of ``deploy/grafana`` (not a package) by path, under a name of its own."""
    if (module := sys.modules.get(f"shardps_deploy_{name}")) is not None:
        return module
    spec = importlib.util.spec_from_file_location(f"shardps_deploy_{name}", GRAFANA_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


dashboard = _load("dashboard")
stack = _load("stack")

JOBS = ("shardps-shards", "shardps-workers", "shardps-replicas")


@pytest.fixture
def prometheus_package() -> None:
    """Fail (not skip) without Debian's ``prometheus`` package: these tests are the monitoring must-shows."""
    missing = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not on PATH: install Debian's package (apt-get install prometheus), "
                    "as .ci/run does")


needs_promtool = needs_prometheus = pytest.mark.usefixtures("prometheus_package")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT, cwd=cwd)


# --- alert expressions: "<query> <comparison> <number>" -------------------------------------------------------------

_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def _scan(expr: str):
    """``(position, character, depth)`` of each character outside string literals; depth counts open brackets."""
    depth, i = 0, 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            end = i + 1
            while end < len(expr) and expr[end] != c:
                end += 2 if expr[end] == "\\" and c != "`" else 1
            i = end + 1
            continue
        if c in ")]}":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced {c!r} at {i}: {expr}")
        yield i, c, depth
        if c in "([{":
            depth += 1
        i += 1
    if depth:
        raise ValueError(f"unbalanced brackets: {expr}")


def _top_level(expr: str) -> list[tuple[int, str]]:
    """``(position, token)`` of the comparison operators and ``and``/``or``/``unless`` outside brackets and strings."""
    tokens, skip = [], -1
    for i, c, depth in _scan(expr):
        if depth or i <= skip:
            continue
        if expr[i:i + 2] in _COMPARISONS:
            tokens.append((i, expr[i:i + 2]))
            skip = i + 1
        elif c in "<>":
            tokens.append((i, c))
        elif (m := re.match(r"(and|or|unless)\b", expr[i:])) and (i == 0 or not re.match(r"\w", expr[i - 1])):
            tokens.append((i, m.group(1)))
    return tokens


def _wrapped(expr: str) -> bool:
    """``expr`` is one parenthesised expression: its first '(' closes at its last character."""
    if not expr.startswith("("):
        return False
    closing = next(i for i, c, depth in _scan(expr) if c == ")" and depth == 0)
    return closing == len(expr) - 1


def split_threshold(expr: str) -> tuple[str, str, float]:
    """Split an alert expression ``<query> <comparison> <number>`` into ``(query, comparison, number)``.

    The query loses one pair of enclosing parentheses. A query with a
    comparison or ``and``/``or``/``unless`` of its own must be parenthesised:
    otherwise the final comparison binds tighter than ``and`` (or chains with
    the inner comparison) and would not compare the whole query.

    Raises:
        ValueError: ``expr`` does not end with a comparison against a number, or its query is ambiguous.
    """
    expr = " ".join(expr.split())
    tokens = _top_level(expr)
    if not tokens or tokens[-1][1] not in _COMPARISONS:
        raise ValueError(f"no top-level comparison at the end: {expr}")
    position, op = tokens[-1]
    query, bound = expr[:position].strip(), expr[position + len(op):].strip()
    if not _NUMBER.fullmatch(bound):
        raise ValueError(f"{op!r} is not followed by a plain number (got {bound!r}): {expr}")
    if len(tokens) > 1:
        raise ValueError(f"the query before {op!r} has top-level {[t for _, t in tokens[:-1]]}: "
                         f"put it in parentheses: {expr}")
    if _wrapped(query):
        query = query[1:-1].strip()
    return query, op, float(bound)


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alert_queries() -> list[tuple[str, str]]:
    """``(alert name, query)`` of every alert rule: its expression without the threshold comparison."""
    return [(rule["alert"], split_threshold(rule["expr"])[0]) for rule in alert_rules()]


def dashboard_queries(rate: str = RATE_INTERVAL) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` of every target of the committed dashboard, ``$__rate_interval`` replaced."""
    model = json.loads((GRAFANA_DIR / "shardps.json").read_text())
    return [(title, stack.grafana_expr(expr, rate)) for title, expr in dashboard.queries(model)]


@pytest.mark.parametrize("expr, expected", [
    ('up{job="shardps-shards"} == 0', ('up{job="shardps-shards"}', "==", 0.0)),
    ("(a and (b > 0)) == 0", ("a and (b > 0)", "==", 0.0)),
    ("(a - b) and (b > 0) > 1", None),  # '> 1' would bind to '(b > 0)' only
    ("a and b > 0", None),
    ("(a unless b) > 2.5e3", ("a unless b", ">", 2500.0)),
    ("sum(rate(x{code!~\"OK|A>B\"}[5m])) / sum(rate(x[5m])) > 0.05",
     ("sum(rate(x{code!~\"OK|A>B\"}[5m])) / sum(rate(x[5m]))", ">", 0.05)),
    ("(a) / (b) >= 1", ("(a) / (b)", ">=", 1.0)),
    ("a > b", None),
    ("a > 0 < 5", None),
    ("rate(x[5m])", None),
])
def test_split_threshold(expr, expected):
    if expected is None:
        with pytest.raises(ValueError):
            split_threshold(expr)
    else:
        assert split_threshold(expr) == expected


def test_every_alert_has_a_threshold_for_severity_and_annotations():
    rules = alert_rules()
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        query, op, bound = split_threshold(rule["expr"])
        assert query and op in _COMPARISONS and math.isfinite(bound), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), f"{rule['alert']}: 'for' must be a duration"
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


# --- promtool -------------------------------------------------------------------------------------------------------

@needs_promtool
def test_promtool_checks_rules_and_their_unit_tests():
    checked = promtool("check", "rules", "alerts.yml", cwd=PROMETHEUS_DIR)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout
    tested = promtool("test", "rules", "alerts_test.yml", cwd=PROMETHEUS_DIR)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


@needs_promtool
@pytest.mark.parametrize("old, new", [
    (") == 0", ") >= 0"),  # ShardNoRoundProgress also while rounds advance
    ('(shardps_shard_last_checkpoint_timestamp_seconds{job="shardps-shards"} > 0)',
     'shardps_shard_last_checkpoint_timestamp_seconds{job="shardps-shards"}'),  # shards that never checkpointed
    ('code!~"OK|CANCELLED"', 'code!="OK"'),  # cancelled calls as errors
    ('and\n  (shardps_shard_live_workers{job="shardps-shards"} > 0)\n) > 0', ") > 0"),  # idle shards alert
    ('_state_age_seconds{job="shardps-replicas"} > 60',
     '_state_age_seconds{job="shardps-replicas"} > 0'),  # a replica refreshing every half second alerts
], ids=["no-progress-while-advancing", "never-checkpointed", "cancelled-as-error", "below-min-without-workers",
        "fresh-replica-as-stale"])
def test_alert_unit_tests_catch_a_broken_rule(tmp_path, old, new):
    """The unit tests are not vacuous: each of these edits of alerts.yml makes them fail."""
    folded = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    exprs = [r["expr"] for g in folded["groups"] for r in g["rules"]]
    assert sum(e.count(old) for e in exprs) == 1, f"{old!r} is not in exactly one expression"
    for group in folded["groups"]:
        for rule in group["rules"]:
            rule["expr"] = rule["expr"].replace(old, new)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(folded, sort_keys=False))
    shutil.copy(PROMETHEUS_DIR / "alerts_test.yml", tmp_path / "alerts_test.yml")
    tested = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert tested.returncode != 0 and "FAILED" in tested.stdout + tested.stderr, tested.stdout


@needs_promtool
def test_promtool_checks_the_committed_config(tmp_path):
    for name in ("prometheus.yml", "alerts.yml"):  # the rule file resolves next to the config, as in a ConfigMap
        shutil.copy(PROMETHEUS_DIR / name, tmp_path / name)
    checked = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    output = checked.stdout + checked.stderr
    assert checked.returncode == 0, output
    assert "SUCCESS: 1 rule files found" in output and f"SUCCESS: {len(ALERTS)} rules found" in output


@needs_promtool
def test_promtool_checks_config_with_loopback_discovery(tmp_path):
    """Everything but the Kubernetes discovery itself: globals, jobs, relabeling, rule files (any promtool build)."""
    config = stack.loopback_config(
        stack.load_config(), {job: {"static_configs": [{"targets": ["127.0.0.1:9100"]}]} for job in JOBS},
        rule_files=[PROMETHEUS_DIR / "alerts.yml"], keep_relabeling=True)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    checked = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout


def test_config_scrapes_the_metrics_ports_of_the_manifests_services():
    """Each job's SRV name is the ``metrics`` port of a headless Service in deploy/k8s whose pods serve it."""
    config = stack.load_config()
    assert config["global"]["scrape_interval"] == "15s"
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(JOBS)
    docs = [d for f in ("shards.yaml", "workers.yaml", "replicas.yaml")
            for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / f).read_text()) if d]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs
                 if d["kind"] in ("StatefulSet", "Job", "Deployment")}
    for job, service, component in (("shardps-shards", "shardps-shard", "shard"),
                                    ("shardps-workers", "shardps-worker", "worker"),
                                    ("shardps-replicas", "shardps-replica-metrics", "replica")):
        assert jobs[job]["dns_sd_configs"] == [{"names": [f"_metrics._tcp.{service}.default.svc.cluster.local"],
                                                "type": "SRV", "refresh_interval": "30s"}]
        spec = services[service]["spec"]
        assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True  # one record per pod
        assert spec["selector"]["app.kubernetes.io/component"] == component
        port = {p["name"]: p for p in spec["ports"]}["metrics"]
        containers = workloads[component]["spec"]["template"]["spec"]["containers"]
        served = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
        assert served["metrics"] == port["port"] and port.get("targetPort", "metrics") in ("metrics", port["port"])


@needs_promtool
def test_every_dashboard_and_alert_query_is_valid_promql(tmp_path):
    """Each query alone (what the live test runs) parses: as recording rules, promtool checks them."""
    queries = [q for _, q in dashboard_queries()] + [q for _, q in alert_queries()]
    rules = {"groups": [{"name": "queries", "rules": [
        {"record": f"shardps:query{i}", "expr": q} for i, q in enumerate(queries)]}]}
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", "queries.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --- the dashboard --------------------------------------------------------------------------------------------------

def test_dashboard_json_is_the_generators_output():
    committed = (GRAFANA_DIR / "shardps.json").read_text()
    assert committed == dashboard.render_json(), "run python deploy/grafana/dashboard.py and commit shardps.json"
    check = subprocess.run([sys.executable, str(GRAFANA_DIR / "dashboard.py"), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def test_every_panel_has_a_query_on_the_datasource_variable():
    model = json.loads((GRAFANA_DIR / "shardps.json").read_text())
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    titles = [p["title"] for p in model["panels"]]
    assert len(titles) == len(set(titles)) >= 10
    for required in ("Rounds per second", "Worker step time", "Push / pull bytes per second", "Push / pull latency",
                     "Staleness", "Live workers", "Shard versions", "RPC errors by code", "Checkpoint age"):
        assert required in titles
    for panel in model["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert "$__rate_interval" in target["expr"] or "rate(" not in target["expr"], panel["title"]
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))


# --- real Prometheus ------------------------------------------------------------------------------------------------

@needs_prometheus
@pytest.mark.timeout(420)  # about 25 s on 2 idle cores; each wait below is bounded, together under 420 s
def test_dashboard_and_alert_queries_return_data_from_a_real_training_job(tmp_path):
    """Real shards, ``shardps train digits`` workers and a ``shardps serve`` replica (of a small job of its own,
    called by a client) scraped by a real Prometheus every second.

    Waits (bounded) until every target is up at once and every dashboard query
    and every alert query (threshold removed) has returned at least one series
    over the recorded range, then stops the job; checks that the rules load
    and evaluate without errors, and a few values (rounds advance, both workers
    counted live, step times positive, the replica's states advance and its calls are answered).
    """
    from tests.support.forked import ForkedCluster

    queries = [("panel " + title, q) for title, q in dashboard_queries()]
    queries += [("alert " + name, q) for name, q in alert_queries()]
    with stack.MonitoringStack(tmp_path, shards=2, workers=2, epochs=40, scrape_interval=1.0,
                               checkpoint_every_rounds=10, cluster_factory=ForkedCluster) as live:
        prometheus, job = live.prometheus, live.start_job()
        start = time.time()
        pending, all_up = dict(queries), False
        deadline = time.monotonic() + LIVE_TIMEOUT
        while (pending or not all_up) and time.monotonic() < deadline:
            targets = prometheus.targets()
            up = {(t["labels"]["job"], t["labels"]["instance"]) for t in targets if t["health"] == "up"}
            all_up = all_up or len(up) == 5 and {j for j, _ in up} == set(JOBS)  # 2 shards, 2 workers, 1 replica
            for what, q in list(pending.items()):
                if prometheus.query_range(q, start - 5, time.time(), 1):
                    del pending[what]
            if job.exit_codes() and not job.running() and pending:
                break  # the job ended before the last query had data: report below
            time.sleep(1)
        seen = [(t["labels"], t["health"], t["lastError"]) for t in targets]
        assert all_up, (f"not every target was up at once: {seen}\nworker 0:\n{job.log_tail(0)}\n"
                        f"replica:\n{live.replica.log_tail()}")
        assert not pending, (f"no data in {time.time() - start:.0f}s for: {json.dumps(pending, indent=1)}\n"
                             f"worker exit codes {job.exit_codes()}\nworker 0:\n{job.log_tail(0)}\n"
                             f"replica:\n{live.replica.log_tail()}")
        end = time.time()

        def highest(expr: str) -> float:
            series = prometheus.query_range(expr, start - 5, end, 1)
            values = [float(v) for s in series for _, v in s["values"] if not math.isnan(float(v))]
            return max(values, default=float("nan"))

        assert highest(f'sum(rate(shardps_shard_rounds_total{{job="{stack.SHARD_JOB}"}}[5s]))') > 0
        assert highest(f'min(shardps_shard_live_workers{{job="{stack.SHARD_JOB}"}})') == 2
        assert highest(f'max(shardps_shard_version{{job="{stack.SHARD_JOB}"}})') >= 10
        assert highest(f'min(shardps_shard_last_checkpoint_timestamp_seconds{{job="{stack.SHARD_JOB}"}})') > start - 60
        assert highest('histogram_quantile(0.5, sum by (le) (rate(shardps_worker_step_seconds_bucket[5s])))') > 0
        assert highest(f'count(up{{job="{stack.WORKER_JOB}"}} == 1)') == 2
        assert live.replica.ready.is_set(), live.replica.log_tail()
        assert highest(f'max(shardps_serving_state{{job="{stack.REPLICA_JOB}"}})') >= 2  # refreshed after the first
        assert highest(f'sum(rate(shardps_serving_calls_total{{job="{stack.REPLICA_JOB}", code="OK"}}[5s]))') > 0

        rules = {rule["name"]: rule for rule in prometheus.rules()}
        assert set(rules) == ALERTS
        for name, rule in rules.items():
            assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
            assert not rule["lastEvaluation"].startswith("0001-"), f"{name} was never evaluated"

        # the README picture's renderer, as a user runs it, on this Prometheus
        png = tmp_path / "dashboard.png"
        rendered = subprocess.run(
            [sys.executable, str(GRAFANA_DIR / "render.py"), "--prometheus", prometheus.url, "--start", str(start - 5),
             "--end", str(end), "--scrape-interval", "1", "--out", str(png)],
            capture_output=True, text=True, timeout=90)
        assert rendered.returncode == 0, rendered.stdout + rendered.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    replica = live.replica
    assert replica.exit_codes["replica"] == 0, f"SIGTERM did not stop the replica cleanly:\n{replica.log_tail()}"
