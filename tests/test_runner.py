"""Whole jobs: the demo through the CLI, torchrun replicas, an interrupted run resumed, bad rows, CLI errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import BAD_ROWS, FakeEngine, assert_clock_order, stopped_at_admission

from batchvl.data import shard_of
from batchvl.demo import demo_rows
from batchvl.job import load_job
from batchvl.output import ResumeError, read_manifest, read_rows, write_manifest
from batchvl.pipeline import EXIT_AFTER_ENV
from batchvl.preprocess import load_tokenizer
from batchvl.runner import cli, main, run_job

REPO = Path(__file__).resolve().parents[1]
DEMO_IDS = sorted(r["id"] for r in demo_rows())


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m batchvl.runner ARGS` from the repo root."""
    return subprocess.run([sys.executable, "-m", "batchvl.runner", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def by_id(out_dir: Path) -> dict[str, dict]:
    rows = read_rows(out_dir).to_pylist()
    assert len(rows) == len({r["id"] for r in rows}), "an id was written twice"
    return {r["id"]: r for r in rows}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("demo") / "run"
    p = run_cli("jobs/demo.yaml", "--set", f"output.dir={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p.stdout


@pytest.mark.slow
def test_demo_job_end_to_end(demo_run):
    out, stdout = demo_run
    rows = by_id(out)
    assert sorted(rows) == DEMO_IDS
    tok = load_tokenizer(None)
    for r in rows.values():
        assert r["error"] is None and 1 <= len(r["output_token_ids"]) <= 8
        assert r["output_text"] == tok.decode(r["output_token_ids"], skip_special_tokens=True)
        assert_clock_order(r)
    assert rows["text-only"]["num_tiles"] == 0 and rows["wide-stripes"]["num_tiles"] > 1
    man = read_manifest(out)
    assert man["status"] == "done" and man["world_size"] == 1 and len(man["runs"]) == 1
    assert man["job_fingerprint"] and man["model_fingerprint"] and man["versions"]["torch"]
    # the summary, recomputed from the Parquet files
    s = json.loads((out / "_summary.json").read_text())
    ok = list(rows.values())
    dur = man["runs"][0]["duration_s"]
    n_in = sum(r["num_text_tokens"] + r["num_image_tokens"] for r in ok)
    n_out = sum(len(r["output_token_ids"]) for r in ok)
    assert (s["successful_requests"], s["failed_requests"]) == (8, 0)
    assert (s["total_input_tokens"], s["total_generated_tokens"]) == (n_in, n_out)
    assert s["benchmark_duration_s"] == pytest.approx(dur)
    assert s["request_throughput"] == pytest.approx(8 / dur)
    assert s["output_token_throughput"] == pytest.approx(n_out / dur)
    assert s["mean_e2e_ms"] == pytest.approx(np.mean([r["e2e_ms"] for r in ok]))
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile([r["ttft_ms"] for r in ok], 99))
    assert "Serving Benchmark Result" in stdout and (out / "_summary.txt").read_text().strip() in stdout
    # the batchvl console script's report over the same run
    res = CliRunner().invoke(cli, ["report", str(out), "--no-plots"])
    assert res.exit_code == 0, res.output
    assert (out / "_summary.txt").read_text().strip() in res.output  # the report's figures are the summary's
    # ... and the same through `python -m`, both spellings; it says where its plots went
    for args in (["-m", "batchvl.runner", "report"], ["-m", "batchvl.report"]):
        p = subprocess.run(
            [sys.executable, *args, str(out)], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert p.returncode == 0, p.stderr[-3000:]
        assert (
            f"wrote {out / '_report' / 'timeline.png'}" in p.stdout
            and (out / "_report" / "stages.png").is_file()
        )
    # the run dir is a Parquet dataset as written: the manifest, summaries and plots are skipped
    import pandas as pd
    import pyarrow.dataset as pads

    df = pd.read_parquet(out)
    assert sorted(df["id"]) == DEMO_IDS and set(df["run"]) == {0}
    assert pads.dataset(out).count_rows() == 8


@pytest.mark.slow
@pytest.mark.multiproc
def test_torchrun_two_replicas_match_one_process(demo_run, tmp_path):
    single, _ = demo_run
    out = tmp_path / "run"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "batchvl.runner", "jobs/demo.yaml",
           "--set", f"output.dir={out}"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("Serving Benchmark Result") == 1  # rank 0 only
    for rank in (0, 1):
        parts = sorted(out.glob(f"part-{rank:05d}-*.parquet"))
        assert parts, f"rank {rank} wrote nothing"
        ids = [i for f in parts for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]
        assert all(shard_of(i, 2) == rank for i in ids)  # disjoint shards
    two, one = by_id(out), by_id(single)
    assert sorted(two) == DEMO_IDS  # every id exactly once
    for i in DEMO_IDS:
        assert two[i]["output_token_ids"] == one[i]["output_token_ids"], i
        assert two[i]["prompt_token_ids"] == one[i]["prompt_token_ids"], i
    man = read_manifest(out)
    assert man["world_size"] == 2 and man["replicas"] == 2
    assert sum(c["rows"] for c in man["runs"][0]["counts"]) == 8
    assert man["runs"][0]["counts"][0]["decode_graphs_captured"] == 0  # CPU: no CUDA graphs
    assert man["runs"][0]["counts"][0]["decode_capture_s"] == 0.0


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("vit_mode", ["tp", "dp"])
def test_torchrun_tensor_parallel_matches_one_process(demo_run, tmp_path, vit_mode):
    """LLM tensor-parallel over 2 ranks, with the ViT tensor-parallel (split-batch overlap) or data-parallel."""
    single, _ = demo_run
    out = tmp_path / "run"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "batchvl.runner", "jobs/demo.yaml",
           "--set", f"output.dir={out}", "--set", "model.tp=2", "--set", f"engine.vit_mode={vit_mode}"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(f.name.split("-")[1] for f in out.glob("part-*.parquet")) == ["00000"] * 2  # one writer
    two, one = by_id(out), by_id(single)
    assert sorted(two) == DEMO_IDS
    assert {i: r["output_token_ids"] for i, r in two.items()} == {
        i: r["output_token_ids"] for i, r in one.items()
    }
    man = read_manifest(out)
    assert (man["world_size"], man["replicas"], man["tp"]) == (2, 1, 2)


@pytest.mark.slow
def test_interrupted_run_resumes_without_losing_or_doubling(tmp_path):
    out = tmp_path / "run"
    args = [
        "jobs/demo.yaml",
        "--set",
        f"output.dir={out}",
        "--set",
        "output.rows_per_part=2",
        "--set",
        "engine.max_prefill_tokens=1",
    ]  # fmt: skip  (one row per batch: rows finish one by one)
    p = run_cli(*args, env={EXIT_AFTER_ENV: "5"})
    assert p.returncode == 17, p.stderr[-3000:]
    first = by_id(out)
    assert len(first) == 4  # two parts of 2 rows; the 5th row was still buffered when the process died
    assert read_manifest(out)["status"] == "running"
    run_job(load_job(REPO / args[0], args[2::2]))  # the re-run in this process (no second start-up)
    rows = by_id(out)
    assert sorted(rows) == DEMO_IDS and all(r["error"] is None for r in rows.values())
    for i, r in first.items():
        assert rows[i] == r  # rows written before the crash were kept, not redone
    man = read_manifest(out)
    assert man["status"] == "done" and man["decision"] == "resume"
    assert man["runs"][-1]["counts"][0]["skipped"] == 4
    assert json.loads((out / "_summary.json").read_text())["successful_requests"] == 8


@pytest.mark.slow
def test_bad_inputs_through_a_real_job(bad_rows_jsonl, tmp_path):
    job = load_job(REPO / "jobs/demo.yaml", [
        "data.format=jsonl", f"data.path={bad_rows_jsonl}", f"output.dir={tmp_path / 'run'}",
        "preprocess.max_tiles=1", "preprocess.max_input_tokens=2048", "preprocess.max_image_pixels=4000000",
        "generation.max_new_tokens=2", "preprocess.workers=0",
    ])  # fmt: skip
    summary = run_job(job)
    rows = read_rows(job.output.dir).to_pylist()
    assert len(rows) == 13
    seen: dict[str, list[dict]] = {}
    for r in rows:
        seen.setdefault(r["id"], []).append(r)
    assert [r["error"] for r in seen["rgb"]] == [None, "duplicate id"]  # written in this order
    for rid, want in BAD_ROWS.items():
        err = seen[rid][0]["error"]
        if want is None:
            assert err is None and len(seen[rid][0]["output_token_ids"]) >= 1, (rid, err)
        else:
            assert err is not None and want in err, (rid, err)
    assert (summary["successful_requests"], summary["failed_requests"]) == (6, 7)


def _small_job(tmp_path: Path, *sets: str):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(5)))
    return load_job(REPO / "jobs/demo.yaml", ["data.format=jsonl", f"data.path={rows}",
                                              f"output.dir={tmp_path / 'run'}", *sets])  # fmt: skip


def fake_factory(job, device, dtype, eos_token_ids=(), ctx=None):
    return FakeEngine()


def test_rerun_resumes_and_a_different_job_is_refused(tmp_path):
    job = _small_job(tmp_path)
    assert run_job(job, engine_factory=fake_factory)["successful_requests"] == 5
    parts = sorted(p.name for p in Path(job.output.dir).glob("part-*"))
    again = run_job(job, engine_factory=fake_factory)  # same command: nothing left to do
    assert (
        again["successful_requests"] == 5
        and sorted(p.name for p in Path(job.output.dir).glob("part-*")) == parts
    )
    changed = _small_job(tmp_path, "generation.max_new_tokens=2")
    with pytest.raises(ResumeError, match=r"different job; changed since: job\.generation\.max_new_tokens: 8 -> 2\. "
                       "Pass --overwrite"):  # fmt: skip
        run_job(changed, engine_factory=fake_factory)
    over = _small_job(tmp_path, "generation.max_new_tokens=2", "output.overwrite=true")
    assert run_job(over, engine_factory=fake_factory)["successful_requests"] == 5
    assert all(len(r["output_token_ids"]) == 2 for r in read_rows(job.output.dir).to_pylist())


def test_decode_graphs_are_captured_before_any_row_is_prepared(tmp_path, monkeypatch):
    """The engine's warm-up (where CUDA graphs are captured) finishes before the first row reaches the preparer: a
    preprocessing thread pinning a batch's tiles during a capture broke it and ended the job (issue 24). The manifest
    keeps its seconds by part."""
    from batchvl import pipeline

    events: list[str] = []

    class Warming(FakeEngine):
        def warm_up(self):
            events.append("warm_up")
            return {"vit": 1.5, "decode_graphs": 0.5}

    submit = pipeline.Preparer.submit
    monkeypatch.setattr(
        pipeline.Preparer,
        "submit",
        lambda self, item, cached=(): events.append("row") or submit(self, item, cached),
    )
    job = _small_job(tmp_path)
    run_job(job, engine_factory=lambda *a, **k: Warming())
    assert events[0] == "warm_up" and events.count("row") == 5
    (run,) = read_manifest(job.output.dir)["runs"]
    assert run["counts"][0]["warm_up_parts_s"] == {"vit": 1.5, "decode_graphs": 0.5}


def test_waiting_for_compile_helpers_is_start_up_not_load(tmp_path):
    """A cold start's wait for its compile helpers (after the weights were in) is reported as the warm-up's first
    part and counted in its seconds, not in the load's; the start then marks its graphs saved."""
    import time
    from types import SimpleNamespace

    marked: list[bool] = []

    class Cold(FakeEngine):
        def __init__(self):
            super().__init__()
            time.sleep(0.4)  # the load, 0.3 s of it waiting for helpers
            self.cold_start = SimpleNamespace(waited_s=0.3, warmed=lambda: marked.append(True))

        def warm_up(self):
            return {"vit": 0.1}

    job = _small_job(tmp_path)
    run_job(job, engine_factory=lambda *a, **k: Cold())
    (run,) = read_manifest(job.output.dir)["runs"]
    assert list(run["counts"][0]["warm_up_parts_s"].items()) == [("compile_helpers", 0.3), ("vit", 0.1)]
    assert run["warm_up_s"] >= 0.3 and run["load_s"] < 0.35 and marked == [True]


def test_cli_errors_name_the_key_and_exit_nonzero(tmp_path):
    r = CliRunner().invoke(main, ["jobs/demo.yaml", "--set", "data.fromat=jsonl"])
    assert r.exit_code == 1 and "job.data.fromat: unknown key (did you mean 'format'?)" in r.output
    r = CliRunner().invoke(main, ["jobs/demo.yaml", "--set", "model.dtype=float8"])
    assert r.exit_code == 1 and "job.model.dtype: 'float8' is not one of" in r.output
    r = CliRunner().invoke(cli, ["run", "jobs/demo.yaml", "--set", f"data.image={tmp_path / 'nope.png'}"])
    assert r.exit_code == 1 and "job.data.image:" in r.output and "is not a file" in r.output
    r = CliRunner().invoke(main, ["jobs/demo.yaml", "--set", "model.tp=2"])  # one process cannot hold tp=2
    assert r.exit_code == 1 and "job.model.tp: world size 1 is not a multiple of model.tp=2" in r.output
    r = CliRunner().invoke(main, [str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2  # click: the job file does not exist


def test_a_missing_column_or_a_foreign_output_dir_stops_the_job_before_it_starts(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "q", "image_path": "a.png"}) + "\n")
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["jobs/demo.yaml", "--set", "data.format=jsonl", "--set", f"data.path={rows}",
                                 "--set", "data.allow_text_only=false", "--set", f"output.dir={out}"])  # fmt: skip
    assert (
        r.exit_code == 1
        and "job.data.image_field:" in r.output
        and "its columns are id, prompt, image_path" in r.output
    )
    assert not out.exists()  # nothing ran, nothing was written
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(b"jpeg")
    with pytest.raises(ResumeError, match="is not empty and not a batchvl run"):
        run_job(_small_job(tmp_path, f"output.dir={photos}"), engine_factory=fake_factory)
    assert [p.name for p in photos.iterdir()] == ["cat.jpg"]


