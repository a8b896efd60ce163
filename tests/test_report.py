"""Tests for batchvl.report: stage breakdown numbers, text and PNG plots."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from batchvl.output import ROW_SCHEMA, PartWriter
from batchvl.report import report, stage_breakdown

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


def test_report_writes_pngs_and_text(tmp_path):
    with (
        PartWriter(tmp_path, rank=0, rows_per_part=4) as w0,
        PartWriter(tmp_path, rank=1, rows_per_part=4) as w1,
    ):
        for r in _rows():
            (w0 if r["rank"] == 0 else w1).add(r)
    text = report(tmp_path)
    for name in ("stages.png", "throughput.png", "timeline.png"):
        data = (tmp_path / "report" / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    for s in STAGES:
        assert s in text
    assert "Serving Benchmark Result" in text and "Stage Breakdown" in text
    assert "Successful requests:                     12" in text
    assert "Failed requests:                         1" in text


def test_report_without_plots_and_on_empty_dir(tmp_path):
    text = report(tmp_path, plots=False)
    assert not (tmp_path / "report").exists()
    assert "Successful requests:                     0" in text and "decode" in text
    report(tmp_path)  # plots of an empty run still render
    assert all((tmp_path / "report" / n).stat().st_size > 0 for n in ("stages.png", "timeline.png"))
