"""Continuous batching: the engine's sequences in flight over the paged KV pool, against a plain greedy loop that
recomputes every token without a cache; retirement, stop tokens, shared prefix blocks, admission budgets."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import IMG_CONTEXT_ID

from batchvl.engine import Engine, Request, Sampling
from batchvl.job import EngineSpec
from batchvl.model.loader import random_model
from batchvl.ops.prefill_attention import AttnMeta
from batchvl.scheduler import next_batch

SYSTEM = list(range(100, 140))
GREEDY = Sampling(max_new_tokens=6, ignore_eos=True)


def _model():
    model, cfg = random_model("tiny-6b-style", seed=0)
    with (
        torch.no_grad()
    ):  # a larger logit scale makes greedy margins wide, so token comparisons mean something
        model.llm.lm_head.weight.mul_(20)
    return model, cfg


def _request(
    image_seed: int | None, question: list[int], sampling: Sampling = GREEDY, tiles: int = 1
) -> Request:
    if image_seed is None:
        return Request(torch.tensor(SYSTEM + question), sampling=sampling)
    pv = torch.randn(tiles, 3, 448, 448, generator=torch.Generator().manual_seed(image_seed))
    ids = SYSTEM + [151665] + [IMG_CONTEXT_ID] * (256 * tiles) + [151666, 198] + question
    return Request(torch.tensor(ids), pv, image_key=f"img{image_seed}", sampling=sampling)


def _questions(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 150000, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def reference_greedy(model, r: Request) -> list[int]:
    """The plain path: every step runs the whole sequence through the eager model, no KV cache, SDPA."""
    feats = model.encode_images(r.pixel_values) if r.pixel_values is not None else None
    ids = r.input_ids.tolist()
    out = []
    for _ in range(r.sampling.max_new_tokens):
        t = torch.tensor(ids + out)
        n = t.shape[0]
        meta = AttnMeta(
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n, slot_b=t, slot_pos=t
        )
        h = model.llm(model.embed(t, feats), torch.arange(n), meta, None)
        out.append(int(model.llm.logits(h[-1:]).argmax(-1)))
        if out[-1] in r.sampling.stop_token_ids:
            break
    return out


def test_sequences_in_flight_equal_the_plain_greedy_loop():
    """Rows admitted in two batches while others decode, with their own lengths, equal the cache-free loop."""
    model, cfg = _model()
    q = _questions(5, 9, 1, 14, 7)
    lengths = [6, 2, 9, 1, 4]
    reqs = [
        _request(s, qq, replace(GREEDY, max_new_tokens=m)) for s, qq, m in zip([1, 1, 2, None, 3], q, lengths)
    ]
    want = [reference_greedy(model, r) for r in reqs]
    eng = Engine(model, cfg, EngineSpec(), max_seq_len=1024, pool_blocks=64)
    for i, r in enumerate(reqs):
        r.handle = i
    got = {f.handle: f for f in eng.admit(reqs[:3])}
    got |= {f.handle: f for f in eng.step()}
    got |= {f.handle: f for f in eng.admit(reqs[3:])}  # joins the two sequences still in flight
    while eng.active:
        got |= {f.handle: f for f in eng.step()}
    assert [got[i].output_ids for i in range(5)] == want
    assert [len(got[i].output_ids) for i in range(5)] == lengths
    assert got[3].done_s < got[2].done_s  # the one-token row retired first, on its own
    assert eng.pool.free == eng.pool.num_blocks - 1  # every block back (block 0 is scratch)


def test_rows_left_in_high_rows_move_down_and_decode_in_a_smaller_bucket():
    """When rows retire, the sequences left in the high rows move to the free low ones (block-table rows with them)
    so a step decodes as many rows as are live: a tail of long rows decodes in the small bucket, tokens unchanged."""
    model, cfg = _model()
    q = _questions(*range(3, 15))
    lengths = [2] * 9 + [7, 2, 5]  # rows 9 and 11 outlive the others
    reqs = [_request(None, qq, replace(GREEDY, max_new_tokens=m)) for qq, m in zip(q, lengths, strict=True)]
    want = [reference_greedy(model, r) for r in reqs]
    eng = Engine(model, cfg, EngineSpec(), max_seq_len=1024, pool_blocks=64)
    steps = []
    decode = eng.decode_step
    eng.decode_step = lambda tok, *a: steps.append(tok.shape[0]) or decode(tok, *a)
    eng.decode_step.graphs = decode.graphs
    got = eng.generate(reqs)
    assert [f.output_ids for f in got] == want
    assert steps == [12] + [2] * 3 + [1] * 2  # 12 live rows, then rows 9 and 11 in rows 0 and 1, then one
    assert eng.pool.free == eng.pool.num_blocks - 1 and not eng.tables.any()


def test_a_stop_token_ends_its_row_at_that_step():
    model, cfg = _model()
    r = _request(1, _questions(6)[0], replace(GREEDY, max_new_tokens=8))
    free_run = reference_greedy(model, r)
    k = next(i for i in range(2, 8) if free_run[i] not in free_run[:i])  # a token first produced at step k
    eng = Engine(model, cfg, max_seq_len=1024, pool_blocks=32)
    stopped = replace(r, sampling=replace(r.sampling, stop_token_ids=(free_run[k],)))
    done = eng.generate([stopped])[0]
    assert done.output_ids == free_run[: k + 1] and done.finish_reason == "stop"
    done = eng.generate([r])[0]
    assert done.output_ids == free_run and done.finish_reason == "length"


def test_shared_prefix_blocks_are_read_by_several_rows_and_freed():
    model, cfg = _model()
    q = _questions(5, 9, 3)
    reqs = [_request(7, qq) for qq in q]
    want = [reference_greedy(model, r) for r in reqs]
    eng = Engine(model, cfg, EngineSpec(prefix_cache=True), max_seq_len=1024, pool_blocks=64)
    first = eng.generate(reqs[:1])  # fills the prefix cache: 40 + 1 + 256 tokens, 4 full blocks of 64
    held = eng.pool.num_blocks - 1 - eng.pool.free
    assert first[0].output_ids == want[0] and held == 4
    for i, r in enumerate(reqs):
        r.handle = i
    hashed, key_of = [], eng._prefix_key
    eng._prefix_key = lambda r: hashed.append(r.handle) or key_of(r)
    assert [eng.needs_vit(r) for r in reqs[1:]] == [False, False]  # (a scheduling pass asks this, and more)
    eng.admit(reqs[1:])
    assert hashed == [1, 2]  # each request's prefix hashed once, however often it was asked for
    shared = eng.prefix_cache[next(iter(eng.prefix_cache))][0]
    assert all(eng.pool.refs[b] == 3 for b in shared)  # the cache and both rows in flight
    done = []
    while eng.active:
        done += eng.step()
    done.sort(key=lambda f: f.handle)
    assert [f.output_ids for f in done] == want[1:]
    assert [f.cached_prefix_tokens for f in done] == [256, 256] and eng.counters["prefix_cache_hits"] == 2
    assert all(eng.pool.refs[b] == 1 for b in shared)
    eng.drop_caches()
    assert eng.pool.free == eng.pool.num_blocks - 1


def test_image_cache_and_prefix_cache_equal_no_cache():
    model, cfg = _model()
    q = _questions(5, 9, 1, 14)
    reqs = lambda: [_request(1, q[0]), _request(1, q[1]), _request(2, q[2], tiles=2), _request(None, q[3])]  # noqa: E731
    plain = [f.output_ids for f in Engine(model, cfg, max_seq_len=2048, pool_blocks=128).generate(reqs())]
    cached = Engine(
        model, cfg, EngineSpec(image_cache=True, prefix_cache=True), max_seq_len=2048, pool_blocks=128
    )
    assert [f.output_ids for f in cached.generate(reqs())] == plain
    again = cached.generate(reqs())  # now from the caches
    assert [f.output_ids for f in again] == plain
    assert [f.cached_prefix_tokens for f in again] == [256, 256, 512, 0]


def test_admission_counts_only_uncached_work_and_free_room():
    model, cfg = _model()
    eng = Engine(
        model, cfg, EngineSpec(image_cache=True, prefix_cache=True), max_seq_len=2048, pool_blocks=64
    )
    q = _questions(5, 9, 1, 4)
    eng.generate([_request(1, q[0])])  # image 1 and its prefix now cached
    items = deque(
        SimpleNamespace(request=r) for r in [_request(1, q[1]), _request(1, q[2]), _request(2, q[3])]
    )
    full = items[0].request.input_ids.shape[0]
    assert eng.cached_tokens(items[0].request) == 256 and not eng.needs_vit(items[0].request)
    # both cached rows count only their uncached tokens and no tiles; the new image's row brings 1 tile
    batch = next_batch(items, eng, max_tokens=2 * (full - 256) + 5, max_tiles=1)
    assert len(batch) == 2 and len(items) == 1
    assert eng.needs_vit(items[0].request)
    # blocks: a row that needs more than the pool has free waits
    small = Engine(model, cfg, max_seq_len=2048, pool_blocks=eng.blocks_needed(items[0].request))
    assert next_batch(items, small, 10**6, 10**6) == [] and len(items) == 1


def test_blocks_only_cached_prefixes_hold_go_back_when_rows_need_them():
    """A cached prefix that no row reads counts as free: rows that need its blocks are admitted and the oldest such
    prefix goes; one a row of the batch reads stays. (The cache once kept its blocks until it had 64 prefixes, and
    the loop failed a row that fit the pool as bigger than the pool.)"""
    model, cfg = _model()
    q = _questions(5, 9, 3, 4)
    reqs = [_request(s, qq) for s, qq in zip([1, 2, 3, 2], q, strict=True)]  # 5 blocks each, 4 of them prefix
    want = [reference_greedy(model, r) for r in reqs]
    eng = Engine(model, cfg, EngineSpec(prefix_cache=True), max_seq_len=1024, pool_blocks=12)
    assert [eng.generate([r])[0].output_ids for r in reqs[:2]] == want[:2]
    old, kept = eng.prefix_cache
    assert eng.pool.free == 3 and eng.spare_prefix_blocks() == {old: 4, kept: 4}
    ready = deque(SimpleNamespace(request=r) for r in reqs[2:])
    # 5 + 1 blocks (the last row reads the second prefix): 3 free and the first prefix's 4
    batch = next_batch(ready, eng, 10**6, 10**6)
    assert len(batch) == 2
    for i, it in enumerate(batch):
        it.request.handle = i
    done = eng.admit([it.request for it in batch])
    assert old not in eng.prefix_cache and kept in eng.prefix_cache and len(eng.prefix_cache) == 2
    while eng.active:
        done += eng.step()
    assert [f.output_ids for f in sorted(done, key=lambda f: f.handle)] == want[2:]
    assert [f.cached_prefix_tokens for f in sorted(done, key=lambda f: f.handle)] == [0, 256]
    eng.drop_caches()
    assert eng.pool.free == eng.pool.num_blocks - 1


def test_a_row_that_would_decode_past_the_rope_limit_is_refused_at_admission():
    """Dynamic-NTK RoPE (InternLM2.5) serves positions below max_position_embeddings only: a row whose prompt and
    max_new_tokens would reach one is refused at admission, taking nothing, and a row that ends on the last position
    served runs. (Such a row was admitted, and the step that reached the limit failed every row in flight.)"""
    model, cfg = _model()
    model.llm.rotary.max_pos = (
        200  # as rope_scaling {"type": "dynamic"} with max_position_embeddings=200 sets it
    )
    eng = Engine(model, cfg, max_seq_len=1024, pool_blocks=32)
    prompt = torch.arange(100, 290)  # 190 tokens
    fits = Request(
        prompt, sampling=replace(GREEDY, max_new_tokens=11)
    )  # its last token in is at position 199
    past = Request(prompt, sampling=replace(GREEDY, max_new_tokens=12))
    with pytest.raises(ValueError, match="max_position_embeddings=200"):
        eng.admit([fits, past])
    assert eng.active == 0 and eng.pool.free == eng.pool.num_blocks - 1
    assert len(eng.generate([fits])[0].output_ids) == 11


def test_admit_that_does_not_fit_takes_nothing():
    model, cfg = _model()
    eng = Engine(model, cfg, max_seq_len=2048, pool_blocks=4)
    r = _request(1, _questions(5)[0])
    with pytest.raises(MemoryError):
        eng.admit([r])
    assert eng.active == 0 and eng.pool.free == 3


def test_warm_up_takes_every_prefill_path_and_leaves_the_engine_as_it_was():
    """The runner's warm-up admits dummy rows (long, short, a prefix-cache hit) so that the compiled layers and both
    prefill kernels meet each path before the clock starts; afterwards no row, block, cache entry or count remains of
    them."""
    model, cfg = _model()
    eng = Engine(
        model, cfg, EngineSpec(image_cache=True, prefix_cache=True), max_seq_len=4096, pool_blocks=128
    )
    seen = []
    prefill = eng._prefill

    def spy(ids, feats, prefix_lens, rows, groups):
        seen.append(prefix_lens)
        return prefill(ids, feats, prefix_lens, rows, groups)

    eng._prefill = spy
    counters = dict(eng.counters)
    eng._warm_prefill()
    # a long row, short rows, prefixes stored, then hit
    assert [len(p) for p in seen] == [1, 2, 3, 3]
    assert [any(p) for p in seen] == [False] * 3 + [True]
    assert eng.active == 0 and eng.pool.free == eng.pool.num_blocks - 1
    assert not eng.prefix_cache and not eng.image_cache and eng.counters == counters
