"""Row sources: every format, sharding, limit, duplicates, derived ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARED_DATA, save_image

from batchvl.data import CAPTION_PROMPT, check_source, count_rows, iter_rows, shard_of
from batchvl.job import DataSpec, JobError

SHAREGPT = SHARED_DATA / "ShareGPT_V3_filtered_1000.json"


def rows(spec: DataSpec, shard: int = 0, num_shards: int = 1) -> list:
    return list(iter_rows(spec, shard, num_shards))


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    save_image(tmp_path / "imgs" / "a.png")
    recs = [
        {"id": "a", "prompt": "first", "image": "imgs/a.png"},
        {"id": 7, "prompt": "numeric id"},
        {"prompt": "no id", "image": "/abs/b.png"},
        {"id": "d", "prompt": "fourth", "image": ""},
    ]
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def test_jsonl_rows_ids_and_relative_images(jsonl):
    got = rows(DataSpec(format="jsonl", path=str(jsonl), allow_text_only=True))
    assert [(r.index, r.id, r.prompt) for r in got] == [
        (0, "a", "first"), (1, "7", "numeric id"), (2, "#2", "no id"), (3, "d", "fourth")
    ]  # fmt: skip
    assert got[0].image == str(jsonl.parent / "imgs" / "a.png")  # relative to the data file's dir
    assert got[1].image is None and got[2].image == "/abs/b.png" and got[3].image is None
    assert all(r.error is None for r in got)
    assert count_rows(DataSpec(format="jsonl", path=str(jsonl))) == 4


def test_jsonl_field_overrides_and_shared_image(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text(json.dumps({"qid": "x", "question": "why?", "pic": "p.png"}) + "\n")
    spec = DataSpec(format="jsonl", path=str(p), id_field="qid", prompt_field="question", image_field="pic")
    (r,) = rows(spec)
    assert (r.id, r.prompt, r.image) == ("x", "why?", str(tmp_path / "p.png"))
    spec.image = "/data/tiger.jpeg"
    assert rows(spec)[0].image == "/data/tiger.jpeg"  # data.image: one image for every row


def test_sharegpt_takes_the_first_human_turn(tmp_path):
    convs = [
        {"id": "c1", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}],
         "max_new_tokens": 300},
        {"id": "c2", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "q2"},
                                       {"from": "human", "value": "later"}]},
        {"id": "c3", "conversations": [{"from": "gpt", "value": "only the model speaks"}]},
    ]  # fmt: skip
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(convs))
    got = rows(DataSpec(format="sharegpt", path=str(p), image="/x/tiger.jpeg"))
    assert [(r.id, r.prompt, r.error) for r in got] == [
        ("c1", "hello", None), ("c2", "q2", None), ("c3", None, "no human turn in conversation")
    ]  # fmt: skip
    assert all(r.image == "/x/tiger.jpeg" for r in got)
    assert [r.generation for r in got] == [{"max_new_tokens": 300}, None, None]  # a row's own settings


@pytest.mark.skipif(not SHAREGPT.is_file(), reason="../shared/data not present")
def test_sharegpt_seed_file():
    raw = json.loads(SHAREGPT.read_text())
    spec = DataSpec(format="sharegpt", path=str(SHAREGPT), limit=500)
    got = rows(spec)
    assert [r.id for r in got] == [c["id"] for c in raw[:500]]
    assert [r.prompt for r in got] == [c["conversations"][0]["value"] for c in raw[:500]]
    assert count_rows(spec) == 500


def test_parquet_with_bytes_and_paths(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    png = save_image(tmp_path / "x.png").read_bytes()
    (tmp_path / "parts").mkdir()
    pq.write_table(pa.table({"id": ["p0", "p1"], "prompt": ["a", "b"], "image": [png, None]}),
                   tmp_path / "parts" / "0.parquet")  # fmt: skip
    pq.write_table(
        pa.table({"id": ["p2"], "prompt": ["c"], "image": [None]}), tmp_path / "parts" / "1.parquet"
    )
    got = rows(DataSpec(format="parquet", path=str(tmp_path / "parts")))
    assert [r.id for r in got] == ["p0", "p1", "p2"]
    assert got[0].image == png and got[1].image is None
    assert count_rows(DataSpec(format="parquet", path=str(tmp_path / "parts"))) == 3
    glob_rows = rows(DataSpec(format="parquet", path=str(tmp_path / "parts" / "1.*")))
    assert [r.id for r in glob_rows] == ["p2"]


def test_hf_saved_dataset_with_image_feature(tmp_path):
    import datasets

    png = save_image(tmp_path / "x.png").read_bytes()
    feats = datasets.Features({"id": datasets.Value("string"), "prompt": datasets.Value("string"),
                               "image": datasets.Image()})  # fmt: skip
    ds = datasets.Dataset.from_dict(
        {"id": ["h0", "h1"], "prompt": ["a", "b"], "image": [{"bytes": png, "path": None}] * 2},
        features=feats,
    )
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    got = rows(DataSpec(format="hf", path=str(tmp_path / "dd")))
    assert [r.id for r in got] == ["h0", "h1"]
    assert got[0].image == png  # undecoded: bytes, never a PIL object
    assert [r.id for r in rows(DataSpec(format="hf", path=str(tmp_path / "dd"), split="test"))] == ["h0"]
    ds.save_to_disk(str(tmp_path / "single"))
    assert len(rows(DataSpec(format="hf", path=str(tmp_path / "single")))) == 2
    with pytest.raises(JobError, match=r"^job\.data\.split: 'validation' not in"):
        check_source(DataSpec(format="hf", path=str(tmp_path / "dd"), split="validation"))


def test_hf_dataset_name_is_looked_up_in_the_local_cache_only():
    with pytest.raises(JobError, match=r"^job\.data\.path: 'nobody/no-such-dataset' is not a directory nor"):
        check_source(DataSpec(format="hf", path="nobody/no-such-dataset"))


def test_imagefolder_ids_are_relative_paths(tmp_path):
    for name, fmt in (("b.jpg", "JPEG"), ("a.png", "PNG"), ("sub/c.webp", "WEBP")):
        save_image(tmp_path / "imgs" / name, fmt=fmt)
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    spec = DataSpec(format="imagefolder", path=str(tmp_path / "imgs"))
    got = rows(spec)
    assert [r.id for r in got] == ["a.png", "b.jpg", "sub/c.webp"]
    assert all(r.prompt == CAPTION_PROMPT and Path(r.image).is_file() for r in got)
    assert count_rows(spec) == 3
    spec.prompt = "Caption?"
    assert rows(spec)[0].prompt == "Caption?"


def test_demo_rows():
    got = rows(DataSpec(format="demo", allow_text_only=True))
    assert len(got) == 8 and len({r.id for r in got}) == 8
    assert sum(r.image is None for r in got) == 1 and all(r.prompt for r in got)


def _many(tmp_path: Path, n: int, dup_every: int = 0) -> Path:
    p = tmp_path / "many.jsonl"
    ids = [f"r{i}" for i in range(n)]
    if dup_every:
        ids = [ids[i - 1] if i and i % dup_every == 0 else x for i, x in enumerate(ids)]
    p.write_text("".join(json.dumps({"id": x, "prompt": f"q{i}"}) + "\n" for i, x in enumerate(ids)))
    return p


def test_sharding_is_disjoint_complete_and_deterministic(tmp_path):
    spec = DataSpec(format="jsonl", path=str(_many(tmp_path, 60)))
    everything = [r.index for r in rows(spec)]
    shards = [[r.index for r in rows(spec, s, 3)] for s in range(3)]
    assert sorted(sum(shards, [])) == everything  # complete, each row once
    assert all(shards) and all(s == sorted(s) for s in shards)  # every shard gets rows, in stream order
    assert shards == [[r.index for r in rows(spec, s, 3)] for s in range(3)]  # same split every time
    assert all(shard_of(f"r{i}", 3) == s for s, idx in enumerate(shards) for i in idx)


def test_limit_applies_to_the_whole_job_before_sharding(tmp_path):
    spec = DataSpec(format="jsonl", path=str(_many(tmp_path, 60)), limit=25)
    assert [r.index for r in rows(spec)] == list(range(25))
    assert sorted(r.index for s in range(2) for r in rows(spec, s, 2)) == list(range(25))
    assert count_rows(spec) == 25
    assert rows(DataSpec(format="jsonl", path=spec.path, limit=0)) == []


def test_duplicates_after_the_first_become_errors_on_every_sharding(tmp_path):
    spec = DataSpec(format="jsonl", path=str(_many(tmp_path, 30, dup_every=5)), allow_text_only=True)
    for n in (1, 2, 3):
        got = [r for s in range(n) for r in rows(spec, s, n)]
        errs = sorted(r.index for r in got if r.error)
        assert errs == [5, 10, 15, 20, 25], n
        assert all(r.error == "duplicate id" for r in got if r.error)
        ok_ids = [r.id for r in got if not r.error]
        assert len(ok_ids) == len(set(ok_ids)) == 25


def test_a_field_the_source_lacks_is_named_before_any_row_runs(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "q", "image_path": "a.png"}) + "\n")
    with pytest.raises(
        JobError,
        match=r"^job\.data\.image_field: .* has no column 'image' \(did you mean "
        r"'image_path'\?\); its columns are id, prompt, image_path\. Set data\.image_field",
    ):
        check_source(DataSpec(format="jsonl", path=str(p)))
    check_source(DataSpec(format="jsonl", path=str(p), image_field="image_path"))
    check_source(
        DataSpec(format="jsonl", path=str(p), allow_text_only=True)
    )  # text-only: no image column needed
    check_source(DataSpec(format="jsonl", path=str(p), image="/x.png"))  # one image for every row
    with pytest.raises(JobError, match=r"^job\.data\.id_field: .* no column 'qid'"):
        check_source(DataSpec(format="jsonl", path=str(p), id_field="qid", image_field="image_path"))
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"id": "c", "turns": []}]))
    with pytest.raises(
        JobError, match="sharegpt rows need a 'conversations' or 'messages' column; .* has id, turns"
    ):
        check_source(DataSpec(format="sharegpt", path=str(sg), image="/x.png"))


def test_hf_dataset_with_other_column_names_is_refused_naming_them(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"question": ["a"] * 17, "picture": [None] * 17}).save_to_disk(
        str(tmp_path / "d")
    )
    with pytest.raises(
        JobError,
        match=r"^job\.data\.prompt_field: .* no column 'prompt'; its columns are "
        r"question, picture\. Set data\.prompt_field to the column to use, or data\.prompt",
    ):
        check_source(DataSpec(format="hf", path=str(tmp_path / "d")))
    ok = DataSpec(format="hf", path=str(tmp_path / "d"), prompt_field="question", image_field="picture")
    check_source(ok)
    got = rows(ok)
    assert len(got) == 17 and all(r.prompt == "a" and r.error.startswith("no image") for r in got)


def test_a_row_without_an_image_fails_unless_text_only_rows_are_allowed(jsonl):
    spec = DataSpec(format="jsonl", path=str(jsonl))
    errors = {r.id: r.error for r in rows(spec)}
    assert errors["a"] is None and errors["#2"] is None  # (#2: no id; an image path, checked when it is read)
    for rid in ("7", "d"):  # no image field, an empty one
        assert errors[rid] == (
            "no image (field 'image' is empty); set data.allow_text_only: true to run rows "
            "without an image as text-only"
        )
    spec.allow_text_only = True
    assert all(r.error is None for r in rows(spec))


def test_several_images_per_row(tmp_path):
    png = save_image(tmp_path / "x.png").read_bytes()
    p = tmp_path / "rows.jsonl"
    recs = [{"id": "two", "prompt": "q", "image": ["a.png", "/abs/b.png"]}, {"id": "one", "prompt": "q", "image": ["a.png"]},
            {"id": "none", "prompt": "q", "image": []}]  # fmt: skip
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = rows(DataSpec(format="jsonl", path=str(p)))
    assert got[0].image == [str(tmp_path / "a.png"), "/abs/b.png"] and got[1].image == str(tmp_path / "a.png")
    assert got[2].image is None and got[2].error.startswith("no image")
    import datasets

    feats = datasets.Features({"prompt": datasets.Value("string"), "image": [datasets.Image()]})
    ds = datasets.Dataset.from_dict(
        {"prompt": ["q"], "image": [[{"bytes": png, "path": None}] * 3]}, features=feats
    )
    ds.save_to_disk(str(tmp_path / "hf"))
    (row,) = rows(DataSpec(format="hf", path=str(tmp_path / "hf")))
    assert row.image == [png] * 3


def _jsonl(tmp_path: Path, lines: list[str]) -> DataSpec:
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(line + "\n" for line in lines))
    return DataSpec(format="jsonl", path=str(p), allow_text_only=True)


def test_ids_keep_the_sources_representation(tmp_path):
    """Ints stay ints ("1", never "1.0"), big ints stay exact, floats read as JSON writes them (issue 27)."""
    ids = ["1", "2.5", "9007199254740993", "9007199254740992", '"x y"', "-0", "1e3"]
    spec = _jsonl(tmp_path, [f'{{"id": {i}, "prompt": "p"}}' for i in ids])
    got = rows(spec)
    assert [r.id for r in got] == ["1", "2.5", "9007199254740993", "9007199254740992", "x y", "0", "1000.0"]
    assert all(r.error is None for r in got)


def test_missing_null_and_empty_ids_never_collide_with_real_ids(tmp_path):
    lines = ['{"id": null, "prompt": "a"}', '{"id": "0", "prompt": "b"}', '{"prompt": "c"}', '{"id": "", "prompt": "d"}',
             '{"id": "#1", "prompt": "e"}', '{"id": true, "prompt": "f"}', '{"id": "True", "prompt": "g"}',
             '{"id": [1], "prompt": "h"}', '{"id": "\\ud800", "prompt": "i"}']  # fmt: skip
    got = rows(_jsonl(tmp_path, lines))
    assert [(r.id, r.prompt) for r in got] == [("#0", "a"), ("0", "b"), ("#2", "c"), ("#3", "d"), ("#4", "e"),
                                               ("#5", "f"), ("True", "g"), ("#7", "h"), ("#8", "i")]  # fmt: skip
    errors = {r.id: r.error for r in got}
    assert [errors[i] for i in ("#0", "0", "#2", "#3", "True")] == [None] * 5  # all of them run
    assert "reserves" in errors["#4"] and "boolean" in errors["#5"]
    assert "string or a number" in errors["#7"] and "UTF-8" in errors["#8"]
    assert len({r.id for r in got}) == len(got)


def test_malformed_jsonl_lines_become_error_rows_and_the_rest_runs(tmp_path):
    lines = ['{"id": "a", "prompt": "p"}', "", "not json at all", "[1,2,3]", "42", '"\\ud800"', '{"id": "b", "prompt": "q"}',
             '{"id": "c", "prompt": "r", "error": "a user column"}']  # fmt: skip
    spec = _jsonl(tmp_path, lines)
    check_source(spec)
    got = rows(spec)
    assert [r.id for r in got] == ["a", "#1", "#2", "#3", "#4", "b", "c"]
    assert [r.error for r in (got[0], got[5])] == [None, None]
    assert got[1].error.startswith("line 3: not valid JSON")
    assert got[2].error == "line 4: expected a JSON object, got list"
    assert got[3].error == "line 5: expected a JSON object, got int"
    assert got[4].error == "line 6: expected a JSON object, got str"
    assert got[6].error is None  # a record's own "error" field is data, not a parse failure
    assert count_rows(spec) == 7


def test_an_empty_jsonl_file_has_no_rows(tmp_path):
    spec = _jsonl(tmp_path, [])
    check_source(spec)  # not a traceback
    assert rows(spec) == [] and count_rows(spec) == 0


def test_a_sharegpt_row_whose_conversation_is_not_a_list_of_turns_is_an_error_row(tmp_path):
    """A malformed conversation (a string, a list of non-objects, one object) fails that row, not the whole job."""
    good = {"id": "ok", "conversations": [{"from": "human", "value": "hi"}]}
    bad = [{"id": "s", "conversations": "hello"}, {"id": "i", "conversations": [1, 2]},
           {"id": "d", "conversations": {"from": "human", "value": "hi"}}]  # fmt: skip
    path = tmp_path / "sg.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, *bad]))
    got = {r.id: r.error for r in rows(DataSpec(format="sharegpt", path=str(path), allow_text_only=True))}
    assert got["ok"] is None
    assert all("not a list of turns" in got[i] for i in ("s", "i", "d")), got
