"""Issue 27: one bad row never stops the job, resume trusts only verified parts, signals keep finished work, ids
never collide. Each test reproduces one row of the issue's table (small sizes) with the fake engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEngine, HangingPreprocessor

from batchvl.data import SourceRow
from batchvl.demo import demo_rows
from batchvl.engine import Sampling
from batchvl.job import load_job
from batchvl.output import (
    QUARANTINE_DIR,
    PartWriter,
    ResumeError,
    RunLock,
    check_resume,
    content_digest,
    part_problem,
    read_manifest,
    read_rows,
    write_manifest,
)
from batchvl.pipeline import SIGNAL_AFTER_ENV, Flow, RowLoop
from batchvl.preprocess import PreprocessConfig, Preprocessor
from batchvl.runner import Interrupted, run_job

REPO = Path(__file__).resolve().parents[1]
FPS = {"job_fingerprint": "j1", "model_fingerprint": "m1"}


def fake_factory(*args, **kwargs):
    return FakeEngine()


def write_jsonl(path: Path, lines: list) -> Path:
    """Each item a dict (written as JSON) or a str (written as the line itself)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def small_job(tmp_path: Path, rows: Path, *sets: str, out: Path | None = None):
    return load_job(REPO / "jobs/demo.yaml", ["data.format=jsonl", f"data.path={rows}",
                                              f"output.dir={out or tmp_path / 'run'}", *sets])  # fmt: skip


def text_rows(tmp_path: Path, n: int, name: str = "rows.jsonl") -> Path:
    return write_jsonl(tmp_path / name, [{"id": f"r{i:03d}", "prompt": f"question {i}"} for i in range(n)])


def ids_on_disk(out: Path) -> list[str]:
    return read_rows(out).column("id").to_pylist()


# ---------------------------------------------------------------- bad rows


def test_bad_rows_never_stop_the_job(tmp_path):
    """/dev/zero, a FIFO, malformed lines and odd ids: error rows, every real row runs once."""
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    rows = write_jsonl(tmp_path / "rows.jsonl", [
        {"id": "ok", "prompt": "hi"}, {"id": "z", "prompt": "hi", "image": "/dev/zero"},
        {"id": "f", "prompt": "hi", "image": str(fifo)}, "not json at all", "[1,2,3]", "42", '"\\ud800"',
        {"id": 1, "prompt": "a"}, {"id": 2.5, "prompt": "b"}, {"id": 9007199254740993, "prompt": "c"},
        {"id": 9007199254740992, "prompt": "d"}, {"id": None, "prompt": "e"}, {"id": "0", "prompt": "f"},
        {"id": True, "prompt": "g"}, {"id": "True", "prompt": "h"},
    ])  # fmt: skip
    job = small_job(tmp_path, rows)
    summary = run_job(job, engine_factory=fake_factory)
    got = {r["id"]: r["error"] for r in read_rows(job.output.dir).to_pylist()}
    assert len(got) == 15 == summary["successful_requests"] + summary["failed_requests"]
    assert "not a regular file" in got["z"] and "not a regular file" in got["f"]
    assert got["#3"].startswith("line 4: not valid JSON") and "line 5: expected a JSON object" in got["#4"]
    assert "line 6" in got["#5"] and "line 7" in got["#6"] and "boolean" in got["#13"]
    ran = ["ok", "1", "2.5", "9007199254740993", "9007199254740992", "#11", "0", "True"]
    assert [got[i] for i in ran] == [None] * len(ran)  # no real row dropped as a "duplicate"
    assert summary["successful_requests"] == len(ran)


def test_an_empty_jsonl_file_is_a_job_with_no_rows(tmp_path):
    job = small_job(tmp_path, write_jsonl(tmp_path / "rows.jsonl", []))
    summary = run_job(job, engine_factory=fake_factory)
    assert summary["successful_requests"] == summary["failed_requests"] == 0
    assert read_manifest(job.output.dir)["status"] == "done"


class _Missing(Preprocessor):
    """Every row whose prompt says so has a missing image."""

    def __call__(self, prompt, image, cached=()):
        return super().__call__(prompt, "/no/such.png" if prompt.startswith("bad") else image, cached)


