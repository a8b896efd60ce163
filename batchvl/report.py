"""Run report: the run's summary, stage breakdowns per row and per prefill batch, and PNG plots, from the Parquet parts
and the manifest (`batchvl report RUN_DIR`, `python -m batchvl.runner report RUN_DIR`, `python -m batchvl.report
RUN_DIR`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchvl.output import (
    REPORT_DIR,
    STAGE_COLUMNS,
    describe,
    format_summary,
    read_manifest,
    read_rows,
    run_durations,
    run_summary,
    startup,
    upgrade_layout,
)

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


class NotARunError(ValueError):
    """The folder given to the report is not a batchvl run dir."""


BATCH_STAGES = (("input_wait_ms", "input wait", "tab:gray"), ("vit_ms", "ViT", "tab:purple"),
                ("prefill_ms", "prefill", "tab:blue"), ("decode_ms", "decode", "tab:green"))  # fmt: skip


def batch_stages(table: pa.Table) -> pa.Table:
    """One row per prefill batch (run, rank, batch_id): its start and end (job clock of its run), rows, and its
    input wait, ViT, prefill (shared by its rows) and decode (its longest row's) ms."""
    rows = table.filter(pc.is_valid(table.column("batch_id")))
    rows = rows.set_column(rows.schema.get_field_index("run"), "run", pc.fill_null(rows.column("run"), 0))
    aggs = [("id", "count"), ("t_batch_start_s", "min"), ("t_done_s", "max")]
    aggs += [(c, "max") for c, _, _ in BATCH_STAGES]
    out = rows.group_by(["run", "rank", "batch_id"]).aggregate(aggs)
    names = {"id_count": "rows", "t_batch_start_s_min": "start_s", "t_done_s_max": "end_s"}
    out = out.rename_columns([names.get(n, n.removesuffix("_max")) for n in out.column_names])
    return out.sort_by([("run", "ascending"), ("start_s", "ascending")])


def format_batches(batches: pa.Table) -> str:
    """Per-batch stage times: mean/median/p99 over batches and each stage's share of their sum."""
    lines = ["{s:{c}^64}".format(s=f" Per Prefill Batch ({batches.num_rows} batches) ", c="=")]
    lines.append(f"{'Stage':<14}{'Mean (ms)':>11}{'Median (ms)':>13}{'P99 (ms)':>11}{'Share':>7}")
    sums = {c: float(pc.sum(batches.column(c)).as_py() or 0.0) for c, _, _ in BATCH_STAGES}
    total = sum(sums.values())
    for c, name, _ in BATCH_STAGES:
        d = describe(batches.column(c).to_pylist())
        ms = [("n/a" if d[k] is None else f"{d[k]:.2f}") for k in ("mean", "median", "p99")]
        share = f"{100 * sums[c] / total:.1f}%" if total else "n/a"
        lines.append(f"{name:<14}{ms[0]:>11}{ms[1]:>13}{ms[2]:>11}{share:>7}")
    lines.append("=" * 64)
    return "\n".join(lines)


def _offsets(durations: dict[int, float]) -> dict[int, float]:
    """Where each run's clock starts on the plots' shared axis: runs side by side, in order."""
    out, at = {}, 0.0
    for k, d in durations.items():
        out[k], at = at, at + d
    return out


def _plot_stages(batches: pa.Table, path: Path) -> None:
    """Stacked bars, one per batch in time order: its input wait, ViT, prefill and decode ms."""
    fig = _figure(figsize=(10, 4.5))
    ax = fig.subplots()
    x = np.arange(batches.num_rows)
    bottom = np.zeros(batches.num_rows)
    for c, name, color in BATCH_STAGES:
        v = np.asarray(pc.fill_null(batches.column(c), 0.0).to_pylist(), dtype=np.float64)
        ax.bar(x, v, bottom=bottom, color=color, label=name, width=1.0 if len(x) > 50 else 0.8)
        bottom += v
    ax.set_xlabel("prefill batch (in start order; runs and ranks one after another)")
    ax.set_ylabel("ms")
    ax.set_title("Stage breakdown per prefill batch")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _rolling(done: np.ndarray, weights: np.ndarray, grid: np.ndarray, window: float) -> np.ndarray:
    """Sum of `weights` of the events at times `done` in (g - window, g] for each g of `grid`, per second."""
    order = np.argsort(done)
    cum = np.concatenate([[0.0], np.cumsum(weights[order])])
    t = done[order]
    return (cum[np.searchsorted(t, grid, "right")] - cum[np.searchsorted(t, grid - window, "right")]) / window


def _plot_throughput(table: pa.Table, durations: dict[int, float], manifest: dict, path: Path) -> None:
    """Completed requests/s and output tokens/s on a rolling window, each run on its own segment of the axis, with
    its start-up (load, warm-up: before its clock starts) noted and the ViT's compiles during the job shaded."""
    ok = _ok(table).filter(pc.is_valid(_ok(table).column("t_done_s")))
    numbers = np.asarray(pc.fill_null(ok.column("run"), 0).to_pylist(), dtype=np.int64)
    t = np.asarray(ok.column("t_done_s").to_pylist(), dtype=np.float64)
    out_tok = np.asarray(
        pc.fill_null(pc.list_value_length(ok.column("output_token_ids")), 0), dtype=np.float64
    )
    runs = {r.get("run", i): r for i, r in enumerate(manifest.get("runs") or [])}
    offsets = _offsets(durations)
    window = max(sum(durations.values()) / 30, 1e-3)
    fig = _figure(figsize=(10, 6))
    axes = fig.subplots(2, 1, sharex=True)
    for k, dur in durations.items():
        mine = numbers == k
        grid = np.linspace(0.0, max(dur, 1e-3), 200)
        axes[0].plot(
            offsets[k] + grid, _rolling(t[mine], np.ones(mine.sum()), grid, window), color="tab:blue"
        )
        axes[1].plot(offsets[k] + grid, _rolling(t[mine], out_tok[mine], grid, window), color="tab:green")
        for ax in axes:
            ax.axvline(offsets[k], color="black", linestyle="--", linewidth=0.8)
        run = runs.get(k)
        note = f"run {k}"
        if run:
            first = startup(run)
            note += f": load {first['load_s'] or 0:.1f} s + warm-up {first['warm_up_s'] or 0:.1f} s before"
            if first["vit_compile_s"]:
                note += f", ViT compiles {first['vit_compile_s']:.1f} s (shaded)"
                axes[0].axvspan(
                    offsets[k], offsets[k] + min(first["vit_compile_s"], dur), color="tab:red", alpha=0.15
                )
        axes[0].annotate(note, (offsets[k], 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                         textcoords="offset points", fontsize=8)  # fmt: skip
    axes[0].set_ylabel("completed requests/s")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_xlabel(f"seconds of job clock, runs side by side (rolling window of {window:.3g} s)")
    axes[0].set_title("Throughput over time (successful requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_timeline(batches: pa.Table, durations: dict[int, float], path: Path) -> None:
    """One lane per rank; each batch split into its stages: input wait before its start, then ViT, prefill and
    decode to its last row's end."""
    offsets = _offsets(durations)
    ranks = sorted({r for r in batches.column("rank").to_pylist() if r is not None})
    fig = _figure(figsize=(10, 0.6 * max(len(ranks), 1) + 2))
    ax = fig.subplots()
    for b in batches.to_pylist():
        if b["start_s"] is None or b["end_s"] is None or b["rank"] is None:
            continue
        lane, at = ranks.index(b["rank"]), offsets.get(b["run"], 0.0) + b["start_s"]
        wait = (b["input_wait_ms"] or 0.0) / 1e3
        spans = [(at - wait, wait)]
        for c in ("vit_ms", "prefill_ms"):
            spans.append((at, (b[c] or 0.0) / 1e3))
            at += spans[-1][1]
        ax.broken_barh(
            spans, (lane - 0.4, 0.8), facecolors=[c for _, _, c in BATCH_STAGES[:3]], edgecolor="none"
        )
        decode = (
            at,
            max(offsets.get(b["run"], 0.0) + b["end_s"] - at, 0.0),
        )  # overlaps later batches: a thin band
        ax.broken_barh(
            [decode], (lane - 0.4, 0.15), facecolors=BATCH_STAGES[3][2], edgecolor="white", linewidth=0.3
        )
    for off in offsets.values():
        ax.axvline(off, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds of job clock, runs side by side")
    ax.set_title("Prefill batches per rank, split into stages")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=n) for _, n, c in BATCH_STAGES]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(run_dir: str | Path, plots: bool = True) -> tuple[str, list[Path]]:
    """The summary (run_summary: the figures of _summary.json), the stage breakdowns, and with `plots` the PNGs
    written to RUN_DIR/_report/; returns (text, the paths written). NotARunError for a folder that is not a run."""
    d = Path(run_dir)
    if not d.is_dir():
        raise NotARunError(f"{d} is not a directory")
    upgrade_layout(d)
    manifest = read_manifest(d)
    if manifest is None:
        raise NotARunError(f"{d} is not a batchvl run dir (no _manifest.json); give the output.dir of a run")
    table = read_rows(d)
    summary = run_summary(d, manifest)
    batches = batch_stages(table)
    text = "\n\n".join(
        [format_summary(summary), format_breakdown(stage_breakdown(table)), format_batches(batches)]
    )
    written: list[Path] = []
    if plots:
        out = d / REPORT_DIR
        out.mkdir(exist_ok=True)
        durations = run_durations(table, manifest.get("runs") or []) or {0: 0.0}
        written = [out / "stages.png", out / "throughput.png", out / "timeline.png"]
        _plot_stages(batches, written[0])
        _plot_throughput(table, durations, manifest, written[1])
        _plot_timeline(batches, durations, written[2])
    return text, written


@click.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--no-plots", is_flag=True, help="Tables only, no PNG plots.")
def report_cmd(run_dir: str, no_plots: bool) -> None:
    """Print the report of a run (the figures of its _summary.json) and write its plots to RUN_DIR/_report/."""
    try:
        text, written = report(run_dir, plots=not no_plots)
    except NotARunError as e:
        raise click.ClickException(str(e)) from None
    click.echo(text)
    for path in written:
        click.echo(f"wrote {path}")


if __name__ == "__main__":
    report_cmd(prog_name="python -m batchvl.report")
