"""Tests for batchvl.output: part writer, resume checks, manifest and summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from batchvl import output
from batchvl.output import (
    ROW_SCHEMA,
    PartWriter,
    ResumeError,
    check_resume,
    done_ids,
    fingerprint,
    format_summary,
    read_manifest,
    read_rows,
    summarize,
    write_manifest,
    write_summary,
)

PART = re.compile(r"^part-\d{5}-\d{6}\.parquet$")


def _write(out, rank, ids, rows_per_part=3, **extra):
    """Write rows with the given ids through one PartWriter; return the writer."""
    w = PartWriter(out, rank=rank, rows_per_part=rows_per_part)
    for i in ids:
        w.add({"id": i, **extra})
    w.close()
    return w


def test_schema_columns():
    assert ROW_SCHEMA.field("prompt_token_ids").type == pa.list_(pa.int32())
    assert ROW_SCHEMA.field("batch_id").type == pa.int64()
    assert ROW_SCHEMA.field("cache_hit_image").type == pa.bool_()
    assert output.STAGE_COLUMNS == (
        "queue_ms",
        "preprocess_ms",
        "batch_wait_ms",
        "vit_ms",
        "prefill_ms",
        "decode_ms",
    )


def test_output_and_report_do_not_import_torch():
    code = "import sys, batchvl.output, batchvl.report; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_writer_parts_naming_and_read_back(tmp_path):
    w = PartWriter(tmp_path, rank=2, rows_per_part=3)
    for i in range(7):
        w.add({"id": f"r{i}"})
        assert len(list(tmp_path.iterdir())) == (i + 1) // 3  # a part appears each time 3 rows are buffered
    last = w.flush()
    assert w.flush() is None  # nothing buffered
    w.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"part-00002-{c:06d}.parquet" for c in range(3)]
    assert all(PART.match(n) for n in names)  # no temp files left behind
    assert last.name == "part-00002-000002.parquet"
    t = read_rows(tmp_path)
    assert t.schema.equals(ROW_SCHEMA)
    assert sorted(t.column("id").to_pylist()) == [f"r{i}" for i in range(7)]
    assert set(t.column("rank").to_pylist()) == {2}


def test_close_with_empty_buffer_writes_nothing(tmp_path):
    w = PartWriter(tmp_path, rank=0, rows_per_part=3)
    for i in range(6):
        w.add({"id": str(i)})
    w.close()
    assert len(list(tmp_path.glob("part-*.parquet"))) == 2
    with pytest.raises(RuntimeError, match="closed"):
        w.add({"id": "late"})


def test_chunk_numbering_continues_on_reopen(tmp_path):
    _write(tmp_path, 0, ["a", "b", "c", "d"], rows_per_part=2)  # chunks 0, 1
    _write(tmp_path, 1, ["x"])  # another rank does not affect rank 0
    w = PartWriter(tmp_path, rank=0, rows_per_part=2)
    assert w.chunk == 2
    w.add({"id": "e"})
    assert w.flush().name == "part-00000-000002.parquet"
    assert PartWriter(tmp_path, rank=1).chunk == 1
    assert PartWriter(tmp_path, rank=5).chunk == 0
    assert PartWriter(tmp_path, rank=0, start_chunk=40).chunk == 40
    ids = read_rows(tmp_path).column("id").to_pylist()
    assert sorted(ids) == ["a", "b", "c", "d", "e", "x"]  # every row exactly once


def test_nulls_for_missing_keys_and_list_roundtrip(tmp_path):
    full = {
        "id": "full",
        "batch_id": 7,
        "prompt_token_ids": [1, 2, 151667, 3],
        "output_token_ids": [],
        "output_text": "héllo",
        "cache_hit_image": True,
        "queue_ms": 1,  # an int into a float64 column
    }
    with PartWriter(tmp_path, rank=3) as w:
        w.add(full)
        w.add({"id": "bare"})
    rows = {r["id"]: r for r in read_rows(tmp_path).to_pylist()}
    bare = rows["bare"]
    assert bare["rank"] == 3
    assert all(bare[c] is None for c in ROW_SCHEMA.names if c not in ("id", "rank"))
    f = rows["full"]
    assert f["prompt_token_ids"] == [1, 2, 151667, 3]
    assert f["output_token_ids"] == []
    assert f["output_text"] == "héllo" and f["batch_id"] == 7 and f["cache_hit_image"] is True
    assert f["queue_ms"] == 1.0 and f["error"] is None


def test_add_rejects_unknown_column_and_missing_id(tmp_path):
    w = PartWriter(tmp_path, rank=0)
    with pytest.raises(ValueError, match="quue_ms"):
        w.add({"id": "a", "quue_ms": 1.0})
    with pytest.raises(ValueError, match="id"):
        w.add({"queue_ms": 1.0})


def test_failed_write_leaves_no_part_and_no_temp(tmp_path, monkeypatch):
    w = PartWriter(tmp_path, rank=0)
    w.add({"id": "a"})

    def boom(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        w.flush()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert w.flush().name == "part-00000-000000.parquet"  # rows were kept, chunk not consumed
    assert read_rows(tmp_path).column("id").to_pylist() == ["a"]


def test_read_rows_ignores_temp_and_other_files(tmp_path):
    _write(tmp_path, 0, ["a", "b"])
    (tmp_path / ".part-00000-000001.parquet.123.tmp").write_bytes(b"partial garbage")
    (tmp_path / "_manifest.json").write_text("{}")
    assert sorted(read_rows(tmp_path).column("id").to_pylist()) == ["a", "b"]
    PartWriter(tmp_path, rank=0)  # a new writer of rank 0 removes its stale temp files
    assert not list(tmp_path.glob(".*.tmp"))


def test_read_rows_empty_dir(tmp_path):
    t = read_rows(tmp_path / "nope")
    assert t.num_rows == 0 and t.schema.equals(ROW_SCHEMA)
    assert done_ids(tmp_path / "nope") == set()


def test_done_ids(tmp_path):
    _write(tmp_path, 0, ["a", "b", "c", "d"], rows_per_part=3)
    _write(tmp_path, 1, ["e"], error="OOM")
    assert done_ids(tmp_path) == {"a", "b", "c", "d", "e"}
    assert done_ids(tmp_path, rank=0) == {"a", "b", "c", "d"}
    assert done_ids(tmp_path, rank=1) == {"e"}  # error rows count as done
    assert done_ids(tmp_path, rank=2) == set()


def test_fingerprint():
    a = fingerprint({"model": "InternVL2_5-8B", "batch": 32, "opts": [1, 2]})
    assert a == fingerprint({"opts": [1, 2], "batch": 32, "model": "InternVL2_5-8B"})
    assert a != fingerprint({"model": "InternVL2_5-8B", "batch": 33, "opts": [1, 2]})
    assert re.fullmatch(r"[0-9a-f]{16}", a)


def test_manifest_roundtrip(tmp_path):
    assert read_manifest(tmp_path) is None
    m = {"job": {"data": "x"}, "job_fingerprint": "j", "model_fingerprint": "m", "world_size": 2}
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    write_manifest(tmp_path, {**m, "ended_at": "later"})
    assert read_manifest(tmp_path)["ended_at"] == "later"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_manifest.json"]


def test_check_resume(tmp_path):
    assert check_resume(tmp_path, "j1", "m1", overwrite=False) == "fresh"
    write_manifest(tmp_path, {"job_fingerprint": "j1", "model_fingerprint": "m1"})
    _write(tmp_path, 0, ["a", "b"])
    assert check_resume(tmp_path, "j1", "m1", overwrite=False) == "resume"
    with pytest.raises(ResumeError, match="job fingerprint j1 -> j2. Pass --overwrite"):
        check_resume(tmp_path, "j2", "m1", overwrite=False)
    with pytest.raises(ResumeError, match="model fingerprint m1 -> m2"):
        check_resume(tmp_path, "j1", "m2", overwrite=False)
    assert done_ids(tmp_path) == {"a", "b"}  # a refused resume deletes nothing
    (tmp_path / "keep.txt").write_text("not ours")
    assert check_resume(tmp_path, "j2", "m2", overwrite=True) == "overwrite"
    assert read_manifest(tmp_path) is None and done_ids(tmp_path) == set()
    assert (tmp_path / "keep.txt").exists()
    with pytest.raises(ResumeError, match=r"not empty and not a batchvl run \(it holds keep.txt\)"):
        check_resume(tmp_path, "j2", "m2", overwrite=False)
    (tmp_path / "keep.txt").unlink()
    assert check_resume(tmp_path, "j2", "m2", overwrite=False) == "fresh"


def test_a_changed_job_is_refused_naming_the_keys_and_the_flag(tmp_path):
    job = {"data": {"limit": 50, "path": "/d.jsonl"}, "generation": {"max_new_tokens": 4}}
    model = {"config": {"llm": {"hidden_size": 64}}, "dtype": "torch.float32"}
    write_manifest(tmp_path, {"job_fingerprint": "j1", "model_fingerprint": "m1", "job": job | {"x": 1},
                              "model": model | {"device": "cpu"}})  # fmt: skip
    new_job = {"data": {"limit": 100, "path": "/d.jsonl"}, "generation": {"max_new_tokens": 4}}
    new_model = {"config": {"llm": {"hidden_size": 64}}, "dtype": "torch.bfloat16"}
    with pytest.raises(ResumeError) as e:
        check_resume(tmp_path, "j2", "m2", False, new_job, new_model)
    assert (
        "holds results of a different job; changed since: job.data.limit: 50 -> 100; model.dtype: "
        "'torch.float32' -> 'torch.bfloat16'. Pass --overwrite to delete those results"
    ) in str(e.value)


def test_a_folder_of_other_files_is_refused_and_overwrite_deletes_only_ours(tmp_path):
    for name in ("a.jpg", "b.jpg", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".DS_Store").write_bytes(b"")
    with pytest.raises(
        ResumeError,
        match=r"is not empty and not a batchvl run \(it holds a.jpg, b.jpg, notes.txt\); use an empty or new "
        r"output dir, or pass --overwrite",
    ):
        check_resume(tmp_path, "j", "m", overwrite=False)
    assert check_resume(tmp_path, "j", "m", overwrite=True) == "fresh"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".hidden").write_bytes(b"")
    assert check_resume(empty, "j", "m", overwrite=False) == "fresh"
    _write(tmp_path, 0, ["r"])
    write_manifest(tmp_path, {"job_fingerprint": "j", "model_fingerprint": "m"})
    (tmp_path / "_report").mkdir()
    (tmp_path / "_report" / "stages.png").write_bytes(b"png")
    assert check_resume(tmp_path, "j", "m", overwrite=True) == "overwrite"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".DS_Store", "_report", "a.jpg", "b.jpg", "empty",
                                                          "notes.txt"]  # fmt: skip


def test_an_older_layout_is_upgraded_and_read_as_a_dataset(tmp_path):
    import pandas as pd
    import pyarrow.dataset as pads

    _write(tmp_path, 0, ["a", "b"])
    (tmp_path / "manifest.json").write_text(json.dumps({"job_fingerprint": "j", "model_fingerprint": "m"}))
    (tmp_path / "summary.txt").write_text("old")
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "stages.png").write_bytes(b"png")
    assert check_resume(tmp_path, "j", "m", overwrite=False) == "resume"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("part-")) == [
        "_manifest.json", "_report", "_summary.txt"
    ]  # fmt: skip
    (tmp_path / ".part-00000-000001.parquet.9.tmp").write_bytes(b"partial")
    assert sorted(pd.read_parquet(tmp_path)["id"]) == ["a", "b"]
    assert pads.dataset(tmp_path).to_table().num_rows == 2
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text("{}")  # not batchvl's: left alone
    with pytest.raises(ResumeError, match="not a batchvl run"):
        check_resume(other, "j", "m", overwrite=False)
    assert (other / "manifest.json").exists()


def test_check_resume_parts_without_manifest(tmp_path):
    _write(tmp_path, 0, ["a"])
    with pytest.raises(ResumeError, match="no _manifest.json"):
        check_resume(tmp_path, "j", "m", overwrite=False)
    assert check_resume(tmp_path, "j", "m", overwrite=True) == "overwrite"
    assert not list(tmp_path.glob("part-*"))


def _bench_rows():
    """Four successful rows and one failed row with known numbers."""
    ok = [
        # text, image, n_out, e2e, ttft, tpot, t_done, cache_hit, cached_prefix
        (10, 256, 5, 100.0, 40.0, 15.0, 1.0, True, 0),
        (20, 256, 3, 300.0, 60.0, 120.0, 2.5, False, 16),
        (30, 512, 1, 200.0, 200.0, None, 2.0, True, 32),
        (40, 0, 8, 900.0, 80.0, 117.0, 4.0, False, 0),
    ]
    rows = [
        {
            "id": f"ok{i}",
            "num_text_tokens": tx,
            "num_image_tokens": im,
            "output_token_ids": list(range(n)),
            "e2e_ms": e2e,
            "ttft_ms": ttft,
            "tpot_ms": tpot,
            "t_done_s": t,
            "cache_hit_image": hit,
            "cached_prefix_tokens": cp,
        }
        for i, (tx, im, n, e2e, ttft, tpot, t, hit, cp) in enumerate(ok)
    ]
    rows.append(
        {
            "id": "bad",
            "error": "image decode failed",
            "num_text_tokens": 1000,
            "num_image_tokens": 1000,
            "output_token_ids": [1] * 50,
            "e2e_ms": 1.0,
            "ttft_ms": 1.0,
            "tpot_ms": 1.0,
            "t_done_s": 5.0,
            "cache_hit_image": True,
            "cached_prefix_tokens": 999,
        }
    )
    return ok, rows


def test_summarize_known_numbers():
    ok, rows = _bench_rows()
    s = summarize(pa.Table.from_pylist(rows, schema=ROW_SCHEMA))
    text_in = sum(r[0] for r in ok)
    image_in = sum(r[1] for r in ok)
    out = sum(r[2] for r in ok)
    duration = 5.0  # max t_done_s over all rows, the failed one included
    assert s["successful_requests"] == 4 and s["failed_requests"] == 1
    assert s["benchmark_duration_s"] == duration
    assert (s["total_input_text_tokens"], s["total_input_image_tokens"]) == (100, 1024) == (text_in, image_in)
    assert s["total_input_tokens"] == text_in + image_in
    assert s["total_generated_tokens"] == out == 17
    assert s["request_throughput"] == pytest.approx(4 / duration)
    assert s["input_token_throughput"] == pytest.approx((text_in + image_in) / duration)
    assert s["output_token_throughput"] == pytest.approx(out / duration)
    assert s["total_token_throughput"] == pytest.approx((text_in + image_in + out) / duration)
    for name, idx in (("e2e", 3), ("ttft", 4), ("tpot", 5)):
        vals = [r[idx] for r in ok if r[idx] is not None]
        assert s[f"mean_{name}_ms"] == pytest.approx(sum(vals) / len(vals))
        assert s[f"median_{name}_ms"] == pytest.approx(float(np.median(vals)))
        assert s[f"p99_{name}_ms"] == pytest.approx(float(np.percentile(vals, 99)))
    # hand-checked: e2e sorted [100, 200, 300, 900] -> median 250, p99 = 300 + 0.97 * 600
    assert s["median_e2e_ms"] == pytest.approx(250.0)
    assert s["p99_e2e_ms"] == pytest.approx(882.0)
    assert s["mean_tpot_ms"] == pytest.approx(84.0)  # the 1-token row has no TPOT
    assert s["image_cache_hits"] == 2 and s["cached_prefix_tokens"] == 48
    json.dumps(s)  # JSON-safe


def test_summarize_given_duration_and_no_cache_columns():
    _, rows = _bench_rows()
    for r in rows:
        del r["cache_hit_image"], r["cached_prefix_tokens"]
    s = summarize(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), duration_s=10.0)
    assert s["benchmark_duration_s"] == 10.0 and s["request_throughput"] == pytest.approx(0.4)
    assert "image_cache_hits" not in s and "cached_prefix_tokens" not in s
    assert "Cache" not in format_summary(s)


def test_summarize_empty():
    s = summarize(ROW_SCHEMA.empty_table())
    assert s["successful_requests"] == 0 and s["benchmark_duration_s"] is None
    assert s["request_throughput"] is None and s["mean_e2e_ms"] is None
    assert "n/a" in format_summary(s)


def test_format_and_write_summary(tmp_path):
    _, rows = _bench_rows()
    s = summarize(pa.Table.from_pylist(rows, schema=ROW_SCHEMA))
    text = format_summary(s)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert re.search(r"^Successful requests:\s+4$", text, re.M)
    assert re.search(r"^Failed requests:\s+1$", text, re.M)
    assert re.search(r"^Request throughput \(req/s\):\s+0\.80$", text, re.M)
    assert re.search(r"^P99 E2EL \(ms\):\s+882\.00$", text, re.M)
    assert all(len(ln) <= 51 for ln in lines)
    write_summary(tmp_path, s)
    assert json.loads((tmp_path / "_summary.json").read_text()) == s
    assert (tmp_path / "_summary.txt").read_text() == text + "\n"


def test_summarize_gpu_input_wait_counts_each_batch_once():
    rows = [
        {"id": "a", "rank": 0, "batch_id": 0, "input_wait_ms": 5.0, "t_done_s": 1.0},
        {"id": "b", "rank": 0, "batch_id": 0, "input_wait_ms": 5.0, "t_done_s": 1.0},
        {"id": "c", "rank": 0, "batch_id": 1, "input_wait_ms": 7.0, "t_done_s": 2.0},
        {"id": "d", "rank": 1, "batch_id": 0, "input_wait_ms": 1.0, "t_done_s": 2.0},
        {"id": "e", "rank": 1, "error": "bad image", "t_done_s": 0.5},
    ]
    s = summarize(pa.Table.from_pylist(rows, schema=ROW_SCHEMA))
    assert s["gpu_input_wait_s"] == pytest.approx(0.013)
    assert "Idle waiting for input" in format_summary(s)


def test_summarize_gpu_input_wait_keeps_batches_of_different_runs_apart():
    rows = [  # a resumed dir: each run numbers its batches from 0
        {"id": "a", "rank": 0, "run": 0, "batch_id": 0, "input_wait_ms": 5.0, "t_done_s": 1.0},
        {"id": "b", "rank": 0, "run": 1, "batch_id": 0, "input_wait_ms": 7.0, "t_done_s": 1.0},
    ]
    s = summarize(pa.Table.from_pylist(rows, schema=ROW_SCHEMA))
    assert s["gpu_input_wait_s"] == pytest.approx(0.012)
