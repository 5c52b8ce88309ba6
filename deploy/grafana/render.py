"""Draw the Grafana dashboard's panels with matplotlib from a Prometheus (the README's picture).

    # from a real run on this machine: shards, a digits job, a serving replica and Prometheus on loopback
    # (needs `prometheus`)
    python deploy/grafana/render.py --run --out docs/images/dashboard.png
    # from a Prometheus that already scraped a job: the last 30 minutes, or --start/--end (Unix seconds)
    python deploy/grafana/render.py --prometheus http://localhost:9090 --minutes 30 --out dashboard.png

Each panel runs the same PromQL as ``shardps.json`` (``$__rate_interval``
set the way Grafana sets it, from the scrape interval and the step) through
``/api/v1/query_range`` and plots every series with the panel's legend and
unit. Series that are NaN throughout (a quantile of a method never called)
are left out; a panel of many series that are all 0 (RPC errors of a healthy
job) shows one line for them.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling modules

import stack  # noqa: E402
from dashboard import DASHBOARD_PATH  # noqa: E402

_COLUMNS = 3
_THEME = {"figure": "#111217", "axes": "#181b1f", "grid": "#2c3235", "text": "#ccccdc", "title": "#ffffff"}
_COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a", "#96d98d",
           "#ffb357"]


def _legend(template: str, labels: dict) -> str:
    """Grafana's legend templating: ``{{name}}`` becomes the series' label ``name``."""
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return text or "{" + ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def _scale(unit: str, peak: float) -> tuple[float, str]:
    """A divisor and a y-axis label for Grafana unit ``unit`` at magnitude ``peak``."""
    if unit == "s":
        return (1e-3, "ms") if peak < 1 else (1.0, "s")
    if unit == "Bps":
        for divisor, name in ((1 << 30, "GiB/s"), (1 << 20, "MiB/s"), (1 << 10, "KiB/s")):
            if peak >= divisor:
                return float(divisor), name
        return 1.0, "B/s"
    return 1.0, {"ops": "per second"}.get(unit, "")


def fetch(prometheus: stack.PrometheusAPI, model: dict, start: float, end: float, step: float, rate: str) -> list[dict]:
    """Every panel's series: ``[{"title", "unit", "series": [(legend, [t...], [v...]), ...]}, ...]``."""
    panels = []
    for panel in model["panels"]:
        series = []
        for target in panel["targets"]:
            for result in prometheus.query_range(stack.grafana_expr(target["expr"], rate), start, end, step):
                times = [float(t) for t, _ in result["values"]]
                values = [float(v) for _, v in result["values"]]
                if all(v != v for v in values):  # NaN throughout
                    continue
                series.append((_legend(target.get("legendFormat", ""), result["metric"]), times, values))
        panels.append({"title": panel["title"], "unit": panel["fieldConfig"]["defaults"].get("unit", ""),
                       "series": series})
    return panels


