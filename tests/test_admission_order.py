"""Admission order: rows longest max_new_tokens first (`scheduler.longest_first`), alone and through the row loop and a
resumed job: the same rows with the same outputs as in source order, each written once, and fuller decode steps."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import FakeEngine, stopped_at_admission

from batchvl.data import SourceRow
from batchvl.engine import Sampling
from batchvl.job import load_job
from batchvl.output import read_manifest, read_rows
from batchvl.pipeline import Flow, RowLoop, row_max_new_tokens
from batchvl.preprocess import PreprocessConfig, Preprocessor, load_tokenizer
from batchvl.runner import run_job
from batchvl.scheduler import longest_first

REPO = Path(__file__).resolve().parents[1]
PCFG = PreprocessConfig(max_tiles=1, max_input_tokens=2048)


def _rows(lengths: list[int | None], errors: dict[int, str] | None = None) -> list[SourceRow]:
    """Row i has id "r<i>" and max_new_tokens lengths[i] (None: none of its own); errors: index -> error."""
    errors = errors or {}
    return [SourceRow(i, f"r{i}", f"question {i}", error=errors.get(i),
                      generation=None if n is None else {"max_new_tokens": n})
            for i, n in enumerate(lengths)]  # fmt: skip


def _order(rows: list[SourceRow], cap: int = 10, block: int = 3) -> list[int]:
    return [r.index for r in longest_first(rows, lambda r: row_max_new_tokens(r, cap), cap, block)]


def test_rows_without_their_own_length_keep_source_order_and_pass_at_once():
    rows = _rows([None, 10, None, 10, None])  # 10: the cap
    read = []

    def source():
        for r in rows:
            read.append(r.index)
            yield r

    out = longest_first(source(), lambda r: row_max_new_tokens(r, 10), 10, block=3)
    assert next(out).index == 0 and read == [0]  # nothing is held back
    assert [r.index for r in out] == [1, 2, 3, 4]


def test_longest_first_stable_in_blocks():
    # 8 rows, block 3: the first 3 held rows go sorted once 3 more are held; the last 5 are sorted together
    assert _order(_rows([5, 2, 7, 2, 9, 1, 3, 8])) == [2, 0, 1, 4, 7, 6, 3, 5]
    # ties keep source order; a job of fewer than 2 blocks is sorted whole
    assert _order(_rows([2, 4, 2, 4, 1]), block=3) == [1, 3, 0, 2, 4]
    # rows at the cap (or without a length, or with a bad one: they fail at once) pass at once
    assert _order(_rows([3, None, 4, 10, 0, 5])) == [1, 3, 4, 5, 2, 0]
    # a big job: each block of 50 sorted, at most 2 blocks held, and the last 30 rows sorted with the block before
    rng = random.Random(0)
    lengths = [rng.randint(1, 9) for _ in range(1030)]
    read = []
    rows = _rows(lengths)

    def source():
        for r in rows:
            read.append(r.index)
            yield r

    out = []
    for r in longest_first(source(), lambda r: row_max_new_tokens(r, 10), 10, 50):
        out.append(r.index)
        assert len(read) - len(out) <= 100
    for lo, hi in [(b, b + 50) for b in range(0, 950, 50)] + [(950, 1030)]:
        assert sorted(out[lo:hi]) == list(range(lo, hi))
        assert [lengths[i] for i in out[lo:hi]] == sorted((lengths[i] for i in range(lo, hi)), reverse=True)


def test_an_error_row_never_goes_before_a_held_row_with_its_id():
    rows = _rows([2, 9, 8, 5, None, 7])
    # r0 is held (length 2): its duplicate waits right behind it
    rows[4] = SourceRow(4, "r0", "dup", error="duplicate id")
    rows[5].error = "no image"  # an error row with an id of its own passes at once
    assert _order(rows) == [5, 1, 2, 3, 0, 4]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _loop(engine, rows, cap: int, ordered: bool, monkeypatch, written: list[dict]) -> dict:
    if not ordered:
        monkeypatch.setattr("batchvl.pipeline.longest_first", lambda rows, *args: rows)
    flow = Flow(engine, Preprocessor(PCFG), str, Sampling(max_new_tokens=cap, ignore_eos=True), prefetch=32)
    counts = RowLoop(flow, written.append, t0=0.0).run(rows)
    monkeypatch.undo()
    return counts


def test_real_engine_rows_come_out_as_in_source_order(monkeypatch, tokenizer):
    """The real engine: ordered, every row is written once with the tokens of the source-order run, rows are admitted
    longest first, and a duplicate's error row comes after its first occurrence."""
    from batchvl.engine import Engine
    from batchvl.model.loader import random_model

    model, cfg = random_model("tiny-qwen2", seed=0)
    lengths = [2, 6, 1, None, 3, 5, 0, 4, 6, 2, 1, 5]  # 0: a bad value, an error row
    rows = _rows(lengths) + [SourceRow(12, "r2", "dup", error="duplicate id")]
    runs, admitted = {}, []

    class Spy(Engine):
        def admit(self, requests):
            admitted.extend(r.sampling.max_new_tokens for r in requests)
            return super().admit(requests)

    for ordered in (False, True):
        admitted.clear()
        written: list[dict] = []
        _loop(Spy(model, cfg, max_seq_len=4096, pool_blocks=200), rows, 6, ordered, monkeypatch, written)
        ids = [r["id"] for r in written]
        assert sorted(ids) == sorted(r.id for r in rows)
        assert [r["error"] for r in written if r["id"] == "r2"] == [None, "duplicate id"]  # in this order
        runs[ordered] = {
            (r["id"], r["error"] is None): (r.get("output_token_ids"), r["error"]) for r in written
        }
        if ordered:
            assert admitted == sorted(admitted, reverse=True) and len(admitted) == 11, admitted
        else:
            assert admitted != sorted(admitted, reverse=True)
    assert runs[True] == runs[False]
    ok = {k[0]: out for k, (out, err) in runs[True].items() if err is None}
    assert {i: len(ok[f"r{i}"]) for i in range(12) if i != 6} == {
        i: n or 6 for i, n in enumerate(lengths) if i != 6
    }


