"""Row sources (jsonl, sharegpt, parquet, imagefolder, hf, demo) and sharding across replicas.

Rows are sharded by a hash of their id, so all occurrences of an id land on one replica and duplicates are found
there. `limit` applies to the whole job's stream, before sharding.
"""

from __future__ import annotations

import difflib
import glob
import json
import logging
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchvl.job import DataSpec, JobError

log = logging.getLogger(__name__)
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
CAPTION_PROMPT = "Describe this image in detail."
HUMAN_ROLES = ("human", "user")


@dataclass
class SourceRow:
    """One input row; `index` is its position in the job's stream, `error` set for rows that cannot run."""

    index: int
    id: str
    prompt: str | None
    image: Any = None  # absolute path, bytes, PIL image, a list of them (several images), or None
    error: str | None = None
    generation: dict | None = (
        None  # the row's own max_new_tokens / temperature / stop, as the source gave them
    )


def shard_of(row_id: str, num_shards: int) -> int:
    """The replica that owns `row_id` (stable across runs and machines)."""
    return zlib.crc32(row_id.encode("utf-8")) % num_shards if num_shards > 1 else 0


def iter_rows(
    spec: DataSpec, shard: int = 0, num_shards: int = 1, rows: Iterable[dict] | None = None
) -> Iterator[SourceRow]:
    """This shard's rows in stream order; repeated ids after the first become error rows. `rows`: the records of
    format 'rows' (dicts with the source's fields; images as paths, bytes or PIL images)."""
    seen: set[str] = set()
    for index, rec in enumerate(_limited(records(spec, rows), spec.limit)):
        row_id, id_error = canonical_id(rec.get("id"), index)
        if shard_of(row_id, num_shards) != shard:
            continue
        error = rec.get("error") or id_error
        if row_id in seen:
            error = "duplicate id"
        seen.add(row_id)
        image = spec.image if spec.image is not None else rec.get("image")
        if image is None and not spec.allow_text_only and error is None:
            error = (f"no image (field {spec.image_field!r} is empty); set data.allow_text_only: true "
                     "to run rows without an image as text-only")  # fmt: skip
        prompt = rec.get("prompt")
        if prompt is None and spec.prompt is not None:
            prompt = spec.prompt
        yield SourceRow(index, row_id, prompt, image, error, rec.get("generation"))


DERIVED_ID = re.compile(
    r"#\d+"
)  # "#<source index>": the ids batchvl gives rows without one; no real id may take it


def canonical_id(value: Any, index: int) -> tuple[str, str | None]:
    """(id, error): the source's id as text without loss (int 1 -> "1", big ints exact, floats as JSON writes them);
    a missing, null or empty id -> "#<index>"; a bool, a container, a non-finite float, text that is not valid UTF-8
    or a real id in the derived "#<n>" namespace -> "#<index>" and an error saying why."""
    derived = f"#{index}"
    if value is None or value == "":
        return derived, None
    if isinstance(value, bool):  # True and "True" must never meet as one id
        return derived, f"id {value!r} is a boolean; use a string or an integer"
    if isinstance(value, int):
        return str(value), None
    if isinstance(value, float):
        if not math.isfinite(value):
            return derived, f"id {value!r} is not a finite number"
        return json.dumps(value), None
    if not isinstance(value, str):
        return derived, f"id must be a string or a number, got {type(value).__name__}"
    if DERIVED_ID.fullmatch(value):
        return derived, f"id {value!r} has the form batchvl reserves for rows without an id (#<row number>)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return derived, f"id {value!r} is not valid UTF-8 text"
    return value, None


def _limited(it: Iterable[dict], limit: int | None) -> Iterator[dict]:
    for i, rec in enumerate(it):
        if limit is not None and i >= limit:
            return
        yield rec


def records(spec: DataSpec, rows: Iterable[dict] | None = None) -> Iterator[dict]:
    """Normalized records {id, prompt, image[, error]} of the whole source, in order."""
    if spec.format == "rows":
        if rows is None:
            raise JobError("job.data.format: 'rows' takes its rows from Python: run_job(job, rows=[...])")
        for raw in rows:
            rec = _fields(raw, spec)
            rec["image"] = _image(rec.get("image"), Path.cwd())
            yield rec
        return
    if spec.format == "demo":
        from batchvl.demo import demo_rows

        yield from demo_rows()
        return
    if spec.format == "imagefolder":
        yield from _imagefolder(spec)
        return
    base = Path(spec.path) if Path(spec.path).is_dir() else Path(spec.path).parent
    norm: Callable[[dict, DataSpec], dict] = _sharegpt if spec.format == "sharegpt" else _fields
    raws = json_records(spec.path) if spec.format in ("jsonl", "sharegpt") else open_dataset(spec)
    for raw in raws:
        if isinstance(raw, BadRecord):
            yield raw
            continue
        rec = norm(raw, spec)
        rec["image"] = _image(rec.get("image"), base)
        yield rec


