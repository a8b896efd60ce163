"""The README's Python example, run as written (output.dir moved to a temp dir): in-memory PIL images, one image and
two, through load_job -> run_job -> read_rows on CPU."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from batchvl.job import JobError, load_job
from batchvl.runner import run_job

REPO = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- the test in tests/test_api.py runs this block -->", 1)[1]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)


@pytest.mark.slow
def test_the_readme_python_example_runs(tmp_path):
    code = readme_example()
    assert '"output.dir=runs/from_python"' in code
    code = code.replace("runs/from_python", str(tmp_path / "run"))
    here = os.getcwd()
    os.chdir(REPO)  # the example's job path is relative to the repo, as a user would run it from there
    try:
        scope: dict = {}
        exec(compile(code, "README.md", "exec"), scope)
    finally:
        os.chdir(here)
    df, summary = scope["df"], scope["summary"]
    assert sorted(df["id"]) == ["one", "two"] and df["error"].isna().all()
    two = df.set_index("id").loc["two"]
    assert (two["num_tiles"], two["num_image_tokens"]) == (2, 512)  # one tile each, 256 tokens a tile
    assert summary["successful_requests"] == 2 and all(len(t) >= 1 for t in df["output_token_ids"])


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