def test_longest_first_fills_decode_steps(monkeypatch, tokenizer):
    """8 rows in flight, 24 rows of 2..24 tokens: longest first needs fewer, fuller decode steps."""

    class Counting(FakeEngine):
        def step(self):
            self.sizes.append(len(self.live))
            return super().step()

    rng = random.Random(0)
    lengths = [rng.randint(2, 24) for _ in range(24)]
    steps = {}
    for ordered in (False, True):
        engine = Counting(rows=8)
        engine.sizes = []
        written: list[dict] = []
        _loop(engine, _rows(lengths), 24, ordered, monkeypatch, written)
        assert sorted(len(r["output_token_ids"]) for r in written) == sorted(lengths)
        steps[ordered] = engine.sizes
    mean = {k: sum(v) / len(v) for k, v in steps.items()}
    assert len(steps[True]) < len(steps[False]) and mean[True] > mean[False], mean
    # every token after the first (made by the prefill) takes a slot of a decode step: with all 8 slots busy on every
    # step the job takes `best` steps; longest first comes within 2 of it (39 of 37), source order takes 45
    best = -(-(sum(lengths) - len(lengths)) // 8)
    assert len(steps[True]) <= best + 2 < len(steps[False])


def test_a_resumed_job_with_own_lengths_writes_every_row_once(tmp_path):
    """A job (3 rows in flight) stopped at its 6th admission, then resumed: the longest rows ran first, and every
    row is written once, each with its own length."""
    lengths = [3, 8, 1, 5, 8, 2, 7, 4, 6, 2]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}", "max_new_tokens": n}) + "\n"
                           for i, n in enumerate(lengths)))  # fmt: skip
    job = load_job(REPO / "jobs/demo.yaml", ["data.format=jsonl", f"data.path={src}",
                                              f"output.dir={tmp_path / 'run'}", "output.rows_per_part=1"])  # fmt: skip

    one_row_batches = stopped_at_admission(6, rows=3)

    with pytest.raises(BaseException):  # noqa: B017 - however an interrupt surfaces, the job stops
        run_job(job, engine_factory=one_row_batches)
    first = read_rows(job.output.dir).to_pylist()
    # the three longest ran first (in source order the first rows done would have been q2 and q0, 1 and 3 tokens)
    assert sorted(r["id"] for r in first) == ["q1", "q4", "q6"]
    s = run_job(job, engine_factory=one_row_batches)
    rows = read_rows(job.output.dir).to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(10))
    assert all(len(r["output_token_ids"]) == lengths[int(r["id"][1:])] for r in rows)
    assert s["successful_requests"] == 10
    assert read_manifest(job.output.dir)["runs"][-1]["counts"][0]["skipped"] == 3
