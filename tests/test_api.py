"""batchvl.Pipeline, the Python API: the README's example run as written (its run dir moved to a temp dir) on the
tiny CPU model, and with a stand-in engine: built once for several runs, images as PIL / bytes / paths / lists, the
Parquet columns, error rows, a run dir written, an early close, and the errors."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import FakeEngine

from batchvl import Pipeline
from batchvl.demo import demo_rows
from batchvl.job import JobError, load_job
from batchvl.output import ROW_SCHEMA, read_manifest, read_rows
from batchvl.runner import run_job

REPO = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- the test in tests/test_api.py runs this block -->", 1)[1]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)


@pytest.mark.slow
def test_the_readme_python_example_runs(tmp_path, capsys):
    code = readme_example()
    assert '"runs/from_python"' in code
    code = code.replace("runs/from_python", str(tmp_path / "run"))
    here = os.getcwd()
    os.chdir(REPO)  # the example's job path is relative to the repo, as a user would run it from there
    try:
        scope: dict = {}
        exec(compile(code, "README.md", "exec"), scope)
    finally:
        os.chdir(here)
    df, results = scope["df"], scope["results"]
    assert sorted(df["id"]) == ["one", "two"] and df["error"].isna().all()
    two = df.set_index("id").loc["two"]
    assert (two["num_tiles"], two["num_image_tokens"]) == (2, 512)  # one tile each, 256 tokens a tile
    assert all(len(t) >= 1 for t in df["output_token_ids"])
    printed = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in printed) == ["one", "two"]  # the in-memory run's rows
    by_id = {r["id"]: r for r in results}  # the run that also wrote the dir yielded what Parquet holds
    for row in df.to_dict("records"):
        assert [int(t) for t in row["output_token_ids"]] == by_id[row["id"]]["output_token_ids"]
        assert row["e2e_ms"] == by_id[row["id"]]["e2e_ms"]
    summary = json.loads((tmp_path / "run" / "_summary.json").read_text())
    assert summary["successful_requests"] == 2


def test_rows_and_the_rows_format_go_together(tmp_path):
    job = load_job(REPO / "jobs/demo.yaml", [f"output.dir={tmp_path}"])
    with pytest.raises(
        JobError, match="'rows' and run_job.job, rows=.*. go together; got format 'demo' and rows"
    ):
        run_job(job, rows=[])
    job = load_job(REPO / "jobs/demo.yaml", ["data.format=rows", f"output.dir={tmp_path}"])
    with pytest.raises(JobError, match="got format 'rows' and no rows"):
        run_job(job)
    with pytest.raises(JobError, match="job.data.path: format 'rows' reads no file"):
        load_job(REPO / "jobs/demo.yaml", ["data.format=rows", "data.path=x.jsonl", f"output.dir={tmp_path}"])


class PixelRecorder(FakeEngine):
    """A FakeEngine that keeps the tiles each row reached the engine with."""

    def __init__(self):
        super().__init__()
        self.pixels: dict[str, torch.Tensor | None] = {}

    def admit(self, requests):
        for r in requests:
            self.pixels[r.handle.row.id] = r.pixel_values
        return super().admit(requests)


def counting_factory(built: list) -> Callable:
    def factory(*args, **kwargs):
        built.append(PixelRecorder())
        return built[-1]

    return factory


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_a_pipeline_builds_once_takes_images_in_every_form_and_yields_the_parquet_rows(tmp_path):
    from PIL import Image

    built: list = []
    pipe = Pipeline.from_job(REPO / "jobs/demo.yaml", engine_factory=counting_factory(built))
    red, blue = Image.new("RGB", (640, 480), "red"), Image.new("RGB", (300, 300), "blue")
    red.save(tmp_path / "red.png")
    rows = [
        {"id": 1, "prompt": "Which colour?", "image": red},
        {"id": "bytes", "prompt": "Which colour?", "image": png(red)},
        {"id": "path", "prompt": "Which colour?", "image": str(tmp_path / "red.png")},
        {"id": "pathlib", "prompt": "Which colour?", "image": tmp_path / "red.png"},
        {"id": "blue", "prompt": "Which colour?", "image": blue},
        {"id": "two", "prompt": "Compare <image> with <image>.", "image": [png(red), blue]},
        {"id": "garbage", "prompt": "Which colour?", "image": b"not an image"},
        {"id": "missing", "prompt": "Which colour?", "image": str(tmp_path / "nope.png")},
    ]
    got = {r["id"]: r for r in pipe.run(rows)}
    assert all(list(r) == ROW_SCHEMA.names for r in got.values())  # exactly the Parquet columns, in order
    assert sorted(got) == sorted(["1", "bytes", "path", "pathlib", "blue", "two", "garbage", "missing"])
    assert "not an image" in got["garbage"]["error"] and "not found" in got["missing"]["error"]
    assert got["garbage"]["output_token_ids"] is None and got["1"]["error"] is None
    assert got["1"]["run"] is None and got["1"]["rank"] == 0  # no run dir: no run number
    eng = built[0]
    for form in ("bytes", "path", "pathlib"):  # the same pixels however the image came
        assert torch.equal(eng.pixels[form], eng.pixels["1"]), form
    assert not torch.equal(eng.pixels["blue"], eng.pixels["1"][: len(eng.pixels["blue"])])
    assert got["two"]["num_tiles"] == len(eng.pixels["two"]) == len(eng.pixels["1"]) + len(eng.pixels["blue"])
    assert got["two"]["num_image_tokens"] == got["1"]["num_image_tokens"] + got["blue"]["num_image_tokens"]

    # a second run reuses the model and also writes a run dir: what it yields is what Parquet holds
    out = tmp_path / "run"
    run = pipe.run(rows[:3], out_dir=out)
    yielded = []
    with pytest.raises(StopIteration) as end:
        while True:
            yielded.append(next(run))
    assert len(built) == 1  # built once for both runs
    on_disk = read_rows(out).to_pylist()
    assert sorted(yielded, key=lambda r: r["id"]) == sorted(on_disk, key=lambda r: r["id"])
    assert {r["run"] for r in on_disk} == {0} and read_manifest(out)["status"] == "done"
    assert end.value.value == json.loads((out / "_summary.json").read_text())
    assert end.value.value["successful_requests"] == 3
    assert [r["output_token_ids"] for r in yielded] == [got[r["id"]]["output_token_ids"] for r in yielded]
    pipe.close()


def test_closing_a_run_early_keeps_its_rows_frees_the_lock_and_the_next_run_resumes(tmp_path):
    built: list = []
    pipe = Pipeline.from_job(REPO / "jobs/demo.yaml", ["output.rows_per_part=100"],
                             engine_factory=counting_factory(built))  # fmt: skip
    # row i ends after i + 1 tokens: each in its own step
    rows = [{"id": f"r{i}", "prompt": "Say hi.", "image": None, "max_new_tokens": i + 1} for i in range(6)]
    out = tmp_path / "run"
    run = pipe.run(rows, out_dir=out)
    first = next(run)
    with pytest.raises(RuntimeError, match="another run of this pipeline is still being iterated"):
        next(pipe.run(rows))
    assert (out / ".batchvl.lock").read_text().startswith("pid ")
    run.close()  # as `break` does
    assert built[0].active == 0  # nothing left in flight for the next run
    kept = read_rows(out).to_pylist()  # rows_per_part 100: the close flushed what was written
    assert [r["id"] for r in kept] == [first["id"]] == ["r0"]
    man = read_manifest(out)
    assert man["status"] == "interrupted" and man["runs"][-1]["interrupted"]
    assert (out / ".batchvl.lock").read_text() == ""  # released
    again = list(pipe.run(rows, out_dir=out))  # resumes: only the rows not yet written
    assert sorted(r["id"] for r in again) == [f"r{i}" for i in range(1, 6)]
    assert {r["run"] for r in again} == {1} and read_manifest(out)["status"] == "done"
    assert sorted(r["id"] for r in read_rows(out).to_pylist()) == [f"r{i}" for i in range(6)]
    assert len(built) == 1


def test_closing_a_run_early_stops_its_workers(tmp_path):
    pipe = Pipeline.from_job(
        REPO / "jobs/demo.yaml", ["preprocess.workers=1"], engine_factory=lambda *a: FakeEngine()
    )
    run = pipe.run([{"id": f"r{i}", "prompt": "Say hi.", "max_new_tokens": i + 1} for i in range(4)])
    next(run)
    assert len(multiprocessing.active_children()) == 1
    run.close()
    assert multiprocessing.active_children() == []


def test_a_pipeline_from_job_sections_and_its_errors(tmp_path):
    built: list = []
    pipe = Pipeline(model="tiny-qwen2", data={"allow_text_only": True}, preprocess={"workers": 0},
                    generation={"max_new_tokens": 3}, engine_factory=counting_factory(built))  # fmt: skip
    rows = list(pipe.run([{"id": "a", "prompt": "Say hi."}, {"id": "a", "prompt": "Again."}]))
    assert [(r["id"], r["error"]) for r in rows] == [("a", None), ("a", "duplicate id")]
    assert len(rows[0]["output_token_ids"]) == 3
    with pytest.raises(JobError, match="Pipeline.run: give the rows"):
        pipe.run()
    with pytest.raises(JobError, match=r"job.output.dir: .* is / or the home directory"):
        pipe.run([], out_dir="/")
    with pytest.raises(JobError, match="job.generation.max_new_tokns: unknown key"):
        Pipeline(model="tiny-qwen2", generation={"max_new_tokns": 3}, engine_factory=counting_factory(built))
    with pytest.raises(JobError, match="job.model.path: .*no_such_dir is not a directory"):
        Pipeline(model=str(tmp_path / "no_such_dir"))
    assert len(built) == 1
    demo = Pipeline.from_job(REPO / "jobs/demo.yaml", engine_factory=counting_factory(built))
    assert sorted(r["id"] for r in demo.run()) == sorted(r["id"] for r in demo_rows())  # the job's own source


def test_an_exception_inside_a_run_marks_its_manifest_interrupted_or_failed(tmp_path):
    """The tiny model: a KeyboardInterrupt inside a run (Ctrl-C in a notebook) leaves the manifest `interrupted`
    with the finished rows on disk; another exception leaves it `failed` with the reason; the dir then resumes. Here
    the rows' source raises them (one row at a time in flight, each done at admission: rows finish before)."""
    pipe = Pipeline(model="tiny-qwen2", data={"allow_text_only": True}, preprocess={"workers": 0, "prefetch": 1},
                    generation={"max_new_tokens": 1}, output={"rows_per_part": 100})  # fmt: skip
    rows = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(6)]

    def source(error: BaseException):
        yield from rows[:3]
        raise error

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        list(pipe.run(source(KeyboardInterrupt()), out_dir=out))
    man = read_manifest(out)
    assert man["status"] == "interrupted" and man["runs"][-1]["interrupted"] and "error" not in man
    kept = sorted(r["id"] for r in read_rows(out).to_pylist())
    assert kept and sum(man["parts"][p]["rows"] for p in man["parts"]) == len(kept)
    with pytest.raises(ValueError, match="the source broke"):
        list(pipe.run(source(ValueError("the source broke")), out_dir=out))
    man = read_manifest(out)
    assert (
        man["status"] == "failed"
        and man["error"] == "ValueError: the source broke" == man["runs"][-1]["error"]
    )
    again = sorted(r["id"] for r in pipe.run(rows, out_dir=out))
    assert again == [f"r{i}" for i in range(6) if f"r{i}" not in kept]
    assert read_manifest(out)["status"] == "done" and len(read_rows(out)) == 6
    pipe.close()