def test_a_resumed_dir_counts_each_run_once(tmp_path):
    """A run stopped after 2 rows, then resumed: each run's rows carry its number and the summary adds the runs'
    own durations (the stopped run's from its rows' clock) instead of dividing every row by the last run's time."""

    one_row_batches = stopped_at_admission(3)

    job = _small_job(tmp_path, "generation.max_new_tokens=1", "output.rows_per_part=1")
    with pytest.raises(BaseException):  # noqa: B017 - however an interrupt surfaces, the job stops
        run_job(job, engine_factory=one_row_batches)
    assert sorted(r["run"] for r in read_rows(job.output.dir).to_pylist()) == [0, 0]
    man = read_manifest(job.output.dir)
    assert man["status"] == "interrupted" and man["runs"][0]["interrupted"]  # it recorded itself
    # as if it had been killed before recording itself: the summary times it by its rows' clock
    write_manifest(job.output.dir, man | {"runs": []})
    s = run_job(job, engine_factory=one_row_batches)
    rows = read_rows(job.output.dir).to_pylist()
    assert sorted(r["run"] for r in rows) == [0, 0, 1, 1, 1]
    last = read_manifest(job.output.dir)["runs"][-1]
    assert last["run"] == 1 and [(x["run"], x["rows"]) for x in s["runs"]] == [(0, 2), (1, 3)]
    died = max(r["t_done_s"] for r in rows if r["run"] == 0)
    assert (
        s["runs"][0]["duration_s"] == pytest.approx(died) and s["runs"][1]["duration_s"] == last["duration_s"]
    )
    assert s["benchmark_duration_s"] == pytest.approx(died + last["duration_s"])
    assert s["request_throughput"] == pytest.approx(5 / (died + last["duration_s"]))


