"""Parquet output: row schema, atomic part writer, manifest/resume checks and the benchmark summary.

A run dir holds the parts (`part-<rank>-<chunk>.parquet`) and batchvl's other files, all named with a leading `_`
(`_manifest.json`, `_summary.json`, `_summary.txt`, `_report/`) so that Parquet readers given the dir skip them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq


def _f(name: str, typ: pa.DataType, role: str | None = None) -> pa.Field:
    """A nullable field, tagged with a role ("stage", "latency", "timestamp") in its metadata."""
    return pa.field(name, typ, metadata={"role": role} if role else None)


ROW_SCHEMA: pa.Schema = pa.schema(
    [
        _f("id", pa.string()),
        _f("rank", pa.int32()),
        _f("batch_id", pa.int64()),
        _f("run", pa.int32()),  # the run of the output dir that wrote the row: 0, then one more per resume
        _f("prompt_token_ids", pa.list_(pa.int32())),
        _f("num_tiles", pa.int32()),
        _f("num_image_tokens", pa.int32()),
        _f("num_text_tokens", pa.int32()),
        _f("output_token_ids", pa.list_(pa.int32())),
        _f("output_text", pa.string()),
        _f("finish_reason", pa.string()),  # "stop" (EOS or a stop token) or "length" (its max_new_tokens)
        _f("error", pa.string()),
        _f("cache_hit_image", pa.bool_()),
        _f("cached_prefix_tokens", pa.int32()),
        _f("queue_ms", pa.float64(), "stage"),
        _f("preprocess_ms", pa.float64(), "stage"),
        _f("batch_wait_ms", pa.float64(), "stage"),
        _f("vit_ms", pa.float64(), "stage"),
        _f("prefill_ms", pa.float64(), "stage"),
        _f("decode_ms", pa.float64(), "stage"),
        # the GPU's wait for this batch: previous batch's end (or the job start) to this batch's start, per batch
        _f("input_wait_ms", pa.float64()),
        _f("ttft_ms", pa.float64(), "latency"),
        _f("e2e_ms", pa.float64(), "latency"),
        _f("tpot_ms", pa.float64(), "latency"),
        _f("t_read_s", pa.float64(), "timestamp"),
        _f("t_prepared_s", pa.float64(), "timestamp"),
        _f("t_batch_start_s", pa.float64(), "timestamp"),
        _f("t_first_token_s", pa.float64(), "timestamp"),
        _f("t_done_s", pa.float64(), "timestamp"),
    ]
)


def columns_with_role(role: str) -> tuple[str, ...]:
    """Names of ROW_SCHEMA columns tagged with `role`, in schema order."""
    return tuple(f.name for f in ROW_SCHEMA if (f.metadata or {}).get(b"role") == role.encode())


def schema_row(row: dict) -> dict:
    """`row` with exactly ROW_SCHEMA's columns, in its order (a missing one is None): a row as Parquet holds it."""
    return {name: row.get(name) for name in ROW_SCHEMA.names}


STAGE_COLUMNS: tuple[str, ...] = columns_with_role("stage")
MANIFEST_NAME = "_manifest.json"
SUMMARY_JSON, SUMMARY_TXT, REPORT_DIR = "_summary.json", "_summary.txt", "_report"
SUMMARY_NAMES = (SUMMARY_JSON, SUMMARY_TXT)
# names of an older batchvl, which readers of the dir as a Parquet dataset tripped over; upgrade_layout moves them
_LEGACY = {"manifest.json": MANIFEST_NAME, "summary.json": SUMMARY_JSON, "summary.txt": SUMMARY_TXT,
           "report": REPORT_DIR}  # fmt: skip
LOCK_NAME = ".batchvl.lock"
QUARANTINE_DIR = "_quarantine"  # a leading underscore: Parquet dataset readers (pyarrow, pandas) skip it
PART_RECORD = (
    b"batchvl"  # a part's key-value metadata: JSON of its job's fingerprints, row count, content digest
)
_PART_RE = re.compile(r"^part-(\d{5,})-(\d{6,})\.parquet$")
_TEMP_RE = re.compile(r"^\..+\.\d+\.tmp$")  # left by `_atomic_write` when a process died mid-write
log = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    """The output dir holds a different job's results (or results that cannot be verified)."""


