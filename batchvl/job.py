"""The job spec: dataclasses, YAML loading, `--set` overrides and validation that names the key.

Relative paths in a job file (and in `--set` values) resolve against the current directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

DATA_FORMATS = ("jsonl", "sharegpt", "parquet", "imagefolder", "hf", "demo", "rows")  # rows: given to run_job
DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("none", "fp8")


class JobError(ValueError):
    """A job spec problem; the message starts with the key, e.g. `job.data.format: ...`."""


@dataclass
class ModelSpec:
    """Which weights: a checkpoint directory (`path`) or a preset with random weights."""

    path: str | None = None
    preset: str | None = None
    weights: str | None = None  # "checkpoint" (path) or "random" (preset); filled in by validation
    seed: int = 0
    tokenizer: str | None = None  # default: model.path, else a stand-in for the preset's LLM
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    tp: int = 1
    quantization: str = "none"  # fp8: the LLM decoder linears in FP8 e4m3 (GPU compute capability >= 8.9)


@dataclass
class DataSpec:
    """Where rows come from; relative image paths resolve against the data file's directory."""

    format: str = "jsonl"
    path: str | None = None
    image: str | None = None  # one image for every row
    prompt: str | None = None  # prompt for rows without one (imagefolder default: a caption prompt)
    limit: int | None = None
    split: str = "train"  # format hf
    id_field: str = "id"  # absent from the source: the row's position is its id
    prompt_field: str = "prompt"
    image_field: str = "image"  # a path, bytes or a list of them (several images per row)
    allow_text_only: bool = False  # rows without an image run text-only instead of failing


@dataclass
class PreprocessSpec:
    max_tiles: int = 12  # per image, not counting the thumbnail
    max_tiles_per_row: int | None = None  # a row's images share this (each gets max_tiles_per_row // images)
    min_tiles: int = 1
    use_thumbnail: bool = True
    max_input_tokens: int = 32768
    overlong: str = "error"
    max_image_pixels: int = 100_000_000
    max_image_bytes: int = 64 * 2**20  # a larger image file (or anything but a regular file) is an error row
    system_message: str | None = None
    workers: int = 2
    # prepared rows in flight ahead of the engine; a batch takes only rows already prepared, and with both caches a
    # tiger row costs ~240 prefill tokens: 32 capped the 38B job's batches at ~7.7k tokens of a 32k budget
    prefetch: int = 128
    row_timeout_s: float = 120.0  # a row a worker takes longer over is an error row; the worker is replaced


@dataclass
class EngineSpec:
    """How the engine runs: batch budgets, caches and the few real choices (the engine reads this very class)."""

    max_prefill_tokens: int | None = (
        None  # packed prefill tokens per batch (not counting cached ones); null: auto
    )
    max_vit_tiles: int = 64  # tiles per ViT call
    image_cache: bool = False  # encode an identical image once (content hash)
    prefix_cache: bool = False  # reuse the KV of system prompt + image across rows
    vit_fp8: bool = False  # ViT linears in FP8 e4m3: faster on the 6B, less accurate; model.tp 1 only
    vit_mode: str = (
        "auto"  # with model.tp > 1: "tp" (sharded ViT) or "dp" (replicated); auto: a cost model picks
    )
    eager: bool = False  # for debugging: no torch.compile and no CUDA graphs
    cache_dir: str = (
        "~/.cache/batchvl"  # compiled kernels and graphs, kept across runs (copy it to warm a machine)
    )


# engine keys of earlier versions: what became of each, for the error an old job file gets
REMOVED_KEYS = {
    "job.engine.compile_vit": "the ViT is always compiled (engine.eager: true turns compilation off)",
    "job.engine.vit_compile_mode": "the ViT compiles in Inductor's default mode",
    "job.engine.vit_gelu_epilogue": "the compiled ViT always runs fc1 + GELU as one GEMM",
    "job.engine.vit_fused_norm": "the compiled ViT always fuses its residuals and norms",
    "job.engine.vit_inplace_residual": "the compiled ViT always adds its residuals in place",
    "job.engine.vit_triton_attention": "the compiled ViT always takes its Triton attention where it has one",
    "job.engine.vit_splits": "a tensor-parallel ViT always overlaps two micro-batches",
    "job.engine.compile_llm": "the LLM is compiled on CUDA (engine.eager: true turns compilation off)",
    "job.engine.cuda_graphs": "decode runs from CUDA graphs on CUDA (engine.eager: true turns them off)",
    "job.engine.overlap_vit": "removed: running the ViT under the previous decode measured no gain",
    "job.engine.attn_backend": "the prefill attention is chosen per batch",
    "job.engine.last_layer_last_tokens": "the last layer always runs each prompt's last token only",
}


@dataclass
class GenerationSpec:
    max_new_tokens: int = 4
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # added to the template's stop tokens