class BadRecord(dict):
    """A source record that did not parse: {"id": None, "error": why}."""


def json_records(path: str) -> Iterator[dict]:
    """A JSON Lines file one line at a time (blank lines skipped), or a file holding one JSON array. A line or
    element that is not a JSON object becomes a BadRecord naming its line: the job goes on."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):
            yield from _json_array(f.read(), path)
            return
        for number, line in enumerate(f, 1):
            if line.strip():
                yield _json_object(line, f"line {number}")


def _json_array(text: str, path: str) -> Iterator[dict]:
    try:
        items = json.loads(text)
    except ValueError as e:
        raise JobError(f"job.data.path: {path} starts with '[' but is not a JSON array: {e}") from None
    for number, item in enumerate(items):
        yield item if isinstance(item, dict) else _not_object(item, f"element {number}")


def _json_object(text: str, where: str) -> dict:
    try:
        rec = json.loads(text)
    except ValueError as e:
        return BadRecord(id=None, error=f"{where}: not valid JSON: {e}")
    return rec if isinstance(rec, dict) else _not_object(rec, where)


def _not_object(value: Any, where: str) -> dict:
    return BadRecord(id=None, error=f"{where}: expected a JSON object, got {type(value).__name__}")


def open_dataset(spec: DataSpec) -> Any:
    """The source as a streaming `datasets.IterableDataset` (images left undecoded)."""
    import datasets

    if spec.format in ("jsonl", "sharegpt"):
        ds = datasets.load_dataset("json", data_files=spec.path, split="train", streaming=True)
    elif spec.format == "parquet":
        ds = datasets.load_dataset(
            "parquet", data_files=parquet_files(spec.path), split="train", streaming=True
        )
    elif spec.format == "hf":
        ds = _open_hf(spec)
    else:
        raise ValueError(f"format {spec.format!r} is not a datasets source")
    for name, feat in (ds.features or {}).items():
        if isinstance(feat, datasets.Image):
            ds = ds.cast_column(name, datasets.Image(decode=False))
        elif isinstance(getattr(feat, "feature", None), datasets.Image):  # a list of images per row
            ds = ds.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return ds


def _open_hf(spec: DataSpec) -> Any:
    """A `save_to_disk` directory, a local dataset directory of data files, or a name in the local HF cache."""
    import datasets

    p = Path(spec.path)
    if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise JobError(f"job.data.split: {spec.split!r} not in {spec.path} (has {', '.join(ds)})")
            ds = ds[spec.split]
        return ds.to_iterable_dataset()
    if p.is_dir():
        return datasets.load_dataset(str(p), split=spec.split, streaming=True)
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True  # a name: only what is already in the local cache, never the hub
    try:
        return datasets.load_dataset(spec.path, split=spec.split, streaming=True)
    except Exception as e:
        raise JobError(
            f"job.data.path: {spec.path!r} is not a directory nor a dataset in the local cache ({e})"
        ) from None
    finally:
        datasets.config.HF_HUB_OFFLINE = offline


def check_source(spec: DataSpec) -> None:
    """Open the source and check its columns, so that a bad path, name or field fails before any model loads."""
    if spec.format in (
        "jsonl",
        "sharegpt",
    ):  # read line by line by `json_records`: a bad line is an error row
        if Path(spec.path).stat().st_size == 0:
            log.warning("%s is empty: the job has no rows", spec.path)
            return
        first = next((r for r in json_records(spec.path) if not isinstance(r, BadRecord)), None)
        if first is not None:
            check_columns(spec, list(first))
        return
    if spec.format not in ("parquet", "hf"):
        return
    try:
        ds = open_dataset(spec)
        columns = list(ds.features or next(iter(ds), {}))  # features: from the schema or the first rows
    except JobError:
        raise
    except Exception as e:
        raise JobError(
            f"job.data.path: cannot open {spec.path} as {spec.format}: {type(e).__name__}: {e}"
        ) from None
    if columns:
        check_columns(spec, columns)


def check_columns(spec: DataSpec, columns: list[str]) -> None:
    """JobError naming the first field the job reads that the source lacks, the columns it has and the key."""
    have = ", ".join(columns)
    if spec.format == "sharegpt" and not {"conversations", "messages"} & set(columns):
        raise JobError(f"job.data.format: sharegpt rows need a 'conversations' or 'messages' column; "
                       f"{spec.path} has {have}")  # fmt: skip
    need = []  # (job key, column, what else would do instead)
    if spec.id_field != "id":  # the default may be absent: then a row's position is its id
        need.append(("id_field", spec.id_field, ""))
    if spec.format != "sharegpt" and spec.prompt is None:
        need.append(("prompt_field", spec.prompt_field, ", or data.prompt for one prompt for every row"))
    if spec.image is None and not spec.allow_text_only:
        need.append(("image_field", spec.image_field, ", data.image for one image for every row, or "
                     "data.allow_text_only: true for text-only rows"))  # fmt: skip
    for key, column, instead in need:
        if column not in columns:
            close = difflib.get_close_matches(column, columns, n=1, cutoff=0.4)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise JobError(f"job.data.{key}: {spec.path} has no column {column!r}{hint}; its columns are "
                           f"{have}. Set data.{key} to the column to use{instead}")  # fmt: skip


def parquet_files(path: str) -> list[str]:
    """A file, a directory (every *.parquet below it) or a glob, sorted."""
    if Path(path).is_dir():
        return sorted(str(p) for p in Path(path).rglob("*.parquet"))
    return sorted(glob.glob(path)) if glob.has_magic(path) else [path]


GENERATION_FIELDS = (
    "max_new_tokens",
    "temperature",
    "stop",
)  # optional columns: a row's own generation settings


def _fields(raw: dict, spec: DataSpec) -> dict:
    rec = {
        "id": raw.get(spec.id_field),
        "prompt": raw.get(spec.prompt_field),
        "image": raw.get(spec.image_field),
    }
    return rec | _generation(raw)


def _generation(raw: dict) -> dict:
    """{"generation": the row's own settings} if it has any, else {}."""
    generation = {k: raw[k] for k in GENERATION_FIELDS if raw.get(k) is not None}
    return {"generation": generation} if generation else {}


def _sharegpt(raw: dict, spec: DataSpec) -> dict:
    """ShareGPT: the first human turn of `conversations` (or OpenAI-style role/content `messages`)."""
    turns = raw.get("conversations") or raw.get("messages") or []
    well_formed = isinstance(turns, list) and all(isinstance(t, dict) for t in turns)
    prompt = next(
        (t.get("value", t.get("content")) for t in turns if (t.get("from") or t.get("role")) in HUMAN_ROLES),
        None,
    ) if well_formed else None  # fmt: skip
    rec = {"id": raw.get(spec.id_field), "prompt": prompt, "image": raw.get(spec.image_field)}
    rec |= _generation(raw)
    if not well_formed:
        rec["error"] = "conversation is not a list of turns ({from, value} or {role, content} objects)"
    elif prompt is None:
        rec["error"] = "no human turn in conversation"
    return rec


def _image(value: Any, base: Path) -> Any:
    """A path made absolute against the data file's dir; bytes as they are; datasets dicts unpacked; a list
    (several images) item by item, a one-item list as its item."""
    if isinstance(value, (list, tuple)):
        images = [_image(v, base) for v in value]
        return None if not images else images[0] if len(images) == 1 else images
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        if not value.strip():
            return None
        return value if os.path.isabs(value) else str(base / value)
    return value


def _imagefolder(spec: DataSpec) -> Iterator[dict]:
    """Every image file below the folder (sorted); id = path relative to the folder."""
    root = Path(spec.path)
    prompt = spec.prompt if spec.prompt is not None else CAPTION_PROMPT
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTS and p.is_file())
    for p in files:
        yield {"id": p.relative_to(root).as_posix(), "prompt": prompt, "image": str(p)}


def count_rows(spec: DataSpec, rows: Iterable[dict] | None = None) -> int | None:
    """The job's row count when cheaply known (limit counts as known), for progress and ETA."""
    n: int | None = None
    if spec.format == "rows" and hasattr(rows, "__len__"):
        n = len(rows)
    elif spec.format == "demo":
        from batchvl.demo import demo_rows

        n = len(demo_rows())
    elif spec.format == "imagefolder":
        n = sum(1 for _ in _imagefolder(spec))
    elif spec.format == "parquet":
        import pyarrow.parquet as pq

        n = sum(pq.ParquetFile(f).metadata.num_rows for f in parquet_files(spec.path))
    elif spec.format == "jsonl":
        with open(spec.path, "rb") as f:
            n = sum(1 for line in f if line.strip())
    if spec.limit is not None:
        return spec.limit if n is None else min(n, spec.limit)
    return n
