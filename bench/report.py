"""Tables (Markdown) and plots (PNG) from ``results.jsonl``: what ``run.py`` prints at the end
and what ``docs/performance.md`` shows. ``python bench/run.py --replot [--docs]`` redraws them."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from typing import Any

SLOW_PEERS = ["xbatcher0", "isel0", "isel2"]
NT = 1460
NVARS = 4
DOCS_IMG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img")


def med(vals: list[float]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def peer_summary(rows: list[dict]) -> list[dict]:
    """Per (archive length, store, peer): medians over repeats; ratios to the ceiling of the same
    repeat; "xinsitu is × faster" against the median of xinsitu's runs."""
    out = []
    groups = list(dict.fromkeys((r.get("length", 1), r["store"]) for r in rows))
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    for length, s in groups:
        here = [r for r in rows if r.get("length", 1) == length and r["store"] == s]
        ceil = {r["repeat"]: r for r in here if r["peer"] == "ceiling" and not r.get("error")}
        ins = [r for r in here if r["peer"] == "xinsitu" and not r.get("error")]
        eps_ins = med([r.get("epoch_sps") for r in ins])
        for p in peers:
            rs = [r for r in here if r["peer"] == p and not r.get("error")]
            if not rs:
                err = next((r.get("error") for r in here if r["peer"] == p), None)
                if err:
                    out.append({"length": length, "store": s, "peer": p, "error": err})
                continue
            fast = p not in SLOW_PEERS
            ratio = [r["samples_per_s"] / ceil[r["repeat"]]["samples_per_s"] for r in rs if r["repeat"] in ceil]
            ratio_epoch = [
                r["epoch_sps"] / ceil[r["repeat"]]["samples_per_s"]
                for r in rs
                if r["repeat"] in ceil and r.get("epoch_sps") and fast
            ]
            sps = med([r["samples_per_s"] for r in rs])
            out.append(
                {
                    "length": length,
                    "store": s,
                    "peer": p,
                    "runs": len(rs),
                    "samples_per_s": sps,
                    "epoch_sps": med([r.get("epoch_sps") for r in rs]) if fast else None,
                    "mb_per_s": med([r["mb_per_s"] for r in rs]),
                    "first_batch_s": med([r.get("first_batch_s") for r in rs]),
                    "cpu_us_per_sample": med([r.get("cpu_us_per_sample") for r in rs]),
                    "peak_rss_mb": med([r["peak_rss_mb"] for r in rs]),
                    "procs": max(r.get("procs", 1) for r in rs),
                    "x_ceiling": med(ratio) if ratio else None,
                    "x_ceiling_min": min(ratio) if ratio else None,
                    "x_ceiling_epoch": med(ratio_epoch) if ratio_epoch else None,
                    "xinsitu_x": eps_ins / sps if eps_ins and sps and p in SLOW_PEERS else None,
                    "complete_epoch": all(r.get("complete_epoch", True) for r in rs),
                }
            )
    return out


