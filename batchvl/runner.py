"""Run a job: `python -m batchvl.runner JOB.yaml [--set key=value ...] [--overwrite]`; torchrun for replicas.

The same commands as the `batchvl` console script: `run JOB.yaml` (the default) and `report RUN_DIR`.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import click
import torch
from tqdm import tqdm

from batchvl import dist
from batchvl.config import InternVLConfig, config_to_dict, from_preset, load_config
from batchvl.data import check_source, count_rows, iter_rows
from batchvl.job import Job, JobError, job_for_fingerprint, job_to_dict, load_job
from batchvl.output import (
    PartWriter,
    ResumeError,
    RunLock,
    check_output_dir,
    check_resume,
    done_ids,
    fingerprint,
    format_summary,
    quarantine_bad_parts,
    read_manifest,
    run_summary,
    schema_row,
    upgrade_layout,
    write_manifest,
    write_summary,
)
from batchvl.pipeline import Flow, Preparer, RowLoop, write_rows
from batchvl.preprocess import PreprocessConfig, Preprocessor
from batchvl.profiling import profiled
from batchvl.report import report_cmd
from batchvl.tokenizer import image_token_ids, load_tokenizer

log = logging.getLogger("batchvl.runner")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(job: Job, ctx: dist.DistContext) -> torch.device:
    """auto: this rank's GPU when there is one, else the CPU."""
    want = job.model.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise JobError("job.model.device: cuda asked for, but torch sees no GPU")
        return torch.device("cuda", ctx.local_rank)
    return torch.device("cpu")