def test_error_rows_reach_disk_as_they_come(tmp_path):
    """Thousands of bad rows in a row are written part by part, never all held in memory (the job's source is
    pulled only a bounded distance ahead of what was written)."""
    n, prefetch = 600, 4
    writer = PartWriter(tmp_path, 0, rows_per_part=50)
    written: list[str] = []
    ahead: list[int] = []

    def write(row):
        written.append(row["id"])
        writer.add(row)

    def source():
        yield SourceRow(0, "good", "fine", None)
        for i in range(1, n):
            ahead.append(i - len(written))
            yield SourceRow(i, f"b{i}", "bad row", None)

    flow = Flow(
        FakeEngine(), _Missing(PreprocessConfig()), str, Sampling(max_new_tokens=3), prefetch=prefetch
    )
    RowLoop(flow, write, t0=0.0).run(source())
    writer.close()
    assert sorted(written) == sorted(["good", *(f"b{i}" for i in range(1, n))])
    assert max(ahead) <= 2 * prefetch + 2, max(ahead)


@pytest.mark.slow
def test_a_row_stuck_in_a_worker_times_out_and_the_worker_is_replaced(tmp_path, monkeypatch):
    """A row whose preprocessing hangs (as reading a FIFO did) becomes an error row after row_timeout_s; its
    worker is killed, fresh ones take the other rows, and the job ends in bounded time with every other row done."""
    import batchvl.runner as runner

    mark = uuid.uuid4().hex
    monkeypatch.setattr(runner, "Preprocessor", HangingPreprocessor)
    monkeypatch.setenv("BATCHVL_TEST_HANG", str(tmp_path / "hanging"))
    monkeypatch.setenv("BATCHVL_TEST_MARK", mark)  # (spawned workers carry it)
    lines = [{"id": f"r{i}", "prompt": "hang" if i == 3 else f"question {i}"} for i in range(10)]
    job = small_job(tmp_path, write_jsonl(tmp_path / "rows.jsonl", lines), "preprocess.workers=1",
                    "preprocess.row_timeout_s=2", "preprocess.prefetch=4")  # fmt: skip
    t0 = time.monotonic()
    summary = run_job(job, engine_factory=fake_factory)
    assert time.monotonic() - t0 < 60  # the stuck row sleeps 600 s
    assert (tmp_path / "hanging").exists()
    got = {r["id"]: r["error"] for r in read_rows(job.output.dir).to_pylist()}
    assert sorted(got) == sorted(x["id"] for x in lines)
    assert "preprocess.row_timeout_s (2 s)" in got.pop("r3") and set(got.values()) == {None}
    assert (summary["successful_requests"], summary["failed_requests"]) == (9, 1)
    assert not [p for p in marked(mark) if b"spawn_main" in cmdline(p)]  # the stuck worker is gone too


# ---------------------------------------------------------------- parts that prove themselves


def _part(out: Path, ids: list[str], fps=FPS, chunk: int | None = None) -> Path:
    w = PartWriter(out, 0, rows_per_part=10**6, start_chunk=chunk, fingerprints=fps)
    for i in ids:
        w.add({"id": i, "output_token_ids": [1, 2, len(i)], "output_text": f"out {i}", "e2e_ms": 1.5})
    return w.flush()


