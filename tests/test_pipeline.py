"""The flow with a fake engine: admission budgets, error rows, engine failures, per-row settings and timings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import BAD_ROWS, FakeEngine, assert_clock_order

from batchvl.data import SourceRow, iter_rows
from batchvl.engine import Sampling
from batchvl.job import DataSpec
from batchvl.output import PartWriter, read_rows
from batchvl.pipeline import Flow, Item, Preparer, RowLoop
from batchvl.preprocess import Prepared, PreprocessConfig, Preprocessor, load_tokenizer
from batchvl.scheduler import next_batch

PCFG = PreprocessConfig(max_tiles=2, max_input_tokens=2048, max_image_pixels=4_000_000)


def _ready(sizes: list[tuple[int, int]]):
    from collections import deque
    from types import SimpleNamespace

    from batchvl.engine import Request

    return deque(
        SimpleNamespace(
            id=i, request=Request(torch.zeros(n, dtype=torch.long), torch.zeros(t, 1) if t else None)
        )
        for i, (n, t) in enumerate(sizes)
    )


def test_admission_respects_both_budgets_in_arrival_order():
    sizes = [(300, 1), (300, 1), (500, 2), (100, 0), (2000, 5), (50, 0), (400, 1), (400, 1), (100, 3)]
    ready, eng, batches = _ready(sizes), FakeEngine(), []
    while ready:
        batches.append([it.id for it in next_batch(ready, eng, max_tokens=1000, max_tiles=4)])
    assert batches == [[0, 1], [2, 3], [4], [5, 6, 7], [8]]  # a single row over a budget runs alone
    # a batch that is exactly full goes at once
    for sizes, budget, want in (([(500, 0)] * 4, (1000, 64), [2, 2]), ([(10, 2)] * 4, (1000, 4), [2, 2]),
                                ([(10, 3)] * 3, (1000, 4), [1, 1, 1])):  # fmt: skip
        ready, got = _ready(sizes), []
        while ready:
            got.append(len(next_batch(ready, eng, *budget)))
        assert got == want
    # rows wait for the engine's free rows and KV blocks
    ready = _ready([(10, 0)] * 5)
    assert len(next_batch(ready, FakeEngine(rows=3), 1000, 4)) == 3
    assert next_batch(ready, FakeEngine(blocks=0), 1000, 4) == [] and len(ready) == 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _rows(jsonl: Path) -> list[SourceRow]:
    rows = list(iter_rows(DataSpec(format="jsonl", path=str(jsonl), allow_text_only=True)))
    img = str(jsonl.parent / "rgb.png")
    n = len(rows)
    return rows + [SourceRow(n, "boom", "xyzzy makes the engine fail", img),
                   SourceRow(n + 1, "after", "The job goes on.", img),
                   SourceRow(n + 2, "after", "The job goes on.", img, error="duplicate id")]  # fmt: skip


def run_flow(
    rows, tokenizer, out: Path, workers: int = 0, done=frozenset(), **budget
) -> tuple[list[dict], FakeEngine]:
    boom = tokenizer.encode("xyzzy", add_special_tokens=False)[0]
    engine = FakeEngine(fail_if=lambda r: bool((r.input_ids == boom).any()))
    flow = Flow(engine, Preprocessor(PCFG), lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                Sampling(max_new_tokens=3), workers=workers, prefetch=4, **budget)  # fmt: skip
    writer = PartWriter(out, rank=0, rows_per_part=5)
    counts = RowLoop(flow, writer.add, t0=0.0).run(rows, done)
    writer.close()
    table = read_rows(out).to_pylist()
    assert counts["rows"] == len(table)
    return table, engine


def test_errors_travel_as_rows_and_the_job_goes_on(bad_rows_jsonl, tokenizer, tmp_path):
    table, engine = run_flow(
        _rows(bad_rows_jsonl), tokenizer, tmp_path, max_prefill_tokens=1400, max_vit_tiles=4
    )
    by_id: dict[str, list[dict]] = {}
    for r in table:
        by_id.setdefault(r["id"], []).append(r)
    assert sorted(by_id) == sorted([*BAD_ROWS, "boom", "after"])
    assert [r["error"] for r in by_id["rgb"]] == [None, "duplicate id"]
    for rid, want in BAD_ROWS.items():
        err = by_id[rid][0]["error"]
        assert (err is None) if want is None else (err is not None and want in err), (rid, err)
    assert by_id["boom"][0]["error"] == "engine: RuntimeError: fake engine failure"
    assert [r["error"] for r in by_id["after"]] == [None, "duplicate id"]  # never the duplicate first
    # the batch holding "boom" failed as a whole, then its rows ran alone; the others still succeeded
    failed = [i for i, b in enumerate(engine.batches) if b["n"] > 1 and i + 1 < len(engine.batches)
              and engine.batches[i + 1]["n"] == 1]  # fmt: skip
    assert failed, engine.batches
    for b in engine.batches:
        assert b["n"] == 1 or (b["tokens"] <= 1400 and b["tiles"] <= 4), b
    ok = [r for r in table if r["error"] is None]
    assert len(ok) == 7
    for r in ok:
        expect = [sum(r["prompt_token_ids"]) % 1000 + k for k in range(3)]
        assert r["output_token_ids"] == expect
        assert r["output_text"] == tokenizer.decode(expect, skip_special_tokens=True)
        assert r["num_image_tokens"] + r["num_text_tokens"] == len(r["prompt_token_ids"])
        assert_clock_order(r)
        assert min(r["queue_ms"], r["preprocess_ms"], r["batch_wait_ms"]) >= 0
        assert (r["vit_ms"], r["prefill_ms"], r["decode_ms"]) == (1.0, 2.0, 3.0)
        assert r["ttft_ms"] == pytest.approx(r["t_first_token_s"] * 1e3)
        assert r["e2e_ms"] == pytest.approx(r["t_done_s"] * 1e3)
        assert r["tpot_ms"] == pytest.approx((r["t_done_s"] - r["t_first_token_s"]) * 1e3 / 2)
        assert r["cache_hit_image"] is False and r["cached_prefix_tokens"] == 0 and r["batch_id"] is not None
    assert sum(r["num_tiles"] > 0 for r in ok) == 6
    for r in table:
        if r["error"] is not None:
            assert (
                r["output_token_ids"] is None and r["t_done_s"] is not None and r["t_read_s"] <= r["t_done_s"]
            )


def test_resume_skips_done_ids(bad_rows_jsonl, tokenizer, tmp_path):
    rows = [r for r in _rows(bad_rows_jsonl) if r.id in ("grey", "text", "alpha", "corrupt")]
    table, _ = run_flow(rows, tokenizer, tmp_path, done={"grey", "corrupt"})
    assert sorted(r["id"] for r in table) == ["alpha", "text"]


@pytest.mark.slow
def test_worker_pool_gives_the_same_rows(bad_rows_jsonl, tokenizer, tmp_path):
    rows = _rows(bad_rows_jsonl)
    inproc, _ = run_flow(rows, tokenizer, tmp_path / "a", max_prefill_tokens=1400, max_vit_tiles=4)
    pooled, _ = run_flow(rows, tokenizer, tmp_path / "b", workers=2, max_prefill_tokens=1400, max_vit_tiles=4)
    keys = ("id", "error", "prompt_token_ids", "output_token_ids", "num_tiles")  # batches: as rows got ready
    rows_of = lambda table: sorted((tuple(r[k] for k in keys) for r in table), key=str)  # noqa: E731
    assert rows_of(pooled) == rows_of(inproc)
    # an id's duplicate is never written before its first occurrence (a resume would skip the first for good)
    assert [r["error"] for r in pooled if r["id"] == "rgb"] == [None, "duplicate id"]
    for r in pooled:
        if r["error"] is None:
            assert r["t_read_s"] <= r["t_prepared_s"] <= r["t_batch_start_s"] <= r["t_first_token_s"]


def test_pixel_values_reach_the_engine_as_tensors(bad_rows_jsonl, tokenizer, tmp_path):
    seen = []

    class Spy(FakeEngine):
        def admit(self, requests):
            seen.extend(requests)
            return super().admit(requests)

    rows = [r for r in _rows(bad_rows_jsonl) if r.id in ("rgb", "text")][:2]
    flow = Flow(Spy(), Preprocessor(PCFG), str, Sampling(max_new_tokens=2))
    RowLoop(flow, lambda row: None, t0=0.0).run(rows)
    assert [r.input_ids.dtype for r in seen] == [torch.int64, torch.int64]
    assert (
        seen[0].pixel_values.shape[1:] == (448, 448, 3)  # raw tiles: the engine normalizes them
        and seen[0].pixel_values.dtype == torch.uint8
        and seen[0].image_key
        and seen[1].pixel_values is None
    )


class DyingPreprocessor:
    """Kills its worker process on the prompt 'die' (a decoder crash); otherwise a fixed text-only row."""

    def __call__(self, prompt, image, cached=()):
        import os

        if prompt == "die":
            os._exit(3)
        return Prepared([1, 2, 3, len(prompt)], None, 0, 0, 4, None)


@pytest.mark.slow
def test_a_row_that_kills_its_worker_becomes_an_error_row(tmp_path):
    rows = [SourceRow(i, p, p) for i, p in enumerate(["a", "bb", "die", "ccc", "dddd"])]
    rows.append(SourceRow(5, "a", "a", error="duplicate id"))
    written: list[dict] = []
    flow = Flow(FakeEngine(), DyingPreprocessor(), str, Sampling(max_new_tokens=1), workers=1, prefetch=8)
    counts = RowLoop(flow, written.append, t0=0.0).run(rows)
    assert [(r["id"], r["error"]) for r in written if r["error"]] == [
        ("die", "preprocess worker died on this row"), ("a", "duplicate id")
    ]  # fmt: skip
    assert sorted(r["id"] for r in written if not r["error"]) == ["a", "bb", "ccc", "dddd"]
    assert counts["rows"] == 6


def test_runner_uses_the_preparer_started_early():
    class Counting(Preparer):
        submitted = 0

        def submit(self, item, cached=()):
            Counting.submitted += 1
            super().submit(item, cached)

    pre = DyingPreprocessor()
    rows = [SourceRow(i, str(i), "q" * (i + 1)) for i in range(3)]
    flow = Flow(FakeEngine(), pre, str, Sampling(max_new_tokens=1))
    written: list[dict] = []
    RowLoop(flow, written.append, t0=0.0).run(rows, prep=Counting(pre, 0, 4))  # an idle Preparer is falsy
    assert Counting.submitted == 3 and len(written) == 3


class FailingAdmit:
    """The real engine, with admission failing for any batch holding token `bad` (its rows are then retried alone)."""

    def __init__(self, engine, bad: int):
        self.engine, self.bad, self.failures = engine, bad, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def admit(self, requests):
        if len(requests) > 1 and any(bool((r.input_ids == self.bad).any()) for r in requests):
            self.failures += 1
            raise RuntimeError("prefill failure")
        return self.engine.admit(requests)


def test_real_engine_rows_survive_a_failed_admission(bad_rows_jsonl, tokenizer, tmp_path):
    """The real engine through the flow (rows admitted while others decode, each with its own length); a batch whose
    admission fails has its rows retried one by one, and every row comes out as without the failure."""
    from batchvl.engine import Engine
    from batchvl.model.loader import random_model

    model, cfg = random_model("tiny-qwen2", seed=0)
    rows = [r for r in _rows(bad_rows_jsonl) if r.id not in ("boom",) and r.error is None]
    for i, r in enumerate(rows):
        r.generation = {"max_new_tokens": 1 + i % 3}

    def run(engine, out):
        flow = Flow(engine, Preprocessor(PCFG), lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                    Sampling(max_new_tokens=3, ignore_eos=True), max_prefill_tokens=1200, max_vit_tiles=4)  # fmt: skip
        writer = PartWriter(out, rank=0, rows_per_part=100)
        RowLoop(flow, writer.add, t0=0.0).run(rows)
        writer.close()
        return {r["id"]: (r["output_token_ids"], r["error"]) for r in read_rows(out).to_pylist()}

    plain = run(Engine(model, cfg, max_seq_len=4096, pool_blocks=200), tmp_path / "plain")
    assert sum(err is None for _, err in plain.values()) >= 4
    assert all(err or len(out) == 1 + i % 3 for i, (out, err) in enumerate(plain[r.id] for r in rows))
    bad = tokenizer.encode("The job goes on.", add_special_tokens=False)[0]
    flaky = FailingAdmit(Engine(model, cfg, max_seq_len=4096, pool_blocks=200), bad)
    assert run(flaky, tmp_path / "failing") == plain and flaky.failures >= 1


def test_a_rows_own_generation_settings(tokenizer, tmp_path):
    """max_new_tokens, temperature and stop columns override the job's for their row; bad values are error rows."""
    rows = [SourceRow(i, str(i), "hello there", generation=g) for i, g in enumerate([
        None, {"max_new_tokens": 1}, {"max_new_tokens": 5}, {"max_new_tokens": 6}, {"max_new_tokens": 0},
        {"max_new_tokens": 2.0}, {"temperature": -1}, {"temperature": "hot"}, {"stop": ["<|im_end|>", 7]},
        {"stop": "not one token"}, {"max_new_tokens": True}, {"max_new_tokens": 4},
    ])]  # fmt: skip
    seen = {}

    class Spy(FakeEngine):
        def admit(self, requests):
            seen.update({r.handle.row.id: r.sampling for r in requests})
            return super().admit(requests)

        def check_positions(self, r):  # as a RoPE limit at prompt + 4 new tokens would
            if r.sampling.max_new_tokens == 4:
                raise ValueError("prompt + max_new_tokens (4) pass max_position_embeddings")

    written: list[dict] = []
    flow = Flow(Spy(), Preprocessor(PCFG), str, Sampling(max_new_tokens=5, stop_token_ids=(3,)),
                token_id=lambda text: tokenizer.convert_tokens_to_ids(text) if text == "<|im_end|>" else None)  # fmt: skip
    RowLoop(flow, written.append, t0=0.0).run(rows)
    by_id = {r["id"]: r for r in written}
    assert {k: len(by_id[k]["output_token_ids"]) for k in ("0", "1", "2", "5")} == {
        "0": 5,
        "1": 1,
        "2": 5,
        "5": 2,
    }
    for k, why in (("3", "max_new_tokens"), ("4", "max_new_tokens"), ("6", "temperature"), ("7", "temperature"),
                   ("9", "stop"), ("10", "max_new_tokens"), ("11", "prompt + max_new_tokens")):  # fmt: skip
        err = by_id[k]["error"]
        assert err.startswith(why) and "output_token_ids" not in by_id[k], (k, err)
    assert seen["8"].stop_token_ids == (3, tokenizer.convert_tokens_to_ids("<|im_end|>"), 7)
    assert seen["0"] == Sampling(max_new_tokens=5, stop_token_ids=(3,))