def test_cli_lists_run_and_report():
    """`batchvl --help` names both commands; `batchvl run` is the command `python -m batchvl.runner` runs."""
    r = CliRunner().invoke(cli, ["--help"])
    assert r.exit_code == 0
    commands = [line.split()[0] for line in r.output.split("Commands:")[1].strip().splitlines()]
    assert sorted(commands) == ["report", "run"]
    assert cli.get_command(None, "run") is main
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("batchvl ")
    # (`python -m batchvl.runner` is the same group: test_demo_job_end_to_end runs its `report` that way)
    r = CliRunner().invoke(cli, ["run", "--help"])
    assert r.exit_code == 0 and "Usage: cli run [OPTIONS] JOB_FILE" in r.output and "--overwrite" in r.output


@pytest.mark.slow
def test_compile_cache_dir_copied_elsewhere_serves_a_fresh_process(tmp_path) -> None:
    """engine.cache_dir holds the compiled graphs, saved whole (`Precompiled`), and Inductor's cache (even when an
    import of torch filled Inductor's variable with its default first): a copy of the folder alone serves a second
    process, as on a fresh machine, which loads every graph, traces none and writes the same tokens; the summary
    counts both."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}

    def run(cache: Path, out: Path) -> dict:
        sets = [f"output.dir={out}", f"engine.cache_dir={cache}", "engine.eager=false", "data.limit=2",
                "generation.max_new_tokens=2"]  # fmt: skip
        cmd = [
            sys.executable,
            "-m",
            "batchvl.runner",
            "jobs/demo.yaml",
            *(x for s in sets for x in ("--set", s)),
        ]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
        return json.loads((out / "_summary.json").read_text())

    first = run(tmp_path / "a", tmp_path / "run1")
    assert first["dynamo_graphs"] == 3 and first["precompiled_loaded"] == 0  # the ViT's embed, layer, head
    assert any((tmp_path / "a" / "inductor").rglob("*.so")), "Inductor's code is not under engine.cache_dir"
    assert len(list((tmp_path / "a" / "precompiled").rglob("*.bin"))) == 3
    (tmp_path / "a").rename(tmp_path / "b")  # the copy alone: the first folder is gone
    second = run(tmp_path / "b", tmp_path / "run2")
    assert second["precompiled_loaded"] == 3 and second["dynamo_graphs"] == 0  # nothing traced again
    assert second["compile_cache_misses"] == 0 and first["graph_breaks"] == 0

    def tokens(out: Path) -> dict:
        return {r["id"]: r["output_token_ids"] for r in read_rows(out).to_pylist()}

    assert tokens(tmp_path / "run2") == tokens(tmp_path / "run1")  # the loaded graphs compute what they saved


def test_profile_dir_records_the_rows_ops_and_a_timeline(tmp_path, monkeypatch):
    """BATCHVL_PROFILE_DIR profiles the job's rows: an op table led by the model's matmuls and a Chrome trace with the
    same ops; unset, the run writes nothing there."""
    import gzip

    from batchvl.profiling import PROFILE_ENV

    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "prof"))
    summary = run_job(_small_job(tmp_path, "engine.eager=true"))
    assert summary["successful_requests"] == 5
    (folder,) = (tmp_path / "prof").iterdir()
    assert folder.name.endswith("-rank0")
    table = (folder / "ops.txt").read_text()
    assert "aten::mm" in table or "aten::addmm" in table, table[:2000]
    names = {
        e.get("name")
        for e in json.loads(gzip.decompress((folder / "trace.json.gz").read_bytes()))["traceEvents"]
    }
    assert {"aten::linear", "aten::scaled_dot_product_attention"} <= names
    monkeypatch.delenv(PROFILE_ENV)
    (tmp_path / "again").mkdir()
    run_job(_small_job(tmp_path / "again", "engine.eager=true"))
    assert len(list((tmp_path / "prof").iterdir())) == 1