def test_a_part_detects_flipped_bits_truncation_and_another_jobs_stamp(tmp_path):
    good = _part(tmp_path, [f"r{i:03d}" for i in range(10, 14)])
    assert part_problem(good, FPS) is None
    data, original = good.read_bytes(), pq.read_table(good)
    silent = 0
    for pos in range(4, len(data) - 4, 13):  # every 13th byte (all 8 bit positions), one bit flipped
        bad = bytearray(data)
        bad[pos] ^= 1 << (pos % 8)
        good.write_bytes(bytes(bad))
        if part_problem(good, FPS) is None:  # accepted: then what it holds must be exactly what was written
            silent += not pq.read_table(good).select(original.column_names).equals(original)
    assert silent == 0
    good.write_bytes(data[:3000] if len(data) > 3000 else data[: len(data) // 2])
    assert "unreadable" in part_problem(good, FPS)
    assert "another job" in part_problem(
        _part(tmp_path / "b", ["x"], fps={**FPS, "job_fingerprint": "j2"}), FPS
    )
    pq.write_table(pa.table({"id": ["x"]}), tmp_path / "plain.parquet")
    assert "no batchvl record" in part_problem(tmp_path / "plain.parquet", FPS)


def test_resume_quarantines_truncated_corrupt_and_foreign_parts(tmp_path, caplog):
    rows = text_rows(tmp_path, 40)
    job = small_job(tmp_path, rows, "output.rows_per_part=10")
    run_job(job, engine_factory=fake_factory)
    out = Path(job.output.dir)
    first = {r["id"]: r for r in read_rows(out).to_pylist()}
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 4
    os.truncate(parts[0], 3000)  # truncated
    bad = bytearray(parts[1].read_bytes())
    i = bad.index(b"r01")  # ids r010..r019 silently became s010.. in the issue
    bad[i] ^= 1
    parts[1].write_bytes(bytes(bad))
    other = small_job(tmp_path, rows, "generation.seed=1", out=tmp_path / "other")  # another job's part
    run_job(other, engine_factory=fake_factory)
    foreign = sorted(Path(other.output.dir).glob("part-*.parquet"))[2]
    (out / "part-00003-000000.parquet").write_bytes(foreign.read_bytes())
    with caplog.at_level("WARNING"):
        summary = run_job(job, engine_factory=fake_factory)
    ids = ids_on_disk(out)
    assert sorted(ids) == sorted(first) and len(ids) == 40  # nothing lost, nothing doubled
    assert summary["successful_requests"] == 40
    moved = sorted(p.name for p in (out / QUARANTINE_DIR).iterdir())
    assert moved == ["part-00000-000000.parquet", "part-00000-000001.parquet", "part-00003-000000.parquet"]
    for name, why in zip(moved, ("unreadable", "checksum", "another job"), strict=True):
        assert any(name in m and why in m for m in caplog.messages), (name, caplog.messages)
    assert read_manifest(out)["status"] == "done"


def test_the_manifest_records_each_part_and_a_resume_refuses_one_that_disagrees(tmp_path, caplog):
    """A part replaced by a self-consistent part of the same job (right fingerprints, its own checksum right) is
    caught by the manifest's record; a part a crashed run committed but did not record is taken in; a part gone
    loses its record, so a new part may take its name."""
    rows = text_rows(tmp_path, 40)
    job = small_job(tmp_path, rows, "output.rows_per_part=10")
    run_job(job, engine_factory=fake_factory)
    out = Path(job.output.dir)
    first = {r["id"]: r for r in read_rows(out).to_pylist()}
    man = read_manifest(out)
    parts = sorted(out.glob("part-*.parquet"))
    assert sorted(man["parts"]) == [p.name for p in parts]
    for p in parts:
        table = pq.read_table(p)
        assert man["parts"][p.name] == {"rows": table.num_rows, "digest": content_digest(table)} != {}
    fps = {k: man[k] for k in ("job_fingerprint", "model_fingerprint")}
    _part(out, [f"r{i:03d}" for i in range(10, 20)], fps=fps, chunk=1)  # passes its own checks
    assert part_problem(parts[1], fps) is None and "manifest's record" in part_problem(
        parts[1], fps, man["parts"][parts[1].name]
    )
    del man["parts"][parts[2].name]  # as if the run died after committing it
    write_manifest(out, man)
    parts[3].unlink()
    with caplog.at_level("WARNING"):
        assert run_job(job, engine_factory=fake_factory)["successful_requests"] == 40
    assert any(parts[1].name in m and "manifest's record" in m for m in caplog.messages), caplog.messages
    assert [p.name for p in (out / QUARANTINE_DIR).iterdir()] == [parts[1].name]
    again = {r["id"]: r for r in read_rows(out).to_pylist()}
    assert len(ids_on_disk(out)) == 40 and {i: r["output_token_ids"] for i, r in again.items()} == {
        i: r["output_token_ids"] for i, r in first.items()
    }
    man = read_manifest(out)
    on_disk = {p.name: pq.read_table(p) for p in out.glob("part-*.parquet")}
    assert parts[2].name in man["parts"] and parts[3].name in on_disk  # taken in; the name taken again
    assert man["parts"] == {n: {"rows": t.num_rows, "digest": content_digest(t)} for n, t in on_disk.items()}
    run_job(job, engine_factory=fake_factory)  # the records hold: nothing quarantined, nothing runs again
    assert len(list((out / QUARANTINE_DIR).iterdir())) == 1
    assert read_manifest(out)["runs"][-1]["counts"][0]["skipped"] == 40


def test_a_moved_or_symlinked_run_dir_resumes(tmp_path):
    rows = text_rows(tmp_path, 5)
    job = small_job(tmp_path, rows)
    run_job(job, engine_factory=fake_factory)
    moved = tmp_path / "moved"
    Path(job.output.dir).rename(moved)
    (tmp_path / "link").symlink_to(moved)
    for where, sets in ((moved, []), (tmp_path / "link", ["engine.max_prefill_tokens=7"])):
        again = small_job(tmp_path, rows, *sets, out=where)
        assert run_job(again, engine_factory=fake_factory)["successful_requests"] == 5
        man = read_manifest(moved)
        assert man["decision"] == "resume" and man["runs"][-1]["counts"][0]["skipped"] == 5


# ---------------------------------------------------------------- output dirs that are not batchvl's


def test_dirs_batchvl_did_not_write_are_refused_and_overwrite_deletes_only_its_own(tmp_path):
    rows = text_rows(tmp_path, 3)
    web = tmp_path / "webapp"
    web.mkdir()
    (web / "manifest.json").write_text('{"name": "my web app"}')
    (web / "summary.json").write_text("{}")
    with pytest.raises(ResumeError, match=r"not a batchvl run \(it holds manifest.json, summary.json\)"):
        run_job(small_job(tmp_path, rows, out=web), engine_factory=fake_factory)
    # --overwrite: batchvl writes its own _-named files beside the web app's and replaces none of them
    run_job(small_job(tmp_path, rows, "output.overwrite=true", out=web), engine_factory=fake_factory)
    assert (web / "manifest.json").read_text() == '{"name": "my web app"}' and (
        web / "summary.json"
    ).read_text() == "{}"
    (web / "_manifest.json").write_text('{"name": "my web app"}')  # a _manifest.json that is not batchvl's
    for overwrite in ("false", "true"):
        with pytest.raises(ResumeError, match="was not written by batchvl"):
            run_job(
                small_job(tmp_path, rows, f"output.overwrite={overwrite}", out=web),
                engine_factory=fake_factory,
            )
    (web / "_manifest.json").unlink()
    with pytest.raises(ResumeError, match="_summary.json or _summary.txt but no batchvl manifest"):
        run_job(small_job(tmp_path, rows, "output.overwrite=true", out=web), engine_factory=fake_factory)
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(b"not really")
    with pytest.raises(
        ResumeError, match=r"not empty and not a batchvl run \(it holds cat.jpg\).*--overwrite"
    ):
        run_job(small_job(tmp_path, rows, out=photos), engine_factory=fake_factory)
    job = small_job(tmp_path, rows, "output.overwrite=true", out=photos)
    assert run_job(job, engine_factory=fake_factory)["successful_requests"] == 3
    run_job(small_job(tmp_path, rows, out=photos), engine_factory=fake_factory)  # now a run: it resumes
    run_job(job, engine_factory=fake_factory)  # --overwrite again: batchvl's files go, the photo stays
    assert (photos / "cat.jpg").read_bytes() == b"not really"
    with pytest.raises(ResumeError, match="is / or the home directory"):
        check_resume("/", "j", "m", overwrite=True)


# ---------------------------------------------------------------- one run per dir


def test_a_second_run_on_the_same_dir_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, caplog):
    rows = text_rows(tmp_path, 3)
    job = small_job(tmp_path, rows)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from batchvl.output import RunLock; RunLock(sys.argv[1]).acquire(); "
         "print('locked', flush=True); time.sleep(60)", job.output.dir],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ResumeError, match=rf"in use by another batchvl run \(pid {holder.pid} on host "):
            run_job(job, engine_factory=fake_factory)
        assert sorted(os.listdir(job.output.dir)) == [".batchvl.lock"]  # nothing else was touched
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level("WARNING"):
        assert run_job(job, engine_factory=fake_factory)["successful_requests"] == 3
    assert any("taking over the lock" in m and str(holder.pid) in m for m in caplog.messages)
    lock = RunLock(job.output.dir)  # released at the end of the run
    lock.acquire()
    lock.release()