def test_a_stop_token_ends_the_row_and_leaves_its_text():
    """A row that ends on a stop token says so (`finish_reason`) and its text leaves that token out, as vLLM's does;
    its token ids keep it. A row that runs to its max_new_tokens ends on "length"."""
    first = sum(Preprocessor(PCFG)("hello there", None).input_ids) % 1000  # FakeEngine: first, first + 1, ...
    rows = [
        SourceRow(0, "stops", "hello there", generation={"stop": first + 2}),
        SourceRow(1, "runs", "hello there"),
    ]
    written: list[dict] = []
    flow = Flow(
        FakeEngine(), Preprocessor(PCFG), lambda ids: " ".join(map(str, ids)), Sampling(max_new_tokens=5)
    )
    RowLoop(flow, written.append, t0=0.0).run(rows)
    by_id = {r["id"]: r for r in written}
    stops, runs = by_id["stops"], by_id["runs"]
    assert stops["output_token_ids"] == [first, first + 1, first + 2] and stops["finish_reason"] == "stop"
    assert stops["output_text"] == f"{first} {first + 1}"
    assert runs["finish_reason"] == "length" and runs["output_text"].split() == list(
        map(str, range(first, first + 5))
    )


@pytest.mark.slow
def test_pinning_preparer_gives_the_same_tiles(bad_rows_jsonl, tokenizer, monkeypatch):
    """pin=True hands the tiles over page-locked (here: a CPU build, so pin_memory is replaced by a marked copy)
    and otherwise the same rows, errors included."""
    pinned = []

    def fake_pin(t):
        pinned.append(t.shape)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    rows = [r for r in _rows(bad_rows_jsonl) if r.id in ("rgb", "text", "corrupt")]
    out = {}
    for pin in (False, True):
        prep = Preparer(Preprocessor(PCFG), 1, 4, pin=pin)
        try:
            for r in rows:
                prep.submit(Item(r, 0.0))
            out[pin] = [prep.pop() for _ in rows]
        finally:
            prep.close()
    for a, b in zip(out[False], out[True], strict=True):
        assert a.error == b.error
        pa, pb = (x.prepared.pixel_values if x.prepared else None for x in (a, b))
        assert (pa is None) == (pb is None)
        if pa is not None:
            assert isinstance(pb, torch.Tensor) and torch.equal(pa, pb)
    assert (
        len(pinned)
        == sum(x.prepared is not None and x.prepared.pixel_values is not None for x in out[True])
        > 0
    )