@dataclass
class OutputSpec:
    dir: str | None = None
    rows_per_part: int = 1000
    overwrite: bool = False


@dataclass
class DistSpec:
    """How ranks of a torchrun job wait for each other."""

    # a rank that does not answer this long (at a barrier or collective) fails the job
    timeout_s: float = 1800.0


@dataclass
class Job:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    preprocess: PreprocessSpec = field(default_factory=PreprocessSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    dist: DistSpec = field(default_factory=DistSpec)


def load_job(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), **extra: Any
) -> Job:
    """Read a YAML job file, apply `key.sub=value` overrides, validate; `extra` sets dotted keys too."""
    raw: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise JobError(f"job file {path}: not found")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise JobError(f"job file {path}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise JobError(f"job file {path}: expected a mapping at the top level, got {type(raw).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise JobError(f"--set {item!r}: expected KEY=VALUE, e.g. output.dir=runs/x")
        set_key(raw, key.strip(), parse_scalar(value))
    for key, value in extra.items():
        set_key(raw, key, value)
    return job_from_dict(raw)


def parse_scalar(text: str) -> Any:
    """A `--set` value with YAML scalar rules (`10` int, `true` bool, `null` None, else str)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def set_key(d: dict, dotted: str, value: Any) -> None:
    """Set `a.b.c` in nested dicts, creating sections as needed."""
    *parents, last = dotted.split(".")
    cur = d
    for i, part in enumerate(parents):
        nxt = cur.get(part)
        if nxt is None:
            nxt = cur[part] = {}
        if not isinstance(nxt, dict):
            raise JobError(f"job.{'.'.join(parents[: i + 1])}: is not a section, cannot set {dotted}")
        cur = nxt
    cur[last] = value


def job_from_dict(raw: dict) -> Job:
    """Build and validate a Job; every error names its key."""
    job = _build(Job, raw, "job")
    _validate(job)
    return job


def job_to_dict(job: Job) -> dict:
    return dataclasses.asdict(job)


def job_for_fingerprint(job: Job) -> dict:
    """What changes results: the job dict minus where it is written (a moved run dir resumes), how rows are split
    into parts, worker counts and the engine's batch budgets (greedy results do not depend on them)."""
    d = job_to_dict(job)
    for section, key in (("output", "overwrite"), ("output", "dir"), ("output", "rows_per_part"),
                         ("preprocess", "workers"), ("preprocess", "prefetch"), ("preprocess", "row_timeout_s"),
                         ("engine", "cache_dir"), ("engine", "max_prefill_tokens"), ("engine", "max_vit_tiles")):  # fmt: skip
        d[section].pop(key, None)
    d.pop("dist")  # how long ranks wait for each other
    return d


def _build(cls: type, raw: Any, key: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"{key}: expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in raw.items():
        if f"{key}.{k}" in REMOVED_KEYS:
            raise JobError(f"{key}.{k}: no longer a setting ({REMOVED_KEYS[f'{key}.{k}']}); delete the key")
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
            raise JobError(f"{key}.{k}: unknown key{hint}")
        tp = hints[k]
        sub = f"{key}.{k}"
        kwargs[k] = _build(tp, v, sub) if dataclasses.is_dataclass(tp) else _coerce(v, tp, sub)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None or value == "auto":  # optional settings: null or auto leaves the choice to batchvl
            return None
        return _coerce(value, args[0], key)
    if origin is list:
        if not isinstance(value, list):
            raise JobError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[tp]
    if not ok:
        want = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]
        raise JobError(f"{key}: expected {want}, got {type(value).__name__} {value!r}")
    return float(value) if tp is float else value


def _choice(value: str, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise JobError(f"{key}: {value!r} is not one of {', '.join(choices)}{hint}")


def _at_least(value: int | float | None, low: float, key: str) -> None:
    if value is not None and value < low:
        raise JobError(f"{key}: must be >= {low:g}, got {value!r}")


def _abs(p: str) -> str:
    return str(Path(p).expanduser().absolute())


def _validate(job: Job) -> None:
    """Check choices, ranges and that files exist; make paths absolute."""
    m, d, pp, e, g, o = job.model, job.data, job.preprocess, job.engine, job.generation, job.output
    if (m.path is None) == (m.preset is None):
        raise JobError("job.model: set exactly one of 'path' (a checkpoint) or 'preset' (random weights)")
    if m.preset is not None:
        m.weights = m.weights or "random"
        if m.weights != "random":
            raise JobError(
                f"job.model.weights: a preset has only random weights (weights: random), got {m.weights!r}"
            )
        from batchvl.config import PRESETS

        _choice(m.preset, tuple(PRESETS), "job.model.preset")
    else:
        m.weights = m.weights or "checkpoint"
        _choice(m.weights, ("checkpoint",), "job.model.weights")
        m.path = _abs(m.path)
        if not Path(m.path).is_dir():
            raise JobError(f"job.model.path: {m.path} is not a directory")
        if not (Path(m.path) / "config.json").is_file():
            raise JobError(f"job.model.path: no config.json in {m.path}")
    if m.tokenizer is not None:
        m.tokenizer = _abs(m.tokenizer)
        if not Path(m.tokenizer).exists():
            raise JobError(f"job.model.tokenizer: {m.tokenizer} does not exist")
    _choice(m.dtype, DTYPES, "job.model.dtype")
    _choice(m.device, DEVICES, "job.model.device")
    _at_least(m.tp, 1, "job.model.tp")
    _choice(m.quantization, QUANTIZATIONS, "job.model.quantization")
    if m.quantization != "none" and m.tp > 1:
        raise JobError(f"job.model.quantization: {m.quantization} runs the LLM on one GPU per replica; use "
                       f"model.tp: 1 (got tp {m.tp}) or quantization: none")  # fmt: skip

    _choice(d.format, DATA_FORMATS, "job.data.format")
    if d.format in ("demo", "rows"):
        if d.path is not None:
            raise JobError(f"job.data.path: format {d.format!r} reads no file; remove data.path")
    elif d.path is None:
        raise JobError(f"job.data.path: required for format {d.format!r}")
    else:
        d.path = _check_data_path(d.format, d.path)
    if d.image is not None:
        d.image = _abs(d.image)
        if not Path(d.image).is_file():
            raise JobError(f"job.data.image: {d.image} is not a file")
    _at_least(d.limit, 0, "job.data.limit")

    for k in (
        "max_tiles",
        "min_tiles",
        "max_input_tokens",
        "max_image_pixels",
        "prefetch",
        "max_tiles_per_row",
        "max_image_bytes",
    ):
        _at_least(getattr(pp, k), 1, f"job.preprocess.{k}")
    if pp.min_tiles > pp.max_tiles:
        raise JobError(f"job.preprocess.min_tiles: {pp.min_tiles} > max_tiles {pp.max_tiles}")
    _choice(pp.overlong, ("error", "truncate"), "job.preprocess.overlong")
    _at_least(pp.workers, 0, "job.preprocess.workers")
    for key, secs in (("preprocess.row_timeout_s", pp.row_timeout_s), ("dist.timeout_s", job.dist.timeout_s)):
        if not 0 < secs < float("inf"):
            raise JobError(f"job.{key}: must be a number of seconds > 0, got {secs!r}")
    for k in ("max_prefill_tokens", "max_vit_tiles"):
        _at_least(getattr(e, k), 1, f"job.engine.{k}")
    _choice(e.vit_mode, ("auto", "tp", "dp"), "job.engine.vit_mode")
    e.cache_dir = _abs(e.cache_dir)
    if Path(e.cache_dir).exists() and not Path(e.cache_dir).is_dir():
        raise JobError(f"job.engine.cache_dir: {e.cache_dir} exists and is not a directory")
    _at_least(g.max_new_tokens, 1, "job.generation.max_new_tokens")
    if not 0 <= g.temperature < float("inf"):
        raise JobError(f"job.generation.temperature: must be a number >= 0, got {g.temperature!r}")
    if not 0 < g.top_p <= 1:
        raise JobError(f"job.generation.top_p: must be in (0, 1], got {g.top_p!r}")
    if o.dir is not None:  # (required by run_job; a Python Pipeline writes a run dir only when asked)
        o.dir = _abs(o.dir)
        if Path(o.dir).resolve() in (Path("/"), Path.home().resolve()):
            raise JobError(
                f"job.output.dir: {o.dir} is / or the home directory; give the run a directory of its own"
            )
        if Path(o.dir).exists() and not Path(o.dir).is_dir():
            raise JobError(f"job.output.dir: {o.dir} exists and is not a directory")
    _at_least(o.rows_per_part, 1, "job.output.rows_per_part")


def _check_data_path(fmt: str, path: str) -> str:
    key = "job.data.path"
    if fmt == "parquet" and glob.has_magic(path):
        if not glob.glob(path):
            raise JobError(f"{key}: no file matches {path}")
        return path
    p = Path(_abs(path))
    if fmt in ("jsonl", "sharegpt") and not p.is_file():
        raise JobError(f"{key}: {p} is not a file")
    if fmt == "hf" and not p.is_dir():
        if path.startswith((".", "/", "~")) or path.count("/") > 1:
            raise JobError(f"{key}: {p} is not a directory")
        return path  # a dataset name: looked up in the local HF cache only
    if fmt == "imagefolder" and not p.is_dir():
        raise JobError(f"{key}: {p} is not a directory")
    if fmt == "parquet" and not p.exists():
        raise JobError(f"{key}: {p} does not exist")
    return str(p)