def _part_files(out_dir: str | Path, rank: int | None = None) -> list[Path]:
    """Finished part files in `out_dir` (of one rank if given), sorted by (rank, chunk)."""
    d = Path(out_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _PART_RE.match(p.name)
        if m and (rank is None or int(m.group(1)) == rank):
            found.append((int(m.group(1)), int(m.group(2)), p))
    return [p for _, _, p in sorted(found)]


def _fsync_dir(d: Path) -> None:
    """Best-effort fsync of a directory so a rename survives a crash."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(fileobj)` on a hidden temp file next to `path`, fsync it, then os.replace onto `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class PartWriter:
    """Buffers row dicts and writes them as atomic Parquet parts `part-<rank:05d>-<chunk:06d>.parquet`."""

    def __init__(
        self,
        out_dir: str | Path,
        rank: int,
        rows_per_part: int = 1000,
        start_chunk: int | None = None,
        fingerprints: dict[str, str] | None = None,  # stored in every part, checked on resume
    ) -> None:
        if rows_per_part < 1:
            raise ValueError(f"rows_per_part must be >= 1, got {rows_per_part}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.rows_per_part = rows_per_part
        for stale in self.out_dir.glob(f".part-{rank:05d}-*.tmp"):  # left by a crash mid-write
            stale.unlink(missing_ok=True)
        if start_chunk is None:
            parts = _part_files(self.out_dir, rank)
            start_chunk = int(_PART_RE.match(parts[-1].name).group(2)) + 1 if parts else 0
        self.chunk = start_chunk
        self.fingerprints = dict(fingerprints or {})
        self.committed: dict[str, dict] = {}  # part name -> {rows, digest}, for the manifest's record
        self._rows: list[dict] = []
        self._closed = False

    def add(self, row: dict) -> None:
        """Buffer one row (missing keys become null, `rank` defaults to the writer's); write a part when full."""
        if self._closed:
            raise RuntimeError("PartWriter is closed")
        unknown = row.keys() - set(ROW_SCHEMA.names)
        if unknown:
            raise ValueError(f"row has columns not in ROW_SCHEMA: {sorted(unknown)}")
        if not isinstance(row.get("id"), str):
            raise ValueError(f"row needs a string 'id', got {row.get('id')!r}")
        self._rows.append({"rank": self.rank, **row})
        if len(self._rows) >= self.rows_per_part:
            self.flush()

    def flush(self) -> Path | None:
        """Write the buffered rows as the next part (atomically); return its path, or None if nothing was buffered."""
        if not self._rows:
            return None
        table = pa.Table.from_pylist(self._rows, schema=ROW_SCHEMA)
        record = {**self.fingerprints, "rows": table.num_rows, "digest": content_digest(table)}
        table = table.replace_schema_metadata({PART_RECORD: json.dumps(record, sort_keys=True)})
        path = self.out_dir / f"part-{self.rank:05d}-{self.chunk:06d}.parquet"
        _atomic_write(path, lambda f: pq.write_table(table, f))
        self.committed[path.name] = {"rows": record["rows"], "digest": record["digest"]}
        self._rows = []
        self.chunk += 1
        return path

    def close(self) -> None:
        """Flush what is left; further add() calls raise."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def content_digest(table: pa.Table) -> str:
    """sha256 of a table's values (not of its encoding), column by column: nulls, list lengths, then the values."""
    h = hashlib.sha256()
    for name in table.column_names:
        arr = table.column(name).combine_chunks()
        h.update(name.encode() + b"\0" + pc.is_valid(arr).to_numpy(zero_copy_only=False).tobytes())
        if pa.types.is_list(arr.type):
            h.update(pc.list_value_length(arr).fill_null(0).to_numpy().tobytes())
            arr = pc.list_flatten(arr)
        if pa.types.is_string(arr.type):
            h.update(pc.binary_length(arr).fill_null(0).to_numpy().tobytes())
            raw = arr.fill_null("").cast(pa.binary())  # (bytes: a corrupt part may hold invalid UTF-8)
            joined = pa.ListArray.from_arrays(pa.array([0, len(raw)], pa.int32()), raw)
            h.update(pc.binary_join(joined, b"")[0].as_py() or b"")
        else:
            zero = pa.scalar(False if pa.types.is_boolean(arr.type) else 0, arr.type)
            h.update(arr.fill_null(zero).to_numpy(zero_copy_only=False).tobytes())
    return h.hexdigest()


def _part_record(path: Path) -> dict | None:
    """The record a part carries in its key-value metadata (fingerprints, rows, digest), or None."""
    raw = (pq.read_schema(path).metadata or {}).get(PART_RECORD)
    return None if raw is None else json.loads(raw)


def part_problem(path: Path, fingerprints: dict[str, str], recorded: dict | None = None) -> str | None:
    """Why a part file cannot count as this job's results (unreadable, another job's, altered), or None.
    `recorded`: the manifest's {rows, digest} of the part, written when it was committed."""
    try:
        record = _part_record(path)
        if record is None:
            return "has no batchvl record (written by another program or an older batchvl)"
        for key, want in fingerprints.items():
            if record.get(key) != want:
                return f"belongs to another job ({key} {record.get(key)!r}, this job's is {want!r})"
        table = pq.read_table(path)
        if not table.schema.equals(ROW_SCHEMA, check_metadata=False):
            return "does not have batchvl's columns"
        digest = content_digest(table)
        if table.num_rows != record.get("rows") or digest != record.get("digest"):
            return "does not match its own row count and checksum (altered or corrupt)"
        if recorded is not None and [recorded.get("rows"), recorded.get("digest")] != [
            table.num_rows,
            digest,
        ]:
            return "does not match the manifest's record of it (replaced or rewritten since it was committed)"
    except Exception as e:  # noqa: BLE001 - any failure to read it is the finding
        return f"is unreadable ({type(e).__name__}: {e})"
    return None


def quarantine_bad_parts(out_dir: str | Path, fingerprints: dict[str, str]) -> list[str]:
    """Move every part that `part_problem` refuses, given the manifest's record of it (and stale temp files), out of
    the run, into _quarantine/; their ids then run again. The manifest's `parts` then records exactly the parts that
    stay (a part a crashed run committed but did not record is taken in). Returns one line per moved part."""
    d = Path(out_dir)
    moved = []
    manifest = read_manifest(d)
    recorded = (manifest or {}).get("parts") or {}
    verified = {}
    for p in d.iterdir() if d.is_dir() else ():
        if _TEMP_RE.match(p.name):
            p.unlink(missing_ok=True)
    for p in _part_files(d):
        why = part_problem(p, fingerprints, recorded.get(p.name))
        if why is None:
            own = _part_record(p)
            verified[p.name] = recorded.get(p.name) or {"rows": own["rows"], "digest": own["digest"]}
            continue
        q = d / QUARANTINE_DIR
        q.mkdir(exist_ok=True)
        dest = q / p.name
        n = 1
        while dest.exists():
            dest, n = q / f"{p.name}.{n}", n + 1
        os.replace(p, dest)
        moved.append(f"{p.name} {why}; moved to {dest.relative_to(d)}, its rows run again")
        log.warning("%s", moved[-1])
    if manifest is not None and recorded != verified:  # (a new part may take the name of one gone)
        write_manifest(d, manifest | {"parts": verified})
    return moved


class RunLock:
    """An exclusive flock on <dir>/.batchvl.lock, the file holding its owner's pid and host: a second run on the dir
    is refused. The kernel drops the lock when its process dies (even on SIGKILL), so a dead run's lock is taken
    over."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 256).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise ResumeError(
                f"{self.path.parent} is in use by another batchvl run ({holder}); wait for it to end or use "
                "another output dir"
            ) from None
        earlier = os.read(fd, 256).decode(errors="replace").strip()
        if earlier:
            log.warning("taking over the lock of a run that ended without releasing it (%s)", earlier)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty lock file: released cleanly
            os.close(self.fd)
            self.fd = None


def read_rows(out_dir: str | Path) -> pa.Table:
    """All rows of all finished part files (temp files ignored), as a ROW_SCHEMA table."""
    files = _part_files(out_dir)
    if not files:
        return ROW_SCHEMA.empty_table()
    return ds.dataset([str(p) for p in files], schema=ROW_SCHEMA, format="parquet").to_table()


def done_ids(out_dir: str | Path, rank: int | None = None) -> set[str]:
    """Ids already written (ok or error rows) by all ranks, or by one rank's part files."""
    files = _part_files(out_dir, rank)
    if not files:
        return set()
    ids = ds.dataset([str(p) for p in files], schema=ROW_SCHEMA, format="parquet").to_table(columns=["id"])
    return set(ids.column("id").to_pylist())


def write_manifest(out_dir: str | Path, manifest: dict) -> None:
    """Write _manifest.json atomically (call again to update, e.g. ended_at)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    data = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
    _atomic_write(d / MANIFEST_NAME, lambda f: f.write(data))


def read_manifest(out_dir: str | Path) -> dict | None:
    """The _manifest.json dict, or None if there is none; ResumeError if it is not a batchvl manifest."""
    p = Path(out_dir) / MANIFEST_NAME
    if not p.is_file():
        return None
    try:
        manifest = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ResumeError(
            f"{p} is not a batchvl manifest (unreadable: {e}); move it away or use another output dir"
        ) from None
    if not isinstance(manifest, dict) or "job_fingerprint" not in manifest:
        raise ResumeError(
            f"{p} was not written by batchvl; batchvl will not replace it: use another output dir"
        )
    return manifest


def fingerprint(obj: Any) -> str:
    """Short sha256 hex (16 chars) of the canonical JSON (sorted keys, no spaces) of `obj`."""
    canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def upgrade_layout(out_dir: str | Path) -> None:
    """Rename an older batchvl's manifest.json, summary.* and report/ to this layout's names (only in a dir whose
    manifest.json is batchvl's)."""
    d = Path(out_dir)
    old = d / "manifest.json"
    if (d / MANIFEST_NAME).exists() or not old.is_file():
        return
    try:
        ours = "job_fingerprint" in json.loads(old.read_text())
    except (ValueError, OSError):
        ours = False
    if ours:
        for name, new in _LEGACY.items():
            if (d / name).exists() and not (d / new).exists():
                os.replace(d / name, d / new)


def _flat(d: Any, prefix: str) -> dict[str, Any]:
    """{"a.b.c": leaf} of nested dicts."""
    if not isinstance(d, dict):
        return {prefix: d}
    return {k: v for key, sub in d.items() for k, v in _flat(sub, f"{prefix}.{key}").items()}


def changed_keys(old: dict, new: dict, prefix: str) -> list[str]:
    """'key: old -> new' for each dotted key whose value differs (keys of `new` only: what fingerprints cover)."""
    a, b = _flat(old, prefix), _flat(new, prefix)
    return [f"{k}: {a.get(k)!r} -> {v!r}" for k, v in b.items() if a.get(k) != v]


def check_output_dir(out_dir: str | Path, overwrite: bool) -> None:
    """Refuse an output dir that is / or the home directory, or that is not a batchvl run (no batchvl manifest) and
    holds a manifest or summary batchvl did not write, or (unless overwrite) anything else batchvl did not write."""
    d = Path(out_dir)
    if d.resolve() in (Path("/"), Path.home().resolve()):
        raise ResumeError(f"output.dir {d} is / or the home directory; give the run a directory of its own")
    if not d.is_dir():
        return
    if read_manifest(d) is not None:  # a batchvl run (raises for a manifest.json that is not batchvl's)
        return
    if any((d / n).exists() for n in SUMMARY_NAMES):
        raise ResumeError(f"{d} holds {' or '.join(SUMMARY_NAMES)} but no batchvl manifest; batchvl will not "
                          "replace them: use another output dir")  # fmt: skip
    foreign = sorted(
        p.name for p in d.iterdir() if not (_ours(p.name) or p.name.startswith("."))
    )  # (.DS_Store)
    if not foreign:
        return
    named = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    if not overwrite:
        raise ResumeError(f"{d} is not empty and not a batchvl run (it holds {named}); use an empty or new output "
                          "dir, or pass --overwrite to write there anyway (files batchvl did not write are kept)")  # fmt: skip
    log.warning("%s holds files batchvl did not write (%s); they are kept", d, named)


def _ours(name: str) -> bool:
    """Whether batchvl writes files of this name outside a finished manifest (parts, temp files, lock, quarantine)."""
    return bool(_PART_RE.match(name) or _TEMP_RE.match(name)) or name in (LOCK_NAME, QUARANTINE_DIR)


def check_resume(
    out_dir: str | Path,
    job_fp: str,
    model_fp: str,
    overwrite: bool,
    job: dict | None = None,
    model: dict | None = None,
) -> str:
    """Decide "fresh" | "resume" | "overwrite" for `out_dir`; raise ResumeError for another job's results (naming
    the keys that differ: `job`, `model` are what the fingerprints hash) or a dir that is not a run's."""
    d = Path(out_dir)
    upgrade_layout(d)
    # again after the runner's check before its lock: a direct caller's overwrite must be refused here too
    check_output_dir(d, overwrite)
    manifest = read_manifest(d)
    parts = _part_files(d)
    if manifest is None and not parts:
        return "fresh"  # (check_output_dir refused a dir of others' files)
    if overwrite:
        stale = [*parts, *(p for p in d.iterdir() if _TEMP_RE.match(p.name)), d / MANIFEST_NAME]
        for p in stale + [d / n for n in SUMMARY_NAMES]:
            p.unlink(missing_ok=True)
        for png in ("stages.png", "throughput.png", "timeline.png"):
            (d / REPORT_DIR / png).unlink(missing_ok=True)
        shutil.rmtree(d / QUARANTINE_DIR, ignore_errors=True)
        return "overwrite"
    if manifest is None:
        raise ResumeError(
            f"{d} has {len(parts)} part file(s) but no {MANIFEST_NAME}, so they cannot be matched to this job; "
            "pass --overwrite to delete them, or use another output dir"
        )
    diffs = []
    if manifest.get("job_fingerprint") != job_fp:
        diffs += changed_keys(manifest.get("job") or {}, job, "job") if job is not None else []
        diffs = diffs or [f"job fingerprint {manifest.get('job_fingerprint')} -> {job_fp}"]
    if manifest.get("model_fingerprint") != model_fp:
        found = changed_keys(manifest.get("model") or {}, model, "model") if model is not None else []
        diffs += found or [f"model fingerprint {manifest.get('model_fingerprint')} -> {model_fp}"]
    if diffs:
        raise ResumeError(
            f"{d} holds results of a different job; changed since: {'; '.join(diffs)}. Pass --overwrite to "
            "delete those results, or use another output.dir"
        )
    return "resume"


def describe(values: Iterable[float | None]) -> dict[str, float | None]:
    """Mean, median and P99 (numpy linear interpolation) of the non-null values; None when there are none."""
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def _col(table: pa.Table, name: str) -> pa.ChunkedArray:
    """Column `name`, or all nulls of its ROW_SCHEMA type if the table lacks it."""
    if name in table.column_names:
        return table.column(name)
    return pa.chunked_array([pa.nulls(table.num_rows, ROW_SCHEMA.field(name).type)])


def _sum(arr: pa.ChunkedArray | pa.Array) -> int:
    """Integer sum with nulls as 0."""
    return int(pc.sum(arr).as_py() or 0)


def summarize(table: pa.Table, duration_s: float | None = None) -> dict:
    """benchmark_serving-style figures (all requests submitted at t=0); failed rows only counted as failed."""
    failed = pc.is_valid(_col(table, "error"))
    ok = table.filter(pc.invert(failed))
    if duration_s is None:
        duration_s = pc.max(_col(table, "t_done_s")).as_py()
    text_tokens = _sum(_col(ok, "num_text_tokens"))
    image_tokens = _sum(_col(ok, "num_image_tokens"))
    input_tokens = text_tokens + image_tokens
    output_tokens = _sum(pc.list_value_length(_col(ok, "output_token_ids")))

    def rate(n: int) -> float | None:
        return n / duration_s if duration_s else None

    s: dict[str, Any] = {
        "successful_requests": ok.num_rows,
        "failed_requests": table.num_rows - ok.num_rows,
        "benchmark_duration_s": None if duration_s is None else float(duration_s),
        "total_input_tokens": input_tokens,
        "total_input_text_tokens": text_tokens,
        "total_input_image_tokens": image_tokens,
        "total_generated_tokens": output_tokens,
        "request_throughput": rate(ok.num_rows),
        "input_token_throughput": rate(input_tokens),
        "output_token_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
    }
    for metric in ("e2e", "ttft", "tpot"):
        for stat, value in describe(_col(ok, f"{metric}_ms").to_pylist()).items():
            s[f"{stat}_{metric}_ms"] = value
    hits = _col(ok, "cache_hit_image")
    if hits.null_count < len(hits):
        s["image_cache_hits"] = _sum(pc.cast(hits, pa.int64()))
    prefix = _col(ok, "cached_prefix_tokens")
    if prefix.null_count < len(prefix):
        s["cached_prefix_tokens"] = _sum(prefix)
    valid = pc.is_valid(_col(table, "input_wait_ms"))
    waits = pa.table({c: _col(table, c) for c in ("run", "rank", "batch_id", "input_wait_ms")}).filter(valid)
    if waits.num_rows:  # one value per (run, rank, batch): each run numbers its batches from 0
        per_batch = {(r["run"], r["rank"], r["batch_id"]): r["input_wait_ms"] for r in waits.to_pylist()}
        s["gpu_input_wait_s"] = sum(per_batch.values()) / 1e3
    return s


# how each start came by its compiled graphs (`build.compile_cache_counts`)
GRAPH_COUNTS = (
    "precompiled_loaded",
    "compile_cache_hits",
    "compile_cache_misses",
    "dynamo_graphs",
    "graph_breaks",
)


def startup(run: dict) -> dict:
    """A run's start-up seconds (model ready, decode graphs, the ViT's compiles and decode captures during the job)
    and the mean number of sequences each decode step carried."""
    counts = run.get("counts") or []
    steps = sum(c.get("decode_steps", 0) for c in counts)
    out = {"load_s": run.get("load_s"), "warm_up_s": run.get("warm_up_s", 0.0),
           "vit_compile_s": max((c.get("vit_compile_s", 0.0) for c in counts), default=0.0),
           "decode_capture_s": max((c.get("decode_capture_s", 0.0) for c in counts), default=0.0)}  # fmt: skip
    if steps:
        out["mean_active_rows"] = sum(c.get("decode_rows", 0) for c in counts) / steps
    for k in GRAPH_COUNTS:
        if any(k in c for c in counts):
            out[k] = sum(c.get(k, 0) for c in counts)
    return out


def run_durations(table: pa.Table, runs: list[dict]) -> dict[int, float]:
    """Each run's active seconds by run number: the manifest's for runs that ended, else the last t_done_s of the
    rows it wrote (a run that died)."""
    out = {
        r.get("run", i): float(r["duration_s"]) for i, r in enumerate(runs) if r.get("duration_s") is not None
    }
    numbers = pc.fill_null(_col(table, "run"), 0)  # rows of an older batchvl carry no run number
    for k in pc.unique(numbers).to_pylist():
        if k not in out:
            last = pc.max(_col(table.filter(pc.equal(numbers, k)), "t_done_s")).as_py()
            out[k] = float(last or 0.0)
    return dict(sorted(out.items()))


def run_summary(out_dir: str | Path, manifest: dict | None = None) -> dict:
    """The summary of a run dir over all its runs, each counted for its own time: what _summary.json holds and what
    the report prints (one function, so they agree). `manifest`: the one about to be written, else the dir's."""
    manifest = manifest if manifest is not None else read_manifest(out_dir) or {}
    table = read_rows(out_dir)
    runs = manifest.get("runs") or []
    durations = run_durations(table, runs)
    s = summarize(table, sum(durations.values()) if durations else None)
    if runs:
        s |= startup(runs[-1])
    if len(durations) > 1:
        numbers = pc.fill_null(_col(table, "run"), 0)
        s["runs"] = []
        for k, dur in durations.items():
            mine = table.filter(pc.equal(numbers, k))
            failed = int(pc.sum(pc.is_valid(_col(mine, "error"))).as_py() or 0)
            ok = mine.num_rows - failed
            s["runs"].append({"run": k, "rows": mine.num_rows, "failed": failed, "duration_s": dur,
                              "request_throughput": ok / dur if dur else None})  # fmt: skip
    return s


_STATS = (("mean", "Mean"), ("median", "Median"), ("p99", "P99"))
_LAYOUT: dict[str | None, list[tuple[str, str]]] = {
    None: [
        ("successful_requests", "Successful requests:"),
        ("failed_requests", "Failed requests:"),
        ("benchmark_duration_s", "Benchmark duration (s):"),
        ("total_input_tokens", "Total input tokens:"),
        ("total_input_text_tokens", "  of which text tokens:"),
        ("total_input_image_tokens", "  of which image tokens:"),
        ("total_generated_tokens", "Total generated tokens:"),
        ("request_throughput", "Request throughput (req/s):"),
        ("input_token_throughput", "Input token throughput (tok/s):"),
        ("output_token_throughput", "Output token throughput (tok/s):"),
        ("total_token_throughput", "Total Token throughput (tok/s):"),
    ],
    "End-to-end Latency": [(f"{s}_e2e_ms", f"{n} E2EL (ms):") for s, n in _STATS],
    "Time to First Token": [(f"{s}_ttft_ms", f"{n} TTFT (ms):") for s, n in _STATS],
    "Time per Output Token (excl. 1st token)": [(f"{s}_tpot_ms", f"{n} TPOT (ms):") for s, n in _STATS],
    "Cache": [("image_cache_hits", "Image cache hits:"), ("cached_prefix_tokens", "Cached prefix tokens:")],
    "Engine": [
        ("gpu_input_wait_s", "Idle waiting for input (s, all ranks):"),
        ("mean_active_rows", "Mean active rows per decode step:"),
        ("load_s", "Model load (s, last run):"),
        ("warm_up_s", "Warm-up (s, last run):"),
        ("vit_compile_s", "ViT compile during the job (s):"),
        ("decode_capture_s", "Decode graphs captured during the job (s):"),
        ("precompiled_loaded", "Graphs loaded precompiled (all ranks):"),
        ("compile_cache_hits", "Compiled graphs from the cache (all ranks):"),
        ("compile_cache_misses", "Compiled graphs compiled anew (all ranks):"),
        ("dynamo_graphs", "Graphs traced by Dynamo (all ranks):"),
        ("graph_breaks", "Graph breaks (all ranks):"),
    ],
}


def _fmt(v: Any) -> str:
    """Ints as-is, floats with 2 decimals, None as n/a."""
    if v is None:
        return "n/a"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def format_summary(summary: dict) -> str:
    """Fixed-width text table in the style of vLLM's benchmark_serving (keys absent from `summary` skipped)."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    for section, entries in _LAYOUT.items():
        present = [(key, label) for key, label in entries if key in summary]
        if section and present:
            lines.append("{s:{c}^50}".format(s=section, c="-"))
        lines += [f"{label:<40} {_fmt(summary[key]):<10}".rstrip() for key, label in present]
    if summary.get("runs"):  # a resumed dir: the duration above is the sum of these
        lines.append("{s:{c}^50}".format(s="Runs (each on its own clock)", c="-"))
        for r in summary["runs"]:
            label = f"Run {r['run']} (rows, s, req/s):"
            lines.append(
                f"{label:<40} {r['rows']} in {_fmt(r['duration_s'])}, {_fmt(r['request_throughput'])}"
            )
    lines.append("=" * 50)
    return "\n".join(lines)


def write_summary(out_dir: str | Path, summary: dict) -> None:
    """Write _summary.json and _summary.txt (both atomically)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    data = json.dumps(summary, indent=2).encode()
    text = (format_summary(summary) + "\n").encode()
    _atomic_write(d / SUMMARY_JSON, lambda f: f.write(data))
    _atomic_write(d / SUMMARY_TXT, lambda f: f.write(text))