def resolve_dtype(job: Job, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPU, float32 on CPU."""
    if job.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[job.model.dtype]


def check_quantization(job: Job, device: torch.device, ctx: dist.DistContext) -> None:
    """Refuse, before anything loads, a model.quantization this device cannot run (e.g. fp8 on a CPU)."""
    from batchvl.model.build import check_quantization as check

    try:
        check(job.model, device, ctx.tp)
    except ValueError as e:
        raise JobError(f"job.{e}") from None


def model_config(job: Job) -> InternVLConfig:
    """The model's config without loading weights."""
    return load_config(job.model.path) if job.model.path else from_preset(job.model.preset)


def model_fingerprint(job: Job, cfg: InternVLConfig, dtype: torch.dtype) -> str:
    m = job.model
    source = {"path": m.path} if m.path else {"preset": m.preset, "weights": m.weights, "seed": m.seed}
    if m.quantization != "none":  # (absent when none: run dirs of earlier versions keep their fingerprint)
        source["quantization"] = m.quantization
    return fingerprint({"config": config_to_dict(cfg), "source": source, "dtype": str(dtype)})


def build_engine(
    job: Job,
    device: torch.device,
    dtype: torch.dtype,
    eos_token_ids: tuple[int, ...] = (),
    ctx: dist.DistContext | None = None,
) -> Any:
    """The model, ready to serve, and the engine over it (its KV pool sized from the memory left)."""
    from batchvl.engine import Engine
    from batchvl.model.build import build_model
    from batchvl.model.compile_helpers import ColdStart

    longest = job.preprocess.max_input_tokens + job.generation.max_new_tokens
    tp = ctx.tp if ctx is not None else 1
    cold = ColdStart(model_config(job), job.model.quantization, job.engine, device, dtype, longest, tp)
    try:  # a cold start's graphs compile in helper processes while the weights load
        model, encode = build_model(job.model, job.engine, device, dtype, ctx)
        cold.wait()
    except BaseException:
        cold.kill()
        raise
    engine = Engine(model, model.cfg, job.engine, device, dtype, eos_token_ids, encode, longest,
                    seed=job.generation.seed)  # fmt: skip
    engine.cold_start = cold
    return engine


def preprocess_config(job: Job, cfg: InternVLConfig) -> PreprocessConfig:
    p = job.preprocess
    return PreprocessConfig(
        image_size=cfg.vision.image_size,
        min_tiles=p.min_tiles,
        max_tiles=p.max_tiles,
        use_thumbnail=p.use_thumbnail,
        num_image_token=cfg.num_image_token,
        template=cfg.template,
        system_message=p.system_message,
        max_input_tokens=p.max_input_tokens,
        overlong=p.overlong,
        max_image_pixels=p.max_image_pixels,
        max_tiles_per_row=p.max_tiles_per_row,
        max_image_bytes=p.max_image_bytes,
    )


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The template's end-of-turn token and the tokenizer's eos."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return tuple(sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id))


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of the one token `text` encodes to, else None (a row's stop strings must be single tokens)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("batchvl", "torch", "transformers", "datasets", "pyarrow"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped the job; its finished rows are written and the manifest says `interrupted`."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class StopOnSignal:
    """While active, SIGINT and SIGTERM ask the job to stop: before rows flow by raising Interrupted, after that by
    setting `event` (the pipeline writes what is finished and stops). A second signal exits at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.rows_flowing = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # (signals reach the main thread only)
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            os._exit(128 + signum)  # the second signal; workers die with this process
        self.signum = signum
        self.event.set()
        log.warning("%s: stopping; finished rows are kept (signal again to exit at once)",
                    signal.Signals(signum).name)  # fmt: skip
        if not self.rows_flowing:
            raise Interrupted(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _resume_decision(
    job: Job, ctx: dist.DistContext, job_fp: str, model_fp: str, model: dict
) -> tuple[str, RunLock | None]:
    """Rank 0 checks the output dir, locks it, decides fresh/resume/overwrite (deleting on overwrite) and moves
    parts that fail verification to quarantine; every rank gets the decision."""
    answer: tuple[str, str] = ("ok", "")
    lock = RunLock(job.output.dir) if ctx.is_main else None
    if lock is not None:
        try:
            upgrade_layout(job.output.dir)  # an older layout's manifest.json is batchvl's own
            check_output_dir(job.output.dir, job.output.overwrite)  # before the lock file goes in
            lock.acquire()
            answer = ("ok", check_resume(job.output.dir, job_fp, model_fp, job.output.overwrite,
                                         job_for_fingerprint(job), model))  # fmt: skip
            if answer[1] == "resume":
                quarantine_bad_parts(job.output.dir, _fingerprints(job_fp, model_fp))
        except ResumeError as e:
            lock.release()
            answer = ("error", str(e))
        except BaseException:
            lock.release()
            raise
    kind, value = dist.broadcast_object(ctx, answer)
    if kind == "error":
        raise ResumeError(value)
    return value, lock


def _fingerprints(job_fp: str, model_fp: str) -> dict[str, str]:
    return {"job_fingerprint": job_fp, "model_fingerprint": model_fp}


def run_job(
    job: Job,
    ctx: dist.DistContext | None = None,
    engine_factory: Callable = build_engine,
    rows: Iterable[dict] | None = None,
) -> dict | None:
    """Run `job` on this rank; rank 0 returns the summary of all rows in the output dir. `rows`: the rows of a job
    with data.format 'rows', dicts like a jsonl source's ({id, prompt, image}), images as paths, bytes or PIL
    images (a list of them for several). Raises Interrupted on SIGINT / SIGTERM after writing the finished rows and
    marking the manifest."""
    ctx = ctx or dist.DistContext()
    if (rows is not None) != (job.data.format == "rows"):
        raise JobError("job.data.format: 'rows' and run_job(job, rows=[...]) go together; got format "
                       f"{job.data.format!r} and {'no ' if rows is None else ''}rows")  # fmt: skip
    if job.output.dir is None:
        raise JobError("job.output.dir: required (where the Parquet parts go)")
    device, dtype, cfg = resolve_model(job, ctx)
    check_source(job.data)
    decision, lock = open_run_dir(job, ctx, dtype, cfg)
    try:
        with StopOnSignal() as stop:
            summary = _run(job, ctx, engine_factory, device, dtype, cfg, decision, stop, rows)
    finally:
        if lock is not None:
            lock.release()
    if summary is not None:
        click.echo(format_summary(summary))
    return summary


def resolve_model(job: Job, ctx: dist.DistContext) -> tuple[torch.device, torch.dtype, InternVLConfig]:
    """(device, dtype, config) of the job's model, refusing what this process cannot run before anything loads."""
    if job.model.tp != ctx.tp:
        raise JobError(f"job.model.tp: {job.model.tp} but the process groups were built for tp={ctx.tp}")
    device = resolve_device(job, ctx)
    dtype = resolve_dtype(job, device)
    check_quantization(job, device, ctx)
    return device, dtype, model_config(job)


def open_run_dir(
    job: Job, ctx: dist.DistContext, dtype: torch.dtype, cfg: InternVLConfig
) -> tuple[str, RunLock | None]:
    """Lock job.output.dir (rank 0) and decide fresh / resume / overwrite for this job and model."""
    job_fp, model_fp = fingerprint(job_for_fingerprint(job)), model_fingerprint(job, cfg, dtype)
    model_desc = {"config": config_to_dict(cfg), "dtype": str(dtype)}
    return _resume_decision(job, ctx, job_fp, model_fp, model_desc)


def _run(job: Job, ctx: dist.DistContext, engine_factory: Callable, device: torch.device, dtype: torch.dtype,
         cfg: InternVLConfig, decision: str, stop: StopOnSignal, rows: Iterable[dict] | None) -> dict | None:  # fmt: skip
    tokenizer, pre = load_preprocessor(job, cfg)
    manifest = start_manifest(job, ctx, device, dtype, cfg, decision)
    try:  # the manifest says `running` while the model loads
        model = load_model(job, ctx, engine_factory, device, dtype, cfg, tokenizer, pre)
    except BaseException as e:
        _mark_stopped(ctx, manifest, _this_run(manifest, ctx, 0.0, 0.0, 0.0, []), e)
        raise
    try:
        return _finish(run_rows(model, job, rows, manifest, stop))
    finally:
        model.close()


def _finish(run: Generator[dict, None, Any]) -> Any:
    """Drive a generator to its end; its return value."""
    while True:
        try:
            next(run)
        except StopIteration as end:
            return end.value


def load_preprocessor(job: Job, cfg: InternVLConfig) -> tuple[Any, Preprocessor]:
    """(tokenizer, preprocessor) of the job's model; a tokenizer whose image token is not the model's is refused."""
    m = job.model
    tok_path = m.tokenizer or m.path  # neither (a preset): the stand-in tokenizer of the preset's LLM
    tokenizer = load_tokenizer(tok_path, m.trust_remote_code, cfg.llm.arch)
    ctx_id = image_token_ids(tokenizer)["img_context"]
    if cfg.image_token_id >= 0 and ctx_id != cfg.image_token_id:
        raise JobError(
            f"job.model: tokenizer's <IMG_CONTEXT> id {ctx_id} != the model's image_token_id "
            f"{cfg.image_token_id}; set model.tokenizer to the model's tokenizer"
        )
    return tokenizer, Preprocessor(preprocess_config(job, cfg), tok_path, m.trust_remote_code, cfg.llm.arch)


@dataclass
class LoadedModel:
    """A job's model loaded and warmed up, with what runs rows through it: every run of rows shares it."""

    job: Job  # its model, preprocess, engine and generation sections made this
    ctx: dist.DistContext
    device: torch.device
    dtype: torch.dtype
    cfg: InternVLConfig
    engine: Any
    flow: Flow
    load_s: float
    warm_s: float
    warm_parts: dict[str, float]  # the warm-up's seconds by part (compile_helpers, then `WARM_PARTS`)
    warm_prep: Preparer | None  # workers started while the model loaded, for the first run

    def start_run(self) -> tuple[Preparer, float, float]:
        """(preparer, load_s, warm_s) of the next run: the first gets the warm workers and the load's seconds, a
        later one a new pool and zeros (it loaded nothing)."""
        if self.warm_prep is None:
            return new_preparer(self.job, self.flow.preprocessor, self.device), 0.0, 0.0
        prep, self.warm_prep = self.warm_prep, None
        return prep, self.load_s, self.warm_s

    def close(self) -> None:
        """Stop workers no run took."""
        if self.warm_prep is not None:
            self.warm_prep.close()
            self.warm_prep = None


def new_preparer(job: Job, pre: Preprocessor, device: torch.device) -> Preparer:
    p = job.preprocess
    return Preparer(pre, p.workers, p.prefetch, pin=device.type == "cuda", row_timeout_s=p.row_timeout_s)


def load_model(job: Job, ctx: dist.DistContext, engine_factory: Callable, device: torch.device, dtype: torch.dtype,
               cfg: InternVLConfig, tokenizer: Any, pre: Preprocessor) -> LoadedModel:  # fmt: skip
    """Build the engine (`engine_factory`) and warm it up, while the preprocessing workers start."""
    prep = new_preparer(job, pre, device)  # workers warm up while the model loads
    try:
        t_load = time.perf_counter()
        engine = engine_factory(job, device, dtype, stop_token_ids(tokenizer), ctx)
        cold = getattr(engine, "cold_start", None)
        # waiting for compile helpers after the weights were in is start-up's compile time, not the load's
        helpers_s = cold.waited_s if cold is not None else 0.0
        load_s = time.perf_counter() - t_load - helpers_s
        if ctx.tp > 1 and hasattr(
            engine, "pool"
        ):  # every rank of a replica runs the same batches: the same pool
            engine.pool.limit(min(dist.all_gather_object(ctx, engine.pool.num_blocks)))
        t_warm = time.perf_counter()  # before any row flows: no preprocessing thread runs during the captures
        warm_parts = engine.warm_up() if hasattr(engine, "warm_up") else {}
        warm_s = time.perf_counter() - t_warm + helpers_s
        if helpers_s:
            warm_parts = {"compile_helpers": helpers_s} | warm_parts
        if cold is not None:
            cold.warmed()
    except BaseException:
        prep.close()
        raise
    log.info("warm-up %.1f s (%s)", warm_s, ", ".join(f"{k} {v:.1f} s" for k, v in warm_parts.items()))
    log.info("model ready in %.1f s (%s, %s, %s)", load_s, job.model.path or job.model.preset, device, dtype)
    flow = Flow(
        engine,
        pre,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        _sampling(job.generation),
        engine.max_prefill_tokens,
        job.engine.max_vit_tiles,
        job.preprocess.workers,
        job.preprocess.prefetch,
        token_id=lambda text: single_token(tokenizer, text),
        lockstep=ctx.tp > 1,
    )
    return LoadedModel(job, ctx, device, dtype, cfg, engine, flow, load_s, warm_s, warm_parts, prep)


def start_manifest(job: Job, ctx: dist.DistContext, device: torch.device, dtype: torch.dtype, cfg: InternVLConfig,
                   decision: str) -> dict:  # fmt: skip
    """This run's manifest, `running`, written to job.output.dir (rank 0) and returned."""
    out = job.output.dir
    previous = (read_manifest(out) or {}) if decision == "resume" else {}
    job_fp, model_fp = fingerprint(job_for_fingerprint(job)), model_fingerprint(job, cfg, dtype)
    manifest = {
        "job": job_to_dict(job),
        "job_fingerprint": job_fp,
        "model_fingerprint": model_fp,
        "model": {"config": config_to_dict(cfg), "dtype": str(dtype), "device": str(device)},
        "versions": versions(),
        "world_size": ctx.world_size,
        "replicas": ctx.num_replicas,
        "tp": ctx.tp,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "started_at": _now(),
        "ended_at": None,
        "status": "running",
        "decision": decision,
        "runs": previous.get("runs", []),
        "parts": previous.get("parts", {}),  # part name -> {rows, digest} once committed; checked on resume
        # this run's number (its rows' `run`), counting runs that died before recording themselves in `runs`
        "runs_started": previous.get("runs_started", len(previous.get("runs", []))) + 1,
    }
    if ctx.is_main:
        write_manifest(out, manifest)
    return manifest


def run_rows(model: LoadedModel, job: Job, rows: Iterable[dict] | None, manifest: dict | None,
             stop: StopOnSignal | None) -> Generator[dict, None, dict | None]:  # fmt: skip
    """One run of the job's rows (`rows`, or its data source) through the loaded model, yielding each row as it ends
    with every Parquet column. With `manifest` (written by `start_manifest`) the rows also go to job.output.dir and
    rank 0 returns the summary: the manifest ends `done`, or `interrupted` (finished rows written) on a signal or
    when the caller closes the generator early."""
    ctx, engine, out = model.ctx, model.engine, job.output.dir
    run_number = None if manifest is None else manifest["runs_started"] - 1
    done = done_ids(out) if manifest is not None and manifest["decision"] == "resume" else set()
    writer = None
    if manifest is not None and ctx.is_writer:
        fps = _fingerprints(manifest["job_fingerprint"], manifest["model_fingerprint"])
        writer = PartWriter(out, ctx.rank, job.output.rows_per_part, fingerprints=fps)
    counters_before = dict(getattr(engine, "counters", {}))
    vit_stats = getattr(getattr(engine, "encode_fn", None), "stats", None)
    vit_before = vit_stats.total_compile_s if vit_stats is not None else 0.0
    step = getattr(engine, "decode_step", None)
    capture_before = getattr(step, "capture_s", 0.0)
    prep, load_s, warm_s = model.start_run()
    t0, loop, beat = None, None, None
    stop_event = stop.event if stop is not None else None
    try:
        total = count_rows(job.data, rows)
        shard_total = None if total is None else -(-total // ctx.num_replicas)
        prep.wait_warm()
        dist.barrier(ctx, "at the start")
        beat = dist.Heartbeat(ctx)  # from here a rank that waits for the others tells slow from stalled
        t0 = time.perf_counter()
        if stop is not None:
            stop.rows_flowing = True
        desc = "rows" if ctx.num_replicas == 1 else f"rows (replica 0 of {ctx.num_replicas})"
        with (
            profiled(model.device, ctx.rank),
            tqdm(
                total=shard_total, desc=desc, unit="row", disable=not ctx.is_main, dynamic_ncols=True
            ) as bar,
        ):
            loop = RowLoop(model.flow, write_rows(writer, run_number), t0, bar, stop_event)
            written = loop.rows(iter_rows(job.data, ctx.replica, ctx.num_replicas, rows), done, prep)
            try:
                for row in written:
                    yield schema_row(row | {"rank": ctx.rank, "run": run_number})
            finally:
                written.close()  # on an early close too: nothing stays in flight, the workers stop
        if writer is not None:
            writer.close()  # on a stop too: every finished row reaches disk
        counts, duration = loop.counts, time.perf_counter() - t0
    except BaseException as e:
        if isinstance(e, (GeneratorExit, KeyboardInterrupt)) and writer is not None:
            writer.close()  # the caller stopped early (or Ctrl-C in a notebook): its finished rows are on disk
        if manifest is not None:
            if writer is not None:
                manifest["parts"] = manifest["parts"] | writer.committed
            ran = [] if loop is None else [loop.counts]
            duration = 0.0 if t0 is None else time.perf_counter() - t0
            _mark_stopped(ctx, manifest, _this_run(manifest, ctx, duration, load_s, warm_s, ran), e)
        raise
    finally:
        prep.close()
        if beat is not None:
            beat.stop()  # this rank's rows are over, however they ended (finish() tells the others)
    log.info("rank done in %.1f s: %s", duration, counts)
    parts = writer.committed if writer is not None else {}
    # no collectives on a stop: the other ranks may not have been signalled
    if stop_event is not None and stop_event.is_set():
        stopped = Interrupted(stop.signum)
        if manifest is not None:
            manifest["parts"] = manifest["parts"] | parts  # (other ranks' parts are recorded on resume)
            _mark_stopped(
                ctx, manifest, _this_run(manifest, ctx, duration, load_s, warm_s, [counts]), stopped
            )
        raise stopped
    if manifest is None:
        return None
    if vit_stats is not None:  # compiles the warm-up did not foresee (e.g. a TP ViT's micro-batch sizes)
        counts = counts | {
            "vit_compile": vit_stats.summary(),
            "vit_compile_s": vit_stats.total_compile_s - vit_before,
        }
        log.info("%s", counts["vit_compile"])
    # cache hits, decode steps and their rows: this run's
    counts = counts | {k: v - counters_before.get(k, 0) for k, v in getattr(engine, "counters", {}).items()}
    counts["warm_up_parts_s"] = model.warm_parts if warm_s else {}  # this rank's, where this run warmed up
    from batchvl.model.build import compile_cache_counts

    counts |= compile_cache_counts()  # the process's, the load's and warm-up's included: was the cache warm?
    if counts["graph_breaks"]:
        log.warning("torch.compile broke %d graphs: parts of the model ran eagerly (slower); TORCH_LOGS=graph_breaks "
                    "says where", counts["graph_breaks"])  # fmt: skip
    if model.device.type == "cuda":
        counts["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(model.device) / 2**30
        # what the allocator held at most (allocated + its cache): the margin the KV pool's sizing left
        counts["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved(model.device) / 2**30
        counts["gpu_memory_gib"] = torch.cuda.get_device_properties(model.device).total_memory / 2**30
    if step is not None:  # CUDA graphs of the decode step: how many shapes were captured, or why they are off
        counts = counts | {"decode_graphs_captured": step.captures, "decode_graphs_failed": step.failed}
        # buckets the warm-up left to the first steps that needed them: start-up work on the job's clock
        counts["decode_capture_s"] = getattr(step, "capture_s", 0.0) - capture_before
    try:
        beat.finish()
        all_counts, all_parts = zip(*dist.all_gather_object(ctx, (counts, parts)), strict=True)
        dist.barrier(ctx)
    except BaseException as e:  # a stalled rank: rank 0, when it is the one that noticed, records why
        run = _this_run(manifest, ctx, duration, load_s, warm_s, [counts])
        _mark_stopped(ctx, manifest | {"parts": manifest["parts"] | parts}, run, e)
        raise
    if not ctx.is_main:
        return None
    runs = manifest["runs"] + [_this_run(manifest, ctx, duration, load_s, warm_s, list(all_counts))]
    parts = manifest["parts"] | {name: rec for ps in all_parts for name, rec in ps.items()}
    final = manifest | {"ended_at": runs[-1]["ended_at"], "status": "done", "runs": runs, "parts": parts}
    summary = run_summary(out, final)
    write_summary(out, summary)
    write_manifest(out, final)
    return summary


def _this_run(manifest: dict, ctx: dist.DistContext, duration: float, load_s: float, warm_s: float,
              counts: list) -> dict:  # fmt: skip
    """This run's entry in the manifest's `runs`."""
    return {
        "run": manifest["runs_started"] - 1,  # its rows' `run`
        "started_at": manifest["started_at"],
        "ended_at": _now(),
        "duration_s": duration,
        "load_s": load_s,
        "warm_up_s": warm_s,
        "world_size": ctx.world_size,
        "counts": counts,
    }


def _mark_stopped(ctx: dist.DistContext, manifest: dict, run: dict, error: BaseException) -> None:
    """Rank 0: the manifest says `interrupted` (a signal, Ctrl-C, or the caller closed the rows early) or `failed`
    with `error` as its reason, with this run's time (its finished rows are on disk either way)."""
    if not ctx.is_main:
        return
    final = manifest | {"ended_at": run["ended_at"]}
    if isinstance(error, (Interrupted, KeyboardInterrupt, GeneratorExit)):
        final |= {"status": "interrupted", "runs": manifest["runs"] + [run | {"interrupted": True}]}
    else:
        reason = f"{type(error).__name__}: {error}"
        final |= {"status": "failed", "error": reason, "runs": manifest["runs"] + [run | {"error": reason}]}
    write_manifest(manifest["job"]["output"]["dir"], final)


def _sampling(g: Any) -> Any:
    from batchvl.engine import Sampling

    return Sampling(g.max_new_tokens, g.temperature, g.top_p, g.seed, g.ignore_eos, tuple(g.stop_token_ids))


def setup_logging(ctx_rank: int, world: int) -> None:
    logging.basicConfig(
        level=os.environ.get("BATCHVL_LOG_LEVEL", "INFO").upper(),  # DEBUG: each admission and decode step
        format=f"%(asctime)s [rank {ctx_rank}/{world}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run_file(job_file: str, sets: tuple[str, ...] = (), overwrite: bool = False) -> dict | None:
    """Load, validate and run a job file on this rank (joins torchrun's process group when there is one)."""
    rank, world, _ = dist.env_ranks()
    setup_logging(rank, world)
    try:
        job = load_job(job_file, sets, **({"output.overwrite": True} if overwrite else {}))
    except JobError as e:
        raise click.ClickException(str(e)) from None
    try:
        device = "cuda" if job.model.device != "cpu" and torch.cuda.is_available() else "cpu"
        ctx = dist.init(job.model.tp, device, job.dist.timeout_s)
    except ValueError as e:
        raise click.ClickException(f"job.model.tp: {e}") from None
    try:
        return run_job(job, ctx)
    except (JobError, ResumeError, FileNotFoundError, MemoryError, dist.RankStalled) as e:
        raise click.ClickException(str(e)) from None
    except Interrupted as e:
        click.echo(
            f"{e}: finished rows are in {job.output.dir}; run the same command again to resume", err=True
        )
        raise SystemExit(128 + e.signum) from None
    finally:
        dist.shutdown(ctx)


_JOB_ARG = click.argument("job_file", type=click.Path(exists=True, dir_okay=False))
_SET_OPT = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a job key, e.g. --set output.dir=runs/x (YAML scalar rules).",
)
_OVERWRITE_OPT = click.option("--overwrite", is_flag=True, help="Delete earlier results in output.dir first.")


@click.command("run")
@_JOB_ARG
@_SET_OPT
@_OVERWRITE_OPT
def main(job_file: str, sets: tuple[str, ...], overwrite: bool) -> None:
    """Run the batch inference job JOB_FILE (re-running the same command resumes)."""
    run_file(job_file, sets, overwrite)


class _Commands(click.Group):
    """The commands; arguments that start with no command name run a job (`python -m batchvl.runner JOB.yaml`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "--version"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_Commands)
@click.version_option(package_name="batchvl", message="batchvl %(version)s")
def cli() -> None:
    """batchvl: batch offline inference for InternVL2.5. `JOB_FILE` alone means `run JOB_FILE`."""


cli.add_command(main)  # `batchvl run JOB_FILE` is `python -m batchvl.runner JOB_FILE`


cli.add_command(report_cmd)  # `batchvl report RUN_DIR`, also `python -m batchvl.report RUN_DIR`


if __name__ == "__main__":
    cli(prog_name="python -m batchvl.runner")