@pytest.mark.slow
def test_lockstep_admission_does_not_depend_on_when_rows_get_ready(tokenizer):
    """Ranks of a tensor-parallel group must admit the same batches: in lockstep the batches are those of an
    in-process preparer, whatever the worker pool's timing."""
    rows = [SourceRow(i, str(i), "q" * (1 + i % 7)) for i in range(40)]
    batches = []
    for workers in (0, 2):
        engine = FakeEngine(rows=6)
        flow = Flow(engine, DyingPreprocessor(), str, Sampling(max_new_tokens=3), max_prefill_tokens=20,
                    workers=workers, prefetch=8, lockstep=True)  # fmt: skip
        written: list[dict] = []
        RowLoop(flow, written.append, t0=0.0).run(rows)
        assert len(written) == 40
        batches.append([b["n"] for b in engine.batches])
    assert batches[0] == batches[1]


def test_pool_limit_hands_out_only_lower_blocks():
    from batchvl.llm.kv_cache import KVPool

    pool = KVPool(1, 10, 1, 16, "cpu", torch.float32)
    pool.limit(4)
    assert pool.free == 3 and max(pool.allocate(3)) < 4


def test_rows_whose_image_the_engine_holds_send_no_tiles(bad_rows_jsonl, tokenizer, tmp_path):
    """With the image cache on, rows asking about an image the engine already holds are prepared without tiles (4.2
    MB per tiger row no longer cross from the workers); a row whose image left the cache before its admission is
    prepared again with its tiles. Every row comes out as with the image cache off."""
    from batchvl.engine import Engine
    from batchvl.job import EngineSpec
    from batchvl.model.loader import random_model

    model, cfg = random_model("tiny-qwen2", seed=0)
    d = bad_rows_jsonl.parent
    images = [str(d / "rgb.png"), str(d / "grey.png")]
    rows = [SourceRow(i, f"r{i}", f"Question {i} about it?", images[i % 5 == 4]) for i in range(16)]
    seen: list = []
    prepared: list = []

    class Counting(Preprocessor):
        def __call__(self, prompt, image, cached=()):
            prepared.append(prompt)
            return super().__call__(prompt, image, cached)

    class Spy(Engine):
        forget = False

        sent_tileless = False

        def admit(self, requests, logits_out=None):
            seen.extend(requests)
            done = super().admit(requests, logits_out)
            # this admission evicts every image, after rows were sent to be prepared without tiles
            if self.forget and self.sent_tileless:
                self.image_cache.clear()
                self.sent_tileless = False
            return done

        def cached_images(self):
            keys = super().cached_images()
            self.sent_tileless |= bool(keys)
            return keys

    def run(engine, out):
        seen.clear()
        prepared.clear()
        flow = Flow(engine, Counting(PCFG), lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                    Sampling(max_new_tokens=3, ignore_eos=True), max_prefill_tokens=1200, max_vit_tiles=4,
                    prefetch=16)  # fmt: skip
        writer = PartWriter(out, rank=0, rows_per_part=100)
        RowLoop(flow, writer.add, t0=0.0).run(rows)
        writer.close()
        return {r["id"]: (r["output_token_ids"], r["error"]) for r in read_rows(out).to_pylist()}

    def engine(image_cache: bool) -> Spy:
        return Spy(model, cfg, EngineSpec(image_cache=image_cache), max_seq_len=4096, pool_blocks=200)

    plain = run(engine(False), tmp_path / "plain")
    assert len(plain) == 16 and all(err is None for _, err in plain.values())
    assert all(r.pixel_values is not None for r in seen)
    assert run(engine(True), tmp_path / "cached") == plain
    assert len(prepared) == 16
    tileless = [r.image_key for r in seen if r.pixel_values is None]
    # the job's first 4 rows (FIRST_ROWS) are taken before the first admission, with their tiles; every later rgb
    # row comes without tiles, and the 3 grey rows (taken before grey was first admitted) with theirs
    assert len(tileless) == 9 and set(tileless) <= {r.image_key for r in seen if r.pixel_values is not None}
    forgetful = engine(True)
    forgetful.forget = True
    assert run(forgetful, tmp_path / "evicted") == plain
    assert len(seen) == 16 and len(prepared) > 16  # rows that lost their image were prepared again