def peer_table(summary: list[dict]) -> str:
    """Whole-epoch columns first (what a training loop sees, first batch included); then the
    rate after the first ``warmup`` batches, which is what the shared yardstick reports."""
    lines = [
        "| archive | store | peer | samples/s, whole epoch | × ceiling | samples/s after 2 batches | × ceiling "
        "| MB/s | first batch s | CPU µs/sample | peak RSS MB | xinsitu is × faster (whole epoch) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v: Any, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    for r in summary:
        arch = f"{r['length']}×"
        if r.get("error"):
            lines.append(f"| {arch} | {r['store']} | {r['peer']} | failed: {r['error'][:80]} | | | | | | | | |")
            continue
        ceil = r["peer"] == "ceiling"
        rng = f" (min {r['x_ceiling_min']:.2f})" if r["x_ceiling"] is not None and r["runs"] > 1 and not ceil else ""
        fx = "–"
        if r["xinsitu_x"] is not None:
            fx = f(r["xinsitu_x"], ".0f")
        mb = r["epoch_sps"] if r["epoch_sps"] is not None else r["samples_per_s"]
        mb = mb * r["mb_per_s"] / r["samples_per_s"] if r["samples_per_s"] else None
        lines.append(
            f"| {arch} | {r['store']} | {r['peer']} | {f(r['epoch_sps'], '.0f')} | "
            f"{'1' if ceil else f(r['x_ceiling_epoch'], '.2f')} | {f(r['samples_per_s'], '.0f')} | "
            f"{'1' if ceil else f(r['x_ceiling'], '.2f') + rng} | {f(mb, '.0f')} | {f(r['first_batch_s'], '.2f')} | "
            f"{f(r['cpu_us_per_sample'], '.0f')} | {f(r['peak_rss_mb'], '.0f')}"
            f"{' (' + str(r['procs']) + ' procs)' if r['procs'] > 1 else ''} | {fx} |"
        )
    return "\n".join(lines)


def targets(summary: list[dict]) -> list[str]:
    """The issue's targets, checked against this run (reported, never asserted)."""
    by = {(r["length"], r["store"], r["peer"]): r for r in summary if not r.get("error")}
    lines = []
    for length, s in dict.fromkeys((r["length"], r["store"]) for r in summary):
        ins, ordd = by.get((length, s, "xinsitu")), by.get((length, s, "xinsitu_ordered"))
        checks = []
        for row, goal, label in ((ins, 0.85, "shuffled"), (ordd, 0.90, "unshuffled")):
            if row and row.get("x_ceiling") is not None:
                checks.append((f"{label} ≥ {goal:.2f} × ceiling (steady)", row["x_ceiling"], goal))
            if row and row.get("x_ceiling_epoch") is not None:
                checks.append((f"{label} ≥ {goal:.2f} × ceiling (whole epoch)", row["x_ceiling_epoch"], goal))
        for peer, goal, label in (("xbatcher0", 20, "≥ 20× xbatcher"), ("isel2", 10, "≥ 10× isel, 2 workers")):
            row = by.get((length, s, peer))
            if row and row.get("xinsitu_x") is not None:
                checks.append((label, row["xinsitu_x"], goal))
        for label, val, goal in checks:
            lines.append(f"- {length}× {s}: {label}: {val:.2f} {'met' if val >= goal else 'NOT met'}")
    return lines


def wait_table(rows: list[dict]) -> str:
    lines = [
        "| store | read / batch ms | model step ms | batches | epoch s | `io_stats['wait_s']` s | waited % "
        "| 1st `next()` s | later `next()` ms/batch | waited % after 1st batch |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("error"):
            continue
        for w in r["runs"]:
            lines.append(
                f"| {r['store']} | {r['read_per_batch_s'] * 1e3:.1f} | {w['factor']:.1f} × read = "
                f"{w['step_s'] * 1e3:.1f} | {w['batches']} | {w['seconds']:.2f} | {w['wait_s']:.3f} | "
                f"{100 * w['wait_frac']:.1f} | {w['first_wait_s']:.3f} | "
                f"{1e3 * w['wait_after_first_s'] / max(1, w['batches'] - 1):.2f} | "
                f"{100 * w['wait_frac_after_first']:.1f} |"
            )
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    lines = [
        "| archive | train chunks | store | block_chunks | max_inflight | RSS before 1st batch MB | peak MB "
        "| above baseline MB | bound, 1 var MB | bound, 4 vars MB | samples/s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("error"):
            continue
        lines.append(
            f"| {r['length']}× ({r.get('steps', NT * r['length'])} steps) | {r['train_chunks']} | {r['store']} | "
            f"{r['block_chunks']} | {r['max_inflight']} | {r['baseline_mb']:.0f} | {r['peak_mb']:.0f} | "
            f"{r['delta_mb']:.0f} | {r['bound_mb']:.0f} | {r['bound_unit_mb']:.0f} | "
            f"{r['samples_per_s']:.0f} |"
        )
    return "\n".join(lines)


def scaling_table(rows: list[dict]) -> str:
    lines = [
        "| sweep | value | store | epoch samples/s | × ceiling (median; each round) | ceiling samples/s "
        "| first batch s | shuffle quality |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['sweep']} | | {r['store']} | failed: {r['error'][:60]} | | | | |")
            continue
        each = ", ".join(f"{x:.2f}" for x in r.get("x_ceiling_all", []))
        lines.append(
            f"| {r['sweep']} | {r['value']} | {r['store']} | {r['epoch_sps']:.0f} | {r['x_ceiling']:.2f} ({each}) | "
            f"{r['ceiling_sps']:.0f} | {r['first_batch_s']:.2f} | {r['shuffle_quality']:.2f} |"
        )
    return "\n".join(lines)


def profile_text(res: dict) -> str:
    return res.get("text", "")


# ----------------------------------------------------------------------------- loading
def load(out_dir: str, run: str | None = None) -> dict[str, list[dict]]:
    """Rows per section: of ``run``, or of the latest run that has the section; under "meta",
    the run records (code version, machine) of the runs used."""
    path = os.path.join(out_dir, "results.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by: dict[str, dict[str, list[dict]]] = {}
    metas = {}
    for r in rows:
        if r.get("section") == "meta":
            metas[r["run"]] = r
            continue
        by.setdefault(r["section"], {}).setdefault(r["run"], []).append(r)
    out: dict[str, list[dict]] = {}
    for sec, runs in by.items():
        if run is not None:
            if run in runs:
                out[sec] = runs[run]
        else:
            out[sec] = runs[max(runs)]
    out["meta"] = [
        {**metas.get(rows_[0]["run"], {"run": rows_[0]["run"]}), "section": sec} for sec, rows_ in out.items() if rows_
    ]
    return out


# ----------------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_peers(summary: list[dict], path: str) -> None:
    plt = _plt()
    rows = [r for r in summary if not r.get("error") and r.get("length", 1) == 1]
    stores = list(dict.fromkeys(r["store"] for r in rows))
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.8))
    w = 0.8 / max(1, len(peers))
    colors = {
        "ceiling": "#444444",
        "xinsitu": "#1f77b4",
        "xinsitu_ordered": "#6baed6",
        "xbatcher0": "#d62728",
        "isel0": "#ff9896",
        "isel2": "#ff7f0e",
    }
    for k, p in enumerate(peers):
        xs, ys = [], []
        for i, s in enumerate(stores):
            r = next((r for r in rows if r["store"] == s and r["peer"] == p), None)
            if r:
                xs.append(i + (k - (len(peers) - 1) / 2) * w)
                ys.append(r["epoch_sps"] if r.get("epoch_sps") else r["samples_per_s"])
        bars = ax.bar(xs, ys, w, label=p, color=colors.get(p))
        for b, y in zip(bars, ys, strict=True):
            ax.text(
                b.get_x() + b.get_width() / 2, y * 1.08, f"{y:.0f}", ha="center", va="bottom", fontsize=7, rotation=90
            )
    for i, s in enumerate(stores):
        r = next((r for r in rows if r["store"] == s and r["peer"] == "xinsitu"), None)
        if r and r.get("x_ceiling_epoch") is not None:
            ax.text(i, 1.5, f"xinsitu = {r['x_ceiling_epoch']:.2f} × ceiling", ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(1, max(r["samples_per_s"] for r in rows) * 6)
    ax.set_xticks(range(len(stores)))
    ax.set_xticklabels([{"local": "local disk"}.get(s, s.replace("http:", "HTTP +") + " ms/request") for s in stores])
    ax.set_ylabel("samples / s (log); xinsitu and ceiling: whole epoch")
    ax.set_title("Shuffled batches of 32 time steps × 4 variables, one epoch of the train split")
    ax.legend(ncol=3, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(rows: list[dict], path: str) -> None:
    plt = _plt()
    ok = [r for r in rows if not r.get("error")]
    sweeps = [
        ("max_inflight", "max_inflight (requests in flight)"),
        ("block_chunks", "block_chunks (chunks per shuffle block)"),
        ("chunk_time", "time steps per chunk (1× archive)"),
        ("decode_threads", "XINSITU_DECODE_THREADS"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (sw, label) in zip(axes.flat, sweeps, strict=True):
        rs = [r for r in ok if r["sweep"] == sw]
        for store in dict.fromkeys(r["store"] for r in rs):
            pts = sorted((r["value"], r["x_ceiling"]) for r in rs if r["store"] == store)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=f"xinsitu, {store}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.axhline(0.85, color="r", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("whole-epoch rate / ceiling")
        ax.set_ylim(0, max(1.3, max(r["x_ceiling"] for r in rs) * 1.1) if rs else 1.3)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("xinsitu / the read+decode ceiling (64 requests in flight, same decode threads), as knobs change")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(rows: list[dict], path: str) -> None:
    plt = _plt()
    ok = [r for r in rows if not r.get("error")]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    labels = [f"{r['length']}× · {r['block_chunks']}/{r['max_inflight']}" for r in ok]
    xs = range(len(ok))
    ax.bar(xs, [r["delta_mb"] for r in ok], 0.6, label="peak RSS above the RSS before the 1st batch")
    ax.scatter(
        xs,
        [r["bound_mb"] for r in ok],
        marker="_",
        s=600,
        color="k",
        label="(block_chunks + max_inflight) × chunk × 1.5, chunk of one variable",
    )
    ax.scatter(
        xs,
        [r["bound_unit_mb"] for r in ok],
        marker="_",
        s=600,
        color="r",
        label=f"the same with the chunk of all {NVARS} variables",
    )
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel("archive length × · block_chunks / max_inflight")
    ax.set_ylabel("MB")
    ax.legend(fontsize=8)
    ax.set_title("Memory: bounded by the settings, not by the archive's length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_wait(rows: list[dict], path: str) -> None:
    plt = _plt()
    ok = [r for r in rows if not r.get("error")]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels, model, wait = [], [], []
    for r in ok:
        for w in r["runs"]:
            labels.append(f"{r['store']}\nstep {w['factor']:.1f}× read")
            model.append(w["model_s"])
            wait.append(w["wait_s"])
    xs = range(len(labels))
    ax.bar(xs, model, 0.6, label="model step (sleep)")
    ax.bar(xs, wait, 0.6, bottom=model, label="waiting for the next batch")
    for x, m, wt in zip(xs, model, wait, strict=True):
        ax.text(x, m + wt, f"{100 * wt / (m + wt):.0f} %", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("seconds per epoch")
    ax.set_title("A training loop waits only when the model is faster than the read")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- all of it
def write_all(out_dir: str, run: str | None = None, docs: bool = False) -> str:
    secs = load(out_dir, run)
    parts, plots = [], []
    for m in secs.pop("meta", []):
        mach = m.get("machine", {})
        parts.append(
            f"- {m['section']}: run {m['run']}, code {m.get('code', '?')}, {mach.get('cpus', '?')} CPUs, "
            f"Python {mach.get('python', '?')}"
        )
    parts.append("")
    if "peers" in secs:
        summ = peer_summary(secs["peers"])
        parts += ["## Peers", "", peer_table(summ), "", *targets(summ), ""]
        plots.append(("bench_throughput.png", plot_peers, summ))
    if "wait" in secs:
        parts += ["## Waiting for batches", "", wait_table(secs["wait"]), ""]
        plots.append(("bench_wait.png", plot_wait, secs["wait"]))
    if "memory" in secs:
        parts += ["## Memory", "", memory_table(secs["memory"]), ""]
        plots.append(("bench_memory.png", plot_memory, secs["memory"]))
    if "scaling" in secs:
        parts += ["## Scaling", "", scaling_table(secs["scaling"]), ""]
        plots.append(("bench_scaling.png", plot_scaling, secs["scaling"]))
    if "profile" in secs:
        parts += ["## Profile", "", "```", profile_text(secs["profile"][-1]), "```", ""]
    for name, fn, rows in plots:
        try:
            fn(rows, os.path.join(out_dir, name))
        except Exception as e:  # noqa: BLE001 - a plot is no reason to lose the tables
            parts.append(f"(plot {name} failed: {type(e).__name__}: {e})")
            continue
        if docs:
            os.makedirs(DOCS_IMG, exist_ok=True)
            shutil.copy(os.path.join(out_dir, name), os.path.join(DOCS_IMG, name))
    text = "\n".join(parts)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text + "\n")
    return text
