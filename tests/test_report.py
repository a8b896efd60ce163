"""Tests for batchvl.report: stage breakdown numbers, text and PNG plots."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchvl.output import ROW_SCHEMA, PartWriter, run_summary, write_manifest, write_summary
from batchvl.report import NotARunError, batch_stages, report, report_cmd, stage_breakdown

STAGES = ("queue", "preprocess", "batch_wait", "vit", "prefill", "decode")


def _rows():
    """Two ranks, two batches each, 3 rows per batch; one failed row with huge stage times."""
    rows = []
    for rank in (0, 1):
        for b in range(2):
            start = 0.5 + b * 1.0 + rank * 0.2
            for j in range(3):
                k = rank * 6 + b * 3 + j
                rows.append(
                    {
                        "id": f"r{k}",
                        "rank": rank,
                        "batch_id": b,
                        "num_text_tokens": 20 + j,
                        "num_image_tokens": 256,
                        "output_token_ids": list(range(4 + j)),
                        "queue_ms": 10.0 + k,
                        "preprocess_ms": 5.0 + j,
                        "batch_wait_ms": 2.0 * k,
                        "vit_ms": None if j == 2 else 30.0,  # cache hit: ViT did not run
                        "prefill_ms": 50.0 + b,
                        "decode_ms": 100.0 + 10 * j,
                        "e2e_ms": 200.0 + k,
                        "ttft_ms": 100.0 + k,
                        "tpot_ms": 25.0,
                        "t_batch_start_s": start,
                        "t_done_s": start + 0.8 + 0.05 * j,
                    }
                )
    rows.append({"id": "bad", "rank": 1, "batch_id": 9, "error": "boom", "queue_ms": 1e6, "vit_ms": 1e6})
    return rows


def test_stage_breakdown_numbers():
    rows = _rows()
    bd = {r["stage"]: r for r in stage_breakdown(pa.Table.from_pylist(rows, schema=ROW_SCHEMA)).to_pylist()}
    assert tuple(bd) == STAGES
    ok = [r for r in rows if r.get("error") is None]
    sums = {s: sum(r[f"{s}_ms"] or 0.0 for r in ok) for s in STAGES}
    for s in STAGES:
        vals = [r[f"{s}_ms"] for r in ok if r[f"{s}_ms"] is not None]
        assert bd[s]["count"] == len(vals)
        assert bd[s]["mean_ms"] == pytest.approx(np.mean(vals))
        assert bd[s]["median_ms"] == pytest.approx(np.median(vals))
        assert bd[s]["p99_ms"] == pytest.approx(np.percentile(vals, 99))
        assert bd[s]["share"] == pytest.approx(sums[s] / sum(sums.values()))
    assert bd["vit"]["count"] == 8 and bd["vit"]["mean_ms"] == pytest.approx(30.0)  # failed row excluded
    assert sum(r["share"] for r in bd.values()) == pytest.approx(1.0)


def _run_dir(
    path, rows, runs=({"run": 0, "duration_s": 2.5, "load_s": 1.0, "warm_up_s": 0.5, "counts": []},)
):
    with PartWriter(path, rank=0, rows_per_part=4) as w0, PartWriter(path, rank=1, rows_per_part=4) as w1:
        for r in rows:
            (w0 if r["rank"] == 0 else w1).add(r)
    write_manifest(path, {"job_fingerprint": "j", "model_fingerprint": "m", "runs": list(runs)})
    return path


def test_report_writes_pngs_and_text(tmp_path):
    _run_dir(tmp_path, _rows())
    text, written = report(tmp_path)
    assert [p.name for p in written] == ["stages.png", "throughput.png", "timeline.png"]
    for p in written:
        data = p.read_bytes()
        assert p.parent == tmp_path / "_report" and len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    for s in STAGES:
        assert s in text
    assert (
        "Serving Benchmark Result" in text
        and "Stage Breakdown" in text
        and "Per Prefill Batch (5 batches)" in text
    )
    assert "Successful requests:                     12" in text
    assert "Failed requests:                         1" in text
    assert "Benchmark duration (s):                  2.50" in text  # the manifest's, not the rows' last clock


def test_per_batch_stages(tmp_path):
    rows = _rows()
    for r in rows:
        r["input_wait_ms"] = 7.0 if r["batch_id"] == 0 else 0.0
    b = batch_stages(pa.Table.from_pylist(rows, schema=ROW_SCHEMA)).to_pylist()
    assert [(x["rank"], x["batch_id"], x["rows"]) for x in b] == [
        (0, 0, 3),
        (1, 0, 3),
        (0, 1, 3),
        (1, 1, 3),
        (1, 9, 1),
    ]
    first = b[0]
    assert (first["vit_ms"], first["prefill_ms"], first["decode_ms"], first["input_wait_ms"]) == (
        30.0,
        50.0,
        120.0,
        7.0,
    )
    assert first["start_s"] == 0.5 and first["end_s"] == pytest.approx(0.5 + 0.8 + 0.1)


def test_report_without_plots_and_on_an_empty_run(tmp_path):
    _run_dir(tmp_path, [])
    text, written = report(tmp_path, plots=False)
    assert written == [] and not (tmp_path / "_report").exists()
    assert "Successful requests:                     0" in text and "decode" in text
    _, written = report(tmp_path)  # plots of an empty run still render
    assert all(p.stat().st_size > 0 for p in written)


def test_report_on_a_folder_that_is_not_a_run_is_an_error_and_writes_nothing(tmp_path):
    (tmp_path / "photo.jpg").write_bytes(b"jpeg")
    with pytest.raises(NotARunError, match="is not a batchvl run dir"):
        report(tmp_path)
    r = CliRunner().invoke(report_cmd, [str(tmp_path)])
    assert r.exit_code == 1 and "is not a batchvl run dir (no _manifest.json)" in r.output
    assert [p.name for p in tmp_path.iterdir()] == ["photo.jpg"]


def test_report_figures_equal_the_summary_and_count_each_run_once(tmp_path):
    """A resumed dir: throughput divides by the runs' summed time, each run gets its own line, the report prints
    the numbers _summary.json holds and says where its PNGs went."""
    rows = _rows()
    for r in rows:
        r["run"] = 0 if r["rank"] == 0 else 1
    runs = [{"run": 0, "duration_s": 3.0, "load_s": 1.0, "counts": []},
            {"run": 1, "duration_s": 5.0, "load_s": 2.0, "warm_up_s": 0.5, "counts": [{"vit_compile_s": 1.5}]}]  # fmt: skip
    _run_dir(tmp_path, rows, runs)
    s = run_summary(tmp_path)
    write_summary(tmp_path, s)
    assert s["benchmark_duration_s"] == 8.0 and s["request_throughput"] == pytest.approx(12 / 8.0)
    assert s["runs"] == [
        {"run": 0, "rows": 6, "failed": 0, "duration_s": 3.0, "request_throughput": 2.0},
        {"run": 1, "rows": 7, "failed": 1, "duration_s": 5.0, "request_throughput": 1.2},
    ]
    assert (s["load_s"], s["warm_up_s"], s["vit_compile_s"]) == (2.0, 0.5, 1.5)  # the last run's start-up
    r = CliRunner().invoke(report_cmd, [str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "_summary.txt").read_text().strip() in r.output
    assert "Run 1 (rows, s, req/s):                  7 in 5.00, 1.20" in r.output
    assert [line for line in r.output.splitlines() if line.startswith("wrote ")] == [
        f"wrote {tmp_path / '_report' / n}" for n in ("stages.png", "throughput.png", "timeline.png")
    ]


def test_a_run_that_died_counts_its_rows_last_clock(tmp_path):
    rows = _rows()
    for r in rows:
        r["run"] = 0 if r["rank"] == 0 else 1
    _run_dir(tmp_path, rows, [{"run": 1, "duration_s": 5.0, "load_s": 2.0, "counts": []}])
    s = run_summary(tmp_path)
    died = max(r["t_done_s"] for r in rows if r["rank"] == 0)
    assert [x["duration_s"] for x in s["runs"]] == [pytest.approx(died), 5.0]
    assert s["benchmark_duration_s"] == pytest.approx(died + 5.0)