def _one_image_row(prompt, image, cached=()):
    """A worker's row: text only, or one tile of the image "K" (none when the engine holds it)."""
    if image is None:
        return Prepared([1, 2, 3, len(prompt)], None, 0, 0, 4, None)
    tiles = None if "K" in cached else torch.zeros(1, 4, 4, 3, dtype=torch.uint8)
    return Prepared([1, 2, 3, len(prompt)], tiles, 1, 0, 4, "K", (("K", 1),))


def test_error_rows_waiting_behind_a_row_prepared_again_lose_no_row():
    """A row prepared again (its image left the engine's cache) holds back the error rows behind it; with `prefetch`
    of them waiting, the loop still takes that row back from the preparer and every row is written. (It once stopped
    taking rows, found nothing ready and the engine idle, and ended as if the job were done, 10 rows unwritten.)"""

    class Forgetful(FakeEngine):
        def cached_images(self):
            return frozenset({"K"})

        def needs_vit(self, r):  # the image the row was prepared without has been evicted since
            return r.pixel_values is not None or bool(r.images)

    def row(i, own=None, image=None, error=None):
        return SourceRow(i, f"r{i}", "p", image=image, error=error, generation=own)

    rows = [row(0), row(1, {"max_new_tokens": 40}, image="x")] + [row(i, error="bad") for i in (2, 3, 4)]
    rows += [row(5, {"max_new_tokens": 30}), row(6, {"max_new_tokens": 20}), row(7, {"max_new_tokens": 10})]
    rows += [row(i, error="bad") for i in range(8, 12)]
    written: list[dict] = []
    flow = Flow(Forgetful(rows=1), _one_image_row, str, Sampling(max_new_tokens=50), workers=1, prefetch=4)
    counts = RowLoop(flow, written.append, t0=0.0).run(rows)
    assert sorted(int(r["id"][1:]) for r in written) == list(range(12))
    assert counts["rows"] == 12 and not counts.get("interrupted")


