"""Run report: benchmark summary, per-stage time breakdown and PNG plots, all from the Parquet parts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchvl.output import STAGE_COLUMNS, describe, format_summary, read_rows, summarize

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def stage_name(column: str) -> str:
    """Display name of a stage column: 'queue_ms' -> 'queue'."""
    return column.removesuffix("_ms")


def _ok(table: pa.Table) -> pa.Table:
    """Rows without an error."""
    return table.filter(pc.is_null(table.column("error")))


def stage_breakdown(table: pa.Table) -> pa.Table:
    """Per stage over successful rows: count, mean/median/p99 ms, and share = stage sum / sum over all stages."""
    ok = _ok(table)
    sums = {c: float(pc.sum(ok.column(c)).as_py() or 0.0) for c in STAGE_COLUMNS}
    total = sum(sums.values())
    rows = []
    for c in STAGE_COLUMNS:
        col = ok.column(c)
        rows.append(
            {
                "stage": stage_name(c),
                "count": len(col) - col.null_count,
                **{f"{k}_ms": v for k, v in describe(col.to_pylist()).items()},
                "share": sums[c] / total if total else None,
            }
        )
    schema = pa.schema(
        [("stage", pa.string()), ("count", pa.int64())]
        + [(f"{k}_ms", pa.float64()) for k in ("mean", "median", "p99")]
        + [("share", pa.float64())]
    )
    return pa.Table.from_pylist(rows, schema=schema)


def format_breakdown(breakdown: pa.Table) -> str:
    """Fixed-width text table of stage_breakdown()."""
    lines = ["{s:{c}^64}".format(s=" Stage Breakdown (successful rows) ", c="=")]
    lines.append(f"{'Stage':<14}{'Count':>8}{'Mean (ms)':>11}{'Median (ms)':>13}{'P99 (ms)':>11}{'Share':>7}")
    for r in breakdown.to_pylist():
        cells = [r["mean_ms"], r["median_ms"], r["p99_ms"]]
        ms = [("n/a" if v is None else f"{v:.2f}") for v in cells]
        share = "n/a" if r["share"] is None else f"{100 * r['share']:.1f}%"
        lines.append(f"{r['stage']:<14}{r['count']:>8}{ms[0]:>11}{ms[1]:>13}{ms[2]:>11}{share:>7}")
    lines.append("=" * 64)
    return "\n".join(lines)


def _figure(**kwargs: object) -> Figure:
    """A Figure on an Agg canvas (no pyplot, so no global backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _plot_stages(breakdown: pa.Table, path: Path) -> None:
    """Horizontal bars of mean ms per stage, labelled with the share of total."""
    names = breakdown.column("stage").to_pylist()
    means = [v or 0.0 for v in breakdown.column("mean_ms").to_pylist()]
    shares = breakdown.column("share").to_pylist()
    fig = _figure(figsize=(8, 0.5 * len(names) + 1.5))
    ax = fig.subplots()
    bars = ax.barh(names, means, color="tab:blue")
    ax.invert_yaxis()
    labels = [f"{m:.1f} ms ({100 * (s or 0):.0f}%)" for m, s in zip(means, shares, strict=True)]
    ax.bar_label(bars, labels=labels, padding=3)
    ax.set_xlabel("mean ms per request")
    ax.set_title("Stage breakdown (successful requests)")
    ax.margins(x=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_throughput(table: pa.Table, path: Path) -> None:
    """Completed requests/s and tokens/s over time, binned on t_done_s."""
    ok = _ok(table)
    ok = ok.filter(pc.is_valid(ok.column("t_done_s")))
    t = np.asarray(ok.column("t_done_s").to_pylist(), dtype=np.float64)
    out_tok = np.asarray(
        pc.fill_null(pc.list_value_length(ok.column("output_token_ids")), 0), dtype=np.float64
    )
    in_cols = [pc.fill_null(ok.column(c), 0).to_numpy() for c in ("num_text_tokens", "num_image_tokens")]
    in_tok = np.asarray(in_cols[0] + in_cols[1], dtype=np.float64)
    end = float(t.max()) if t.size else 1.0
    width = 1.0 if end >= 20 else max(end, 1e-3) / 20  # 1 s bins, finer for short runs
    n_bins = max(1, int(np.ceil(end / width)))
    edges = np.linspace(0.0, max(n_bins * width, end), n_bins + 1)
    fig = _figure(figsize=(9, 7))
    axes = fig.subplots(3, 1, sharex=True)
    series = (("completed requests/s", None), ("output tokens/s", out_tok), ("input tokens/s", in_tok))
    for ax, (label, weights), color in zip(
        axes, series, ("tab:blue", "tab:green", "tab:orange"), strict=True
    ):
        ax.stairs(np.histogram(t, edges, weights=weights)[0] / width, edges, fill=True, color=color)
        ax.set_ylabel(label)
    axes[-1].set_xlabel(f"seconds since job start (bins of {width:.3g} s, by t_done_s)")
    axes[0].set_title("Completions over time (successful requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_timeline(table: pa.Table, path: Path) -> None:
    """One lane per rank; each batch a bar from its first t_batch_start_s to its last t_done_s."""
    rows = table.filter(pc.is_valid(table.column("batch_id")))
    batches = rows.group_by(["rank", "batch_id"]).aggregate([("t_batch_start_s", "min"), ("t_done_s", "max")])
    ranks = sorted({r for r in batches.column("rank").to_pylist() if r is not None})
    fig = _figure(figsize=(10, 0.6 * max(len(ranks), 1) + 1.5))
    ax = fig.subplots()
    for lane, rank in enumerate(ranks):
        mine = (
            batches.filter(pc.equal(batches.column("rank"), rank)).sort_by("t_batch_start_s_min").to_pylist()
        )
        spans = [
            (b["t_batch_start_s_min"], b["t_done_s_max"] - b["t_batch_start_s_min"])
            for b in mine
            if b["t_batch_start_s_min"] is not None and b["t_done_s_max"] is not None
        ]
        colors = ["tab:blue" if i % 2 == 0 else "tab:orange" for i in range(len(spans))]
        ax.broken_barh(spans, (lane - 0.4, 0.8), facecolors=colors, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds since job start")
    ax.set_title("Batches per rank (t_batch_start_s -> t_done_s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(run_dir: str | Path, plots: bool = True) -> str:
    """Return summary + stage breakdown text for `run_dir`; with plots, write report/{stages,throughput,timeline}.png."""
    table = read_rows(run_dir)
    breakdown = stage_breakdown(table)
    if plots:
        out = Path(run_dir) / "report"
        out.mkdir(parents=True, exist_ok=True)
        _plot_stages(breakdown, out / "stages.png")
        _plot_throughput(table, out / "throughput.png")
        _plot_timeline(table, out / "timeline.png")
    return format_summary(summarize(table)) + "\n\n" + format_breakdown(breakdown)
