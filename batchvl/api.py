"""The Python API: a job's model loaded once, rows given from Python, each result row yielded as it finishes
(`from batchvl import Pipeline`; the README's "From Python" shows it)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

from batchvl import dist
from batchvl.config import PRESETS
from batchvl.data import check_source
from batchvl.job import Job, JobError, job_from_dict, job_to_dict, load_job
from batchvl.runner import (
    LoadedModel,
    build_engine,
    load_model,
    load_preprocessor,
    open_run_dir,
    resolve_model,
    run_rows,
    start_manifest,
)


class Pipeline:
    """A model loaded once (tokenizer, preprocessing workers, engine, warm-up); each `run` streams rows through it.

    `Pipeline(model=..., preprocess=..., engine=..., generation=..., data=..., output=...)` takes the sections of a
    job file as dicts (`model` also as a preset name or a checkpoint directory); `Pipeline.from_job` reads a job
    file. `engine_factory` builds the engine (tests pass a stand-in)."""

    def __init__(
        self,
        model: str | dict | None = None,
        *,
        job: Job | None = None,
        engine_factory: Callable = build_engine,
        **sections: dict,
    ) -> None:
        if (model is None) == (job is None):
            raise JobError("Pipeline: give model=... (and other job sections) or job=..., not both")
        if job is None:
            if isinstance(model, str):
                model = {"preset": model} if model in PRESETS else {"path": model}
            data = {"format": "rows", **(sections.pop("data", None) or {})}
            job = job_from_dict({**sections, "model": model, "data": data})
        elif sections:
            raise JobError(f"Pipeline: job=... takes no other sections (got {', '.join(sections)})")
        self.job, self.ctx = job, dist.DistContext()
        self.device, self.dtype, self.cfg = resolve_model(job, self.ctx)
        tokenizer, pre = load_preprocessor(job, self.cfg)
        self.model: LoadedModel = load_model(
            job, self.ctx, engine_factory, self.device, self.dtype, self.cfg, tokenizer, pre
        )
        self._running = False

    @classmethod
    def from_job(
        cls, job_file: str | Path, overrides: Iterable[str] = (), engine_factory: Callable = build_engine
    ) -> Pipeline:
        """The model of a job file (`overrides`: `--set` style "key=value" strings). `run()` without rows runs the
        job's own data source."""
        return cls(job=load_job(job_file, tuple(overrides)), engine_factory=engine_factory)

    def run(
        self, rows: Iterable[dict] | None = None, out_dir: str | Path | None = None, overwrite: bool = False
    ) -> Generator[dict, None, dict | None]:
        """Yield each row's result, with the Parquet columns (`output_text`, `error`, stage times, ...), as it
        finishes (not in input order). `rows`: dicts {id, prompt, image} (the job's data.*_field names), each image a
        path, bytes or a PIL image, or a list of them; None: the job's data source. `out_dir`: also write a run dir
        there, as `python -m batchvl.runner` does (it resumes, skipping ids already written; `overwrite` starts
        over); the generator then returns the summary. Stopping early (break) leaves the finished rows written."""
        raw = job_to_dict(self.job)
        if rows is not None:
            raw["data"] |= {"format": "rows", "path": None}
        elif self.job.data.format == "rows":
            raise JobError("Pipeline.run: give the rows (this pipeline's job has data.format 'rows')")
        raw["output"] |= {"dir": None if out_dir is None else str(out_dir), "overwrite": overwrite}
        job = job_from_dict(raw)  # validates out_dir as the job's output.dir
        check_source(job.data)
        return self._run(job, rows)

    def _run(self, job: Job, rows: Iterable[dict] | None) -> Generator[dict, None, dict | None]:
        if self._running:
            raise RuntimeError("Pipeline.run: another run of this pipeline is still being iterated; finish or "
                               "close it first (the model serves one run at a time)")  # fmt: skip
        self._running = True
        try:
            if job.output.dir is None:
                return (yield from run_rows(self.model, job, rows, None, None))
            decision, lock = open_run_dir(job, self.ctx, self.dtype, self.cfg)
            try:
                manifest = start_manifest(job, self.ctx, self.device, self.dtype, self.cfg, decision)
                return (yield from run_rows(self.model, job, rows, manifest, None))
            finally:
                lock.release()
        finally:
            self._running = False

    def close(self) -> None:
        """Stop preprocessing workers that no run took (each run stops its own)."""
        self.model.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