@pytest.mark.slow
def test_workers_prepare_the_next_batch_while_the_engine_prefills():
    """Rows are handed to the workers before a batch's prefill, not after it: while a long prefill runs they prepare
    the next full batch. (Handed over only after it, the next pass found the few rows left over ready and admitted
    them alone: the 38B caches job ran batches of 125, 3, 125, 3 rows.)"""

    class SlowPrefill(FakeEngine):
        def admit(self, requests):
            import time

            time.sleep(0.4)  # a GPU prefill: long beside a row's preparation
            return super().admit(requests)

    rows = [SourceRow(i, str(i), "q" * (1 + i % 5)) for i in range(44)]
    engine = SlowPrefill(rows=64)
    flow = Flow(engine, DyingPreprocessor(), str, Sampling(max_new_tokens=2), max_prefill_tokens=1000,
                workers=2, prefetch=8)  # fmt: skip
    written: list[dict] = []
    RowLoop(flow, written.append, t0=0.0).run(rows)
    assert sorted(int(r["id"]) for r in written) == list(range(44))
    sizes = [b["n"] for b in engine.batches]
    assert sum(sizes) == 44
    # the first batches start while the workers start; from the third on every batch is a full prefetch
    assert all(n == 8 for n in sizes[2:-1]), sizes


def test_closing_the_workers_is_quick():
    """A job's clock runs until its workers are stopped: they are killed, not left to exit their interpreters (1-2 s
    with four workers here, about 1 s of a 15 s GPU job)."""
    prep = Preparer(Preprocessor(PCFG), 2, 4)
    prep.wait_warm()
    procs = list(prep.pool._processes.values())
    t = time.perf_counter()
    prep.close()
    assert time.perf_counter() - t < 0.5
    assert prep.pool is None and not any(p.is_alive() for p in procs)