def draw(panels: list[dict], out: Path, title: str) -> None:
    """Draw ``panels`` (from :func:`fetch`) in a grid, Grafana's dark colours, to the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from PIL import Image

    rows = -(-len(panels) // _COLUMNS)
    fig, axes = plt.subplots(rows, _COLUMNS, figsize=(6 * _COLUMNS, 3.4 * rows + 0.6), squeeze=False,
                             facecolor=_THEME["figure"])
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        ax.set_facecolor(_THEME["axes"])
        ax.set_title(panel["title"], color=_THEME["title"], fontsize=11, loc="left")
        ax.tick_params(colors=_THEME["text"], labelsize=8)
        for spine in ax.spines.values():
            spine.set_color(_THEME["grid"])
        ax.grid(color=_THEME["grid"], linewidth=0.6)
        series = panel["series"]
        zero = [s for s in series if all(v == 0 for v in s[2] if v == v)]
        if len(series) > 4 and zero:  # e.g. every gRPC code at 0: one line says so
            times = zero[0][1]
            series = [s for s in series if s not in zero] + [(f"{len(zero)} series at 0", times, [0.0] * len(times))]
        if not series:
            ax.text(0.5, 0.5, "no data", color=_THEME["text"], ha="center", va="center", transform=ax.transAxes)
            continue
        finite = [abs(v) for s in series for v in s[2] if v == v]
        divisor, label = _scale(panel["unit"], max(finite, default=0.0))
        for i, (legend, times, values) in enumerate(series):
            ax.plot([datetime.fromtimestamp(t) for t in times], [v / divisor for v in values], linewidth=1.4,
                    color=_COLORS[i % len(_COLORS)], label=legend)
        ax.set_ylabel(label, color=_THEME["text"], fontsize=8)
        ax.set_ylim(bottom=0, top=None if max(finite, default=0.0) > 0 else 1)  # all 0: a line at the bottom
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.legend(fontsize=7, loc="upper left", ncol=2 if len(series) > 3 else 1, facecolor=_THEME["axes"],
                  edgecolor=_THEME["grid"], labelcolor=_THEME["text"], framealpha=0.8)
    fig.suptitle(title, color=_THEME["title"], fontsize=13, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, facecolor=_THEME["figure"])
    plt.close(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    # 256 colours (Pillow comes with matplotlib): a third of the size, no visible difference on these flat colours
    Image.open(buffer).convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=256).save(out, optimize=True)


def _run(args: argparse.Namespace, model: dict, cluster_factory=None) -> None:
    """Start shards, Prometheus, a serving replica and a digits job on loopback, wait for the job, then draw its
    whole run.

    ``cluster_factory``: as :class:`stack.MonitoringStack` takes it (default ``LocalCluster``).
    """
    with tempfile.TemporaryDirectory(prefix="shardps-render-") as tmp:
        extra = ("--staleness", str(args.staleness)) if args.staleness is not None else ()
        with stack.MonitoringStack(Path(tmp), shards=args.shards, workers=args.workers, epochs=args.epochs,
                                   mode=args.mode, scrape_interval=args.scrape_interval,
                                   checkpoint_every_rounds=args.checkpoint_every_rounds,
                                   extra_worker_args=extra, cluster_factory=cluster_factory) as live:
            live.wait_for_targets(stack.SHARD_JOB, args.shards)  # the picture starts before the first round
            job = live.start_job()
            begin = time.time()
            codes = job.wait(args.timeout)
            if any(code != 0 for code in codes):
                raise RuntimeError(f"the digits job did not finish in {args.timeout:.0f}s (exit codes {codes}):\n"
                                   f"{job.log_tail(0)}")
            end = time.time()
            time.sleep(3 * args.scrape_interval)  # the last scrapes and rule evaluations
            step = max(args.scrape_interval, (end - begin) / 300)
            rate = stack.rate_interval(args.scrape_interval, step)
            panels = fetch(live.prometheus, model, begin, end + 2 * args.scrape_interval, step, rate)
            mode = args.mode + (f", staleness {args.staleness}" if args.staleness is not None else "")
            draw(panels, args.out, f"shardps: digits, {args.workers} workers, {args.shards} shards ({mode}), "
                                   f"{end - begin:.0f} s run scraped every {args.scrape_interval:g} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", action="store_true", help="start shards, a digits job, a replica and Prometheus here")
    source.add_argument("--prometheus", help="URL of a Prometheus that scraped a job (e.g. http://localhost:9090)")
    p.add_argument("--out", type=Path, default=Path("dashboard.png"), help="PNG to write (default dashboard.png)")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD_PATH, help="dashboard JSON (default shardps.json)")
    p.add_argument("--start", type=float, help="--prometheus: range start, Unix seconds (default: --minutes ago)")
    p.add_argument("--end", type=float, help="--prometheus: range end, Unix seconds (default: now)")
    p.add_argument("--minutes", type=float, default=30.0, help="--prometheus: range length (default 30)")
    p.add_argument("--scrape-interval", type=float, default=None,
                   help="seconds between scrapes (default: 1 with --run, 15 with --prometheus)")
    p.add_argument("--shards", type=int, default=2, help="--run: shards (default 2)")
    p.add_argument("--workers", type=int, default=2, help="--run: workers (default 2)")
    p.add_argument("--epochs", type=int, default=40, help="--run: digits epochs (default 40)")
    p.add_argument("--mode", choices=("sync", "async", "ssp"), default="sync", help="--run: consistency mode")
    p.add_argument("--staleness", type=int, default=None, help="--run: ssp's bound")
    p.add_argument("--checkpoint-every-rounds", type=int, default=100, help="--run: shard checkpoints (default 100)")
    p.add_argument("--timeout", type=float, default=600.0, help="--run: seconds the job may take (default 600)")
    args = p.parse_args(argv)
    model = json.loads(args.dashboard.read_text())
    if args.run:
        args.scrape_interval = args.scrape_interval or 1.0
        _run(args, model)
    else:
        scrape = args.scrape_interval or 15.0
        end = args.end if args.end is not None else time.time()
        begin = args.start if args.start is not None else end - 60 * args.minutes
        if not begin < end:
            raise SystemExit(f"render.py: --start {begin} must be before --end {end}")
        prometheus = stack.PrometheusAPI(args.prometheus)
        step = max(scrape, (end - begin) / 300)
        panels = fetch(prometheus, model, begin, end, step, stack.rate_interval(scrape, step))
        draw(panels, args.out, f"shardps: {args.prometheus}, {datetime.fromtimestamp(begin):%Y-%m-%d %H:%M} "
                               f"to {datetime.fromtimestamp(end):%H:%M}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
