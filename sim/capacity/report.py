"""Capacity reports: JSON (byte-identical for identical inputs), CSV, PNG plots, a table.

The JSON names the cost model (name, model, machine, coefficients) so a number in it can be
traced to the measurement behind it. Floats are written by json's repr (exact, and the
same on every run); nothing in it depends on the wall clock or the environment.

Plots use matplotlib's Agg backend (no display). `Figure.savefig` embeds no timestamp in a
PNG when metadata={"Software": None} is passed, so PNGs are reproducible too.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.capacity.cost import FEATURES, CostModel
from sim.capacity.fleet import SimResult
from sim.capacity.plan import CAPACITY_FORMAT, Plan
from sim.files import atomic_open, atomic_path, atomic_write_text


def build_report(*, cost: CostModel, plan: Plan, source: str, seeds: Sequence[int],
                 points: list[dict[str, Any]], searches: list[dict[str, Any]],
                 invalid: int = 0, trace: dict[str, Any] | None = None) -> dict[str, Any]:
    e = plan.engine
    extra: dict[str, Any] = {} if trace is None else {"trace": trace}
    if e.speculative is not None:
        extra["speculation"] = {
            "config": e.speculative.as_json(),
            "acceptance": plan.acceptance, "fit_acceptance": plan.fit_acceptance,
            "stub_copy_prob": plan.copy_prob, "recorded_outputs": plan.recorded}
    return {
        "nanoserve_capacity": CAPACITY_FORMAT,
        "cost_model": {"name": cost.name, "model": cost.model, "machine": cost.machine,
                       "coef": dict(zip(FEATURES, cost.coef, strict=True)),
                       "kv_bytes_per_token": cost.kv_bytes_per_token},
        "load": source,
        "seeds": list(seeds),
        "engine": {"block_size": e.block_size, "max_num_batched_tokens":
                   e.max_num_batched_tokens, "prefix_caching": e.prefix_caching,
                   "max_model_len": e.max_model_len, "seed": e.seed},
        "replicas": plan.replicas,
        "router": plan.router,
        "max_queue": plan.max_queue,
        "warmup": plan.warmup,
        "slo": str(plan.slo) if plan.slo is not None else None,
        "invalid_requests": invalid,
        "points": points,
        "slo_search": searches,
        **extra,
    }


def dumps_report(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1, sort_keys=False) + "\n"


def write_csv(points: Sequence[dict[str, Any]], path: Path) -> None:
    """One row per point and seed ("mean" for the mean over seeds)."""
    if not points:
        atomic_write_text(path, "")
        return
    metrics = list(points[0]["mean"])
    head = ["rate", "num_blocks", "kv_gib", "max_num_seqs", "seed", *metrics]
    with atomic_open(path, newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(head)
        for p in points:
            fixed = [p["rate"], p["num_blocks"], p["kv_gib"], p["max_num_seqs"]]
            w.writerow([*fixed, "mean", *(p["mean"][m] for m in metrics)])
            for k, row in enumerate(p["seeds"]):
                w.writerow([*fixed, k, *(row[m] for m in metrics)])


def write_plots(points: Sequence[dict[str, Any]], timelines: Sequence[tuple[str, SimResult]],
                out_prefix: Path, cost_name: str) -> list[Path]:
    """latency.png: TTFT/TPOT percentiles against rate (one line per setting);
    timeline.png: KV usage and queue length over time of each point's first seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["num_blocks"], p["max_num_seqs"]), []).append(p)
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for (nb, ms), ps in groups.items():
            ps = sorted(ps, key=lambda p: p["rate"])
            rates = [p["rate"] for p in ps]
            for q, style in (("p50", ":"), ("p90", "--"), ("p99", "-")):
                ys = [p["mean"][f"{metric}_{q}"] for p in ps]
                ax.plot(rates, [y if y is not None else float("nan") for y in ys], style,
                        marker="o", ms=3, label=f"{q} blocks={nb} seqs={ms}")
        ax.set_xlabel("rate (requests/s)")
        ax.set_ylabel(f"{metric.upper()} (s)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"latency percentiles vs rate (cost model {cost_name})", fontsize=9)
    fig.tight_layout()
    written.append(_save(fig, Path(f"{out_prefix}.latency.png")))
    plt.close(fig)

    fig, (kv_ax, q_ax) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for label, result in timelines:
        ts = [s.t for s in result.timeline if s.replica == 0]
        nb = max((st.num_blocks for st in result.stats), default=1)
        kv_ax.plot(ts, [s.used_blocks / nb for s in result.timeline if s.replica == 0],
                   lw=0.7, label=label)
        q_ax.plot(ts, [s.queue for s in result.timeline if s.replica == 0], lw=0.7,
                  label=label)
    kv_ax.set_ylabel("KV used (fraction, replica 0)")
    q_ax.set_ylabel("queue (waiting requests)")
    q_ax.set_xlabel("virtual time (s)")
    for ax in (kv_ax, q_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    written.append(_save(fig, Path(f"{out_prefix}.timeline.png")))
    plt.close(fig)
    return written


def _save(fig: Any, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, metadata={"Software": None})
    return path


def table(report: dict[str, Any]) -> str:
    """The points and the SLO search as aligned text."""
    cols = [("rate", "rate"), ("blocks", "num_blocks"), ("GiB", "kv_gib"),
            ("seqs", "max_num_seqs")]
    mets = [("req/s", "request_throughput"), ("tok/s", "output_token_throughput"),
            ("good/s", "goodput"), ("ttft50", "ttft_p50"), ("ttft99", "ttft_p99"),
            ("tpot50", "tpot_p50"), ("tpot99", "tpot_p99"), ("itl99", "itl_p99"),
            ("e2e99", "e2e_p99"), ("queue", "queue_mean"), ("kv", "kv_mean_used_fraction"),
            ("preempt", "preemptions"), ("hit", "prefix_hit_rate"), ("429", "rejected_429"),
            ("abort", "aborted")]
    lines = [" ".join(f"{h:>8}" for h, _ in cols + mets) + "   (mean over seeds; ± spread)"]
    for p in report["points"]:
        cells = [_cell(p[k]) for _, k in cols]
        for _, k in mets:
            lo, hi = p["min"][k], p["max"][k]
            cell = _cell(p["mean"][k])
            if lo is not None and hi is not None and hi - lo > 0 and k.endswith("_p99"):
                cell += f"±{(hi - lo) / 2:.2g}"
            cells.append(cell)
        lines.append(" ".join(f"{c:>8}" for c in cells))
    for s in report["slo_search"]:
        rate = "none" if s["max_rate"] is None else f"{s['max_rate']:.4g} req/s"
        lines.append(f"SLO {report['slo']}: blocks={s['num_blocks']} ({s['kv_gib']:.3g} GiB) "
                     f"seqs={s['max_num_seqs']}: highest rate {rate} (fails at "
                     f"{s['fails_at'] if s['fails_at'] is None else format(s['fails_at'], '.4g')};"
                     f" {len(s['tried'])} runs)")
    trace = report.get("trace")
    if trace is not None:
        implied = trace["implied_prefix_hit_rate"]
        lines.append(f"trace: {trace['rows']} requests ({trace['format']}, as published by "
                     f"{trace['format_origin']}"
                     + "".join(f"; {n} left out: {why}" for why, n in trace["dropped"].items())
                     + ")" + ("" if implied is None else
                              f"; prefix hit rate the trace implies (unbounded cache): "
                              f"{implied:.4f}, planned: the 'hit' column"
                              + ("" if trace["prefix_structure"] else
                                 " (prefix structure ignored)")))
    lines.append(f"cost model: {report['cost_model']['name']} ({report['cost_model']['model']}"
                 f" on {report['cost_model']['machine'].get('cpu', '?')})")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