# ---------------------------------------------------------------- signals

SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import FakeEngine, HangingPreprocessor
import batchvl.runner as runner
from batchvl.job import load_job
from batchvl.runner import Interrupted, run_job, setup_logging

runner.Preprocessor = HangingPreprocessor

class Slow(FakeEngine):
    def step(self):
        time.sleep({step_s})
        return super().step()

setup_logging(0, 1)
try:
    run_job(load_job(sys.argv[1], sys.argv[2:]), engine_factory=lambda *a, **k: Slow())
except Interrupted as e:
    sys.exit(128 + e.signum)
"""


def start_job(tmp_path: Path, rows: Path, *sets: str, env: dict | None = None, step_s: float = 0.0):
    """The job in a subprocess (fake engine), marked so that its worker processes can be found."""
    mark = uuid.uuid4().hex
    code = SCRIPT.format(tests=str(REPO / "tests"), step_s=step_s)
    args = [sys.executable, "-c", code, str(REPO / "jobs/demo.yaml"), "data.format=jsonl", f"data.path={rows}",
            f"output.dir={tmp_path / 'run'}", *sets]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "BATCHVL_TEST_MARK": mark,
           "BATCHVL_TEST_HANG": str(tmp_path / "hanging"), **(env or {})}  # fmt: skip
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ), mark


def marked(mark: str) -> dict[int, int]:
    """pid -> parent pid of the live processes that carry this mark in their environment."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"BATCHVL_TEST_MARK={mark}".encode() in (d / "environ").read_bytes():
                stat = (d / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # (it just ended)
        return b""


def gone(mark: str, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while marked(mark) and time.monotonic() < end:
        time.sleep(0.1)
    return not marked(mark)


def _assert_stopped_then_resumed(tmp_path: Path, rows: Path, n: int, after: int) -> None:
    """The finished rows are on disk and recorded, the manifest says interrupted, and a re-run completes with each id
    once, keeping the rows written before the stop."""
    out = tmp_path / "run"
    first = {r["id"]: r for r in read_rows(out).to_pylist()}
    assert after <= len(first) < n and len(first) == len(ids_on_disk(out))
    man = read_manifest(out)
    assert man["status"] == "interrupted" and man["runs"][-1]["interrupted"] and man["ended_at"]
    assert sorted(man["parts"]) == sorted(p.name for p in out.glob("part-*.parquet"))  # recorded at the stop
    job = small_job(tmp_path, rows)
    assert run_job(job, engine_factory=fake_factory)["successful_requests"] == n
    rows_now = {r["id"]: r for r in read_rows(out).to_pylist()}
    assert len(ids_on_disk(out)) == n and all(rows_now[i] == r for i, r in first.items())
    assert read_manifest(out)["status"] == "done"


# 150 rows, rows_per_part 4 (the demo's), the signal after 62 (issue 27's case, smaller): rows are still buffered
N_ROWS, SIGNAL_AT = 150, 62


@pytest.mark.slow
def test_sigint_keeps_every_finished_row_and_marks_the_manifest(tmp_path, monkeypatch):
    """In this process (the job's own handler takes SIGINT while it runs), rows prepared in-process."""
    rows = text_rows(tmp_path, N_ROWS)
    monkeypatch.setenv(SIGNAL_AFTER_ENV, f"{SIGNAL_AT}:SIGINT")
    with pytest.raises(Interrupted) as stopped:
        run_job(small_job(tmp_path, rows, "preprocess.workers=0"), engine_factory=fake_factory)
    assert stopped.value.signum == signal.SIGINT
    monkeypatch.delenv(SIGNAL_AFTER_ENV)
    _assert_stopped_then_resumed(tmp_path, rows, N_ROWS, SIGNAL_AT)


@pytest.mark.slow
def test_sigterm_keeps_every_finished_row_and_stops_a_worker_stuck_on_a_row(tmp_path):
    """A job in a subprocess whose worker is stuck on a row just ahead of the stop (it never finishes preparing;
    the engine's steps are slowed so that the worker gets there first): the process exits with the signal's code, no
    worker outlives it, and the finished rows are kept."""
    rows = text_rows(tmp_path, N_ROWS)
    lines = rows.read_text().splitlines()
    lines[SIGNAL_AT + 10] = json.dumps({"id": f"r{SIGNAL_AT + 10:03d}", "prompt": "hang"})
    write_jsonl(rows, lines)
    p, mark = start_job(tmp_path, rows, "preprocess.workers=1", env={SIGNAL_AFTER_ENV: f"{SIGNAL_AT}:SIGTERM"},
                        step_s=0.05)  # fmt: skip
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert gone(mark, within_s=5), marked(mark)
    assert (tmp_path / "hanging").exists()
    _assert_stopped_then_resumed(tmp_path, rows, N_ROWS, SIGNAL_AT)


@pytest.mark.slow
def test_workers_die_with_a_killed_parent(tmp_path):
    """SIGKILL leaves no handler to run: a worker stuck on a row must still die with its parent."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"id": "h", "prompt": "hang"}, {"id": "x", "prompt": "x"}])
    p, mark = start_job(tmp_path, rows, "preprocess.workers=1")
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "hanging").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert (tmp_path / "hanging").exists() and p.poll() is None
        workers = [k for k, pp in marked(mark).items() if pp == p.pid and b"spawn_main" in cmdline(k)]
        assert workers, marked(mark)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert gone(mark), marked(mark)
    finally:
        p.kill()
        p.communicate()


# ---------------------------------------------------------------- a stalled rank


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_stalled_rank_fails_the_job_naming_it_and_a_rerun_resumes(tmp_path):
    """torchrun --nproc 2 on gloo: rank 1 freezes (SIGSTOP) after its first row. Rank 0 finishes its own rows, then
    waits for rank 1 no longer than dist.timeout_s and fails the job with a message naming rank 1 and the setting,
    in the manifest too; the job, run again, resumes and ends with every row once."""
    out = tmp_path / "run"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "batchvl.runner", "jobs/demo.yaml",
           "--set", f"output.dir={out}", "--set", "dist.timeout_s=8", "--set", "output.rows_per_part=1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen(cmd, cwd=REPO, env={**env, SIGNAL_AFTER_ENV: "1:SIGSTOP:1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    stopped = None
    try:
        end = time.monotonic() + 180
        while stopped is None and p.poll() is None and time.monotonic() < end:
            stopped = next((k for k in _children(p.pid) if _state(k) == "T"), None)
            time.sleep(0.1)
        assert stopped is not None, "rank 1 never stopped"
        t_stop = time.monotonic()
        while any(k != stopped for k in _children(p.pid)) and time.monotonic() < t_stop + 90:
            time.sleep(0.1)  # rank 0 at work, then waiting for rank 1
        waited = time.monotonic() - t_stop
        os.kill(stopped, signal.SIGKILL)  # (torchrun's SIGTERM would wait for a stopped process)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode != 0
    assert "rank(s) 1 did not answer" in err and "dist.timeout_s (8 s)" in err, err[-3000:]
    assert waited < 45, waited  # about dist.timeout_s after rank 0's last row, not 30 min
    man = read_manifest(out)  # rank 0 noticed: it recorded why
    assert man["status"] == "failed" and "rank(s) 1 did not answer" in man["error"], man.get("error")
    written = ids_on_disk(out)
    # the re-run in this process (one rank, no second torchrun start): the resume rules do not depend on the world
    run_job(load_job(REPO / "jobs/demo.yaml", [f"output.dir={out}", "output.rows_per_part=1"]))
    man = read_manifest(out)
    assert man["decision"] == "resume" and man["status"] == "done"
    assert sum(c["skipped"] for c in man["runs"][-1]["counts"]) == len(written) > 0
    assert sorted(ids_on_disk(out)) == sorted(r["id"] for r in demo_rows())  # every row once


# ---------------------------------------------------------------- sampling and resume


@pytest.mark.slow
def test_a_resumed_sampled_run_equals_an_uninterrupted_one(tmp_path):
    """T=1 on the real (tiny) engine: a run that lost parts and resumed, with other batch budgets, samples exactly
    what an uninterrupted run sampled; another seed samples something else (8 text rows: no ViT to wait for)."""
    rows = text_rows(tmp_path, 8)

    def demo(out: Path, *sets: str):
        run_job(
            small_job(tmp_path, rows, "generation.temperature=1.0", "output.rows_per_part=2", *sets, out=out)
        )
        return {r["id"]: r["output_token_ids"] for r in read_rows(out).to_pylist()}

    whole = demo(tmp_path / "a")
    assert demo(tmp_path / "c", "generation.seed=1") != whole
    b = tmp_path / "b"
    demo(b, "engine.max_prefill_tokens=1")  # one row per batch
    for part in sorted(b.glob("part-*.parquet"))[1:3]:  # as if the run had died before writing them
        part.unlink()
    resumed = demo(b)
    assert read_manifest(b)["runs"][-1]["counts"][0]["skipped"] == 4
    assert resumed == whole
