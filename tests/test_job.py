"""Job spec: YAML loading, --set overrides, validation errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from batchvl.job import JobError, job_for_fingerprint, load_job

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "rows.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    return {"rows": tmp_path / "rows.jsonl", "ckpt": tmp_path / "ckpt", "out": tmp_path / "out"}


def write_job(tmp_path: Path, d: dict) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def base(files: dict[str, Path]) -> dict:
    return {
        "model": {"preset": "tiny-qwen2"},
        "data": {"format": "jsonl", "path": str(files["rows"])},
        "output": {"dir": str(files["out"])},
    }


def test_defaults_and_resolved_fields(tmp_path, files):
    job = load_job(write_job(tmp_path, base(files)))
    assert job.model.weights == "random" and job.model.seed == 0 and job.model.tp == 1
    assert (
        job.preprocess.max_tiles == 12 and job.preprocess.overlong == "error" and job.preprocess.workers == 2
    )
    assert (
        job.engine.max_prefill_tokens is None and job.engine.max_vit_tiles == 64
    )  # None: sized by the engine
    assert job.engine.eager is False and Path(job.engine.cache_dir).is_absolute()
    assert job.generation.max_new_tokens == 4 and job.generation.temperature == 0.0
    assert job.output.rows_per_part == 1000 and job.output.overwrite is False
    assert Path(job.output.dir).is_absolute()


@pytest.mark.parametrize(
    "section, key, message",
    [
        ("data", "fromat", "job.data.fromat: unknown key (did you mean 'format'?)"),
        ("engine", "max_prefil_tokens", "job.engine.max_prefil_tokens: unknown key (did you mean 'max_prefill_tokens'?)"),
        ("generation", "zzz", "job.generation.zzz: unknown key (known:"),
    ],
)  # fmt: skip
def test_unknown_key_is_named_with_a_suggestion(tmp_path, files, section, key, message):
    d = base(files)
    d.setdefault(section, {})[key] = 1
    with pytest.raises(JobError) as e:
        load_job(write_job(tmp_path, d))
    assert str(e.value).startswith(message)


def test_unknown_top_level_section(tmp_path, files):
    d = base(files) | {"modle": {}}
    with pytest.raises(JobError, match=r"^job\.modle: unknown key \(did you mean 'model'\?\)"):
        load_job(write_job(tmp_path, d))


@pytest.mark.parametrize(
    "dotted, value, message",
    [
        ("data.limit", "ten", r"^job\.data\.limit: expected an integer, got str 'ten'"),
        ("generation.temperature", True, r"^job\.generation\.temperature: expected a number, got bool"),
        ("preprocess.workers", 1.5, r"^job\.preprocess\.workers: expected an integer, got float"),
        ("generation.ignore_eos", "yes please", r"^job\.generation\.ignore_eos: expected true or false"),
        ("generation.stop_token_ids", [1, "x"], r"^job\.generation\.stop_token_ids\[1\]: expected an integer"),
        ("engine", 5, r"^job\.engine: expected a mapping, got int"),
        ("model.dtype", "fp8", r"^job\.model\.dtype: 'fp8' is not one of"),
        ("data.format", "jsonn", r"^job\.data\.format: .*did you mean 'jsonl'"),
        ("preprocess.overlong", "cut", r"^job\.preprocess\.overlong: 'cut' is not one of error, truncate"),
        ("engine.max_vit_tiles", 0, r"^job\.engine\.max_vit_tiles: must be >= 1, got 0"),
        ("generation.top_p", 1.5, r"^job\.generation\.top_p: must be in \(0, 1\]"),
        ("generation.temperature", float("nan"), r"^job\.generation\.temperature: must be a number >= 0, got nan"),
        ("generation.temperature", float("inf"), r"^job\.generation\.temperature: must be a number >= 0, got inf"),
        ("model.preset", "internvl9", r"^job\.model\.preset: 'internvl9' is not one of"),
        ("preprocess.row_timeout_s", 0, r"^job\.preprocess\.row_timeout_s: must be a number of seconds > 0"),
        ("dist.timeout_s", -1, r"^job\.dist\.timeout_s: must be a number of seconds > 0, got -1"),
    ],
)  # fmt: skip
def test_wrong_type_or_value_is_named(tmp_path, files, dotted, value, message):
    d = base(files)
    section, key = dotted.split(".") if "." in dotted else (dotted, None)
    if key is None:
        d[section] = value
    else:
        d.setdefault(section, {})[key] = value
    with pytest.raises(JobError, match=message):
        load_job(write_job(tmp_path, d))


@pytest.mark.parametrize(
    "dotted, message",
    [
        ("data.path", r"^job\.data\.path: .*nope is not a file"),
        ("data.image", r"^job\.data\.image: .*nope is not a file"),
        ("model.tokenizer", r"^job\.model\.tokenizer: .*nope does not exist"),
    ],
)
def test_missing_file_is_named(tmp_path, files, dotted, message):
    d = base(files)
    section, key = dotted.split(".")
    d[section][key] = str(tmp_path / "nope")
    with pytest.raises(JobError, match=message):
        load_job(write_job(tmp_path, d))


def test_model_path_checks(tmp_path, files):
    d = base(files)
    d["model"] = {"path": str(tmp_path / "nope")}
    with pytest.raises(JobError, match=r"^job\.model\.path: .* is not a directory"):
        load_job(write_job(tmp_path, d))
    d["model"] = {"path": str(files["ckpt"]), "preset": "tiny-qwen2"}
    with pytest.raises(JobError, match=r"^job\.model: set exactly one of"):
        load_job(write_job(tmp_path, d))
    d["model"] = {"path": str(files["ckpt"])}
    job = load_job(write_job(tmp_path, d))
    assert job.model.weights == "checkpoint" and job.model.path == str(files["ckpt"])
    d["model"] = {"preset": "tiny-qwen2", "weights": "checkpoint"}
    with pytest.raises(JobError, match=r"^job\.model\.weights: a preset has only random weights"):
        load_job(write_job(tmp_path, d))


def test_required_keys(tmp_path, files):
    d = base(files)
    del d["output"]
    job = load_job(write_job(tmp_path, d))  # a job without a run dir describes a model for batchvl.Pipeline
    from batchvl.runner import run_job

    with pytest.raises(JobError, match=r"^job\.output\.dir: required"):  # ... and cannot run as a job
        run_job(job)
    d = base(files)
    del d["data"]["path"]
    with pytest.raises(JobError, match=r"^job\.data\.path: required for format 'jsonl'"):
        load_job(write_job(tmp_path, d))


def test_set_overrides_use_yaml_scalar_rules(tmp_path, files):
    sets = [
        "data.limit=10",
        "generation.ignore_eos=true",
        "generation.temperature=0.5",
        "output.dir=" + str(tmp_path / "elsewhere"),
        "engine.vit_mode=dp",
        "preprocess.system_message=null",
        "generation.stop_token_ids=[1, 2]",
    ]
    job = load_job(write_job(tmp_path, base(files)), sets)
    assert job.data.limit == 10 and job.generation.ignore_eos is True and job.generation.temperature == 0.5
    assert job.output.dir == str(tmp_path / "elsewhere") and job.engine.vit_mode == "dp"
    assert job.preprocess.system_message is None and job.generation.stop_token_ids == [1, 2]
    with pytest.raises(JobError, match=r"^job\.data\.limit: expected an integer, got str 'lots'"):
        load_job(write_job(tmp_path, base(files)), ["data.limit=lots"])
    with pytest.raises(JobError, match=r"^job\.data\.fromat: unknown key \(did you mean 'format'\?\)"):
        load_job(write_job(tmp_path, base(files)), ["data.fromat=jsonl"])
    with pytest.raises(JobError, match=r"^--set 'data.limit': expected KEY=VALUE"):
        load_job(write_job(tmp_path, base(files)), ["data.limit"])
    # switching from a checkpoint to a preset from the command line
    d = base(files) | {"model": {"path": str(files["ckpt"])}}
    job = load_job(write_job(tmp_path, d), ["model.path=null", "model.preset=tiny-qwen2"])
    assert job.model.preset == "tiny-qwen2" and job.model.weights == "random"


def test_relative_paths_resolve_against_the_current_directory(tmp_path, files, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "rows.jsonl").write_text("{}\n")
    d = base(files)
    d["data"]["path"] = "rows.jsonl"
    d["output"]["dir"] = "out"
    job_file = write_job(tmp_path, d)
    monkeypatch.chdir(sub)
    job = load_job(job_file)
    assert job.data.path == str(sub / "rows.jsonl") and job.output.dir == str(sub / "out")


def test_fingerprint_ignores_settings_that_keep_results(tmp_path, files):
    p = write_job(tmp_path, base(files))
    a = job_for_fingerprint(load_job(p))
    assert a == job_for_fingerprint(load_job(p, ["output.overwrite=true", "preprocess.workers=7"]))
    # where the run is written and the engine's batch budgets do not change results (issue 27)
    same = ["output.dir=/elsewhere/run", "output.rows_per_part=3", "engine.max_prefill_tokens=77",
            "engine.max_vit_tiles=5", "preprocess.row_timeout_s=5", "dist.timeout_s=60"]  # fmt: skip
    assert a == job_for_fingerprint(load_job(p, same))
    assert a != job_for_fingerprint(load_job(p, ["generation.max_new_tokens=5"]))
    json.dumps(a)  # plain data


@pytest.mark.parametrize("where", ["/", "~/", str(Path.home()), "/tmp/.."])
def test_output_dir_may_not_be_root_or_home(tmp_path, files, where):
    with pytest.raises(JobError, match="job.output.dir: .* is / or the home directory"):
        load_job(write_job(tmp_path, base(files)), [f"output.dir={where}"])


def test_shipped_job_files_validate(tmp_path, files, monkeypatch):
    monkeypatch.chdir(REPO)
    demo = load_job(REPO / "jobs/demo.yaml", [f"output.dir={tmp_path / 'demo'}"])
    assert demo.data.format == "demo" and demo.model.preset == "tiny-qwen2" and demo.model.device == "cpu"
    if (REPO.parent / "shared/data/tiger.jpeg").is_file():
        seed = load_job(REPO / "jobs/sharegpt_tiger.yaml")
        assert (
            seed.model.preset == "internvl2_5-78b" and seed.data.limit == 500 and seed.generation.ignore_eos
        )
        assert seed.data.image.endswith("tiger.jpeg")
    folder = tmp_path / "images"
    folder.mkdir()
    cap = load_job(REPO / "jobs/caption_folder.yaml", [f"model.path={files['ckpt']}", f"data.path={folder}"])
    assert cap.data.format == "imagefolder"


def test_hf_path_may_be_a_local_dir_or_a_cached_dataset_name(tmp_path, files):
    d = base(files)
    d["data"] = {"format": "hf", "path": "owner/some-dataset"}
    assert load_job(write_job(tmp_path, d)).data.path == "owner/some-dataset"
    d["data"]["path"] = str(tmp_path / "no" / "such" / "dir")
    with pytest.raises(JobError, match=r"^job\.data\.path: .* is not a directory"):
        load_job(write_job(tmp_path, d))


def test_engine_choices_are_checked(tmp_path):
    with pytest.raises(JobError, match="job.engine.vit_mode"):
        load_job(REPO / "jobs/demo.yaml", ["engine.vit_mode=sideways", f"output.dir={tmp_path}"])
    job = load_job(REPO / "jobs/demo.yaml", ["engine.max_prefill_tokens=auto", f"output.dir={tmp_path}"])
    assert job.engine.max_prefill_tokens is None


@pytest.mark.parametrize(
    "key, replaced_by",
    [
        ("compile_vit", "engine.eager: true turns compilation off"),
        ("compile_llm", "engine.eager: true turns compilation off"),
        ("cuda_graphs", "engine.eager: true turns them off"),
        ("attn_backend", "chosen per batch"),
        ("overlap_vit", "removed"),
        ("vit_fused_norm", "always fuses"),
    ],
)
def test_a_removed_engine_key_says_what_replaced_it(tmp_path, key, replaced_by):
    """An old job file naming an engine key that measurement turned into code is refused with the key and why."""
    with pytest.raises(JobError) as e:
        load_job(REPO / "jobs/demo.yaml", [f"engine.{key}=true", f"output.dir={tmp_path}"])
    msg = str(e.value)
    assert msg.startswith(f"job.engine.{key}: no longer a setting (") and msg.endswith("); delete the key")
    assert replaced_by in msg


def test_eager_is_a_boolean(tmp_path):
    for value, want in (("true", True), ("false", False)):
        job = load_job(REPO / "jobs/demo.yaml", [f"engine.eager={value}", f"output.dir={tmp_path}"])
        assert job.engine.eager is want
    with pytest.raises(JobError, match=r"^job\.engine\.eager: expected true or false"):
        load_job(REPO / "jobs/demo.yaml", ["engine.eager=sometimes", f"output.dir={tmp_path}"])
    with pytest.raises(JobError, match=r"^job\.engine\.eagre: unknown key \(did you mean 'eager'\?\)"):
        load_job(REPO / "jobs/demo.yaml", ["engine.eagre=true", f"output.dir={tmp_path}"])
