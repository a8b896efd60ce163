"""The engine's fast paths (batching, image-embedding cache, shared-prefix cache) against the plain path."""

from __future__ import annotations

import pytest
import torch
from conftest import IMG_CONTEXT_ID

from batchvl.engine import Engine, EngineConfig, Request, Sampling
from batchvl.model.loader import random_model

SYSTEM = list(range(100, 130))


def _request(image_seed: int, question: list[int], tiles: int = 1) -> Request:
    pv = torch.randn(tiles, 3, 448, 448, generator=torch.Generator().manual_seed(image_seed))
    ids = SYSTEM + [151665] + [IMG_CONTEXT_ID] * (256 * tiles) + [151666, 198] + question
    return Request(torch.tensor(ids), pv, image_key=f"img{image_seed}")


def _requests():
    g = torch.Generator().manual_seed(0)
    q = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (5, 9, 1, 14, 7)]
    # the same image in rows 0, 1, 3 (and twice in one batch); another in 2; a text-only row
    reqs = [_request(1, q[0]), _request(1, q[1]), _request(2, q[2], tiles=2), _request(1, q[3])]
    reqs.append(Request(torch.tensor(SYSTEM + q[4])))
    return reqs


def _model():
    model, cfg = random_model("tiny-6b-style", seed=0)
    # a larger logit scale makes greedy margins wide, so the token comparison is meaningful
    with torch.no_grad():
        model.llm.lm_head.weight.mul_(20)
    return model, cfg


def test_batch_equals_each_alone():
    model, cfg = _model()
    eng = Engine(model, cfg, EngineConfig())
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    reqs = _requests()
    batched = eng.run_batch(reqs, s).output_ids
    alone = [eng.run_batch([r], s).output_ids[0] for r in reqs]
    assert batched == alone
    assert all(len(o) == 4 for o in batched)


def test_caches_equal_no_cache():
    model, cfg = _model()
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    reqs = _requests()
    plain = Engine(model, cfg, EngineConfig()).run_batch(reqs, s)
    cached = Engine(model, cfg, EngineConfig(image_cache=True, prefix_cache=True))
    first = cached.run_batch(reqs, s)
    again = cached.run_batch(reqs, s)  # everything now comes from the caches
    assert first.output_ids == plain.output_ids == again.output_ids
    assert again.stats["cache_hit_image"] == [True, True, True, True, False]
    assert first.stats["cache_hit_image"] == [False, True, False, True, False]
    p = 30 + 1 + 256
    assert again.stats["cached_prefix_tokens"] == [p, p, 30 + 1 + 512, p, 0]
    assert cached.counters["prefix_cache_hits"] == 8


def test_prefix_cache_logits_close_to_full_prefill():
    """Tokens equal is weak evidence; compare the first-token logits too."""
    model, cfg = _model()
    reqs = _requests()[:3]
    plain = Engine(model, cfg, EngineConfig())
    cached = Engine(model, cfg, EngineConfig(prefix_cache=True))
    with torch.inference_mode():
        feats, _ = plain.encode(reqs)
        a, _ = plain._prefill([r.input_ids for r in reqs], feats, [0] * 3, None, extra=0)
        ids, f2, plens, pref = cached._use_prefix_cache(reqs, feats)
        b, _ = cached._prefill(ids, f2, plens, pref, extra=0)
    assert all(p > 0 for p in plens)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_eos_stops_unless_ignored():
    model, cfg = _model()
    eng = Engine(model, cfg, EngineConfig())
    r = _requests()[:1]
    free = eng.run_batch(r, Sampling(max_new_tokens=6, ignore_eos=True)).output_ids[0]
    eng.eos = (free[1],)
    stopped = eng.run_batch(r, Sampling(max_new_tokens=6)).output_ids[0]
    assert stopped == free[:2]
    assert eng.run_batch(r, Sampling(max_new_tokens=6, ignore_eos=True)).output_ids[0] == free


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["auto", "cudnn", "auto-hopper"])
def test_compiled_llm_equals_eager(attn: str, monkeypatch):
    """Regional torch.compile of the decoder layers: same tokens and logits as eager, over two batch shapes
    (with "cudnn", the per-sequence attention custom op is traced as one node; "auto-hopper": "auto" as on an
    H200, with the length threshold set so the first batch goes per sequence and the second does not)."""
    model, cfg = _model()
    s = Sampling(max_new_tokens=3, ignore_eos=True)
    reqs = _requests()
    mean = [sum(len(r.input_ids) for r in b) / len(b) for b in (reqs[:2], reqs[2:], reqs)]
    assert mean[0] > mean[1] and mean[0] > mean[2]
    monkeypatch.setattr("batchvl.engine.PER_SEQ_MIN_MEAN", mean[0])
    from batchvl.llm import attention

    # sdpa_context is entered once per call of the per-sequence op, at run time (the op is opaque to Dynamo)
    per_seq_calls, ctx = [], attention.sdpa_context
    monkeypatch.setattr(attention, "sdpa_context", lambda *a: per_seq_calls.append(a[0]) or ctx(*a))
    eager = Engine(model, cfg, EngineConfig())
    want = [eager.run_batch(reqs[:2], s).output_ids, eager.run_batch(reqs[2:], s).output_ids]
    with torch.inference_mode():
        feats, _ = eager.encode(reqs)
        ref, _ = eager._prefill([r.input_ids for r in reqs], feats, [0] * 5, None, extra=0)
    fast = Engine(model, cfg, EngineConfig(compile_llm=True, attn_backend=attn.removesuffix("-hopper")))
    fast.cudnn_prefill = attn == "auto-hopper"
    got = [fast.run_batch(reqs[:2], s).output_ids, fast.run_batch(reqs[2:], s).output_ids]
    with torch.inference_mode():
        out, _ = fast._prefill([r.input_ids for r in reqs], feats, [0] * 5, None, extra=0)
    layers = cfg.llm.num_layers
    # the prefills only: two batches and the whole set for "cudnn"; the first batch for "auto-hopper"; every layer
    # but the last (its queries are the last tokens alone: `Decoder.forward(last=...)`, decode attention)
    assert len(per_seq_calls) == {"auto": 0, "cudnn": 3 * (layers - 1), "auto-hopper": layers - 1}[attn]
    for layer in model.llm.layers:  # leave the shared model eager for other tests
        layer._compiled_call_impl = None
        layer.attn.backend = "auto"
    model.llm.compiled_last = None
    assert got == want
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_batch_bytes_grows_with_the_budget_and_counts_the_kv_cache():
    model, cfg = _model()
    eng = Engine(model, cfg, EngineConfig())
    from batchvl.llm.kv_cache import KVCache

    kv = KVCache.bytes_per_token(cfg.llm.num_layers, cfg.llm.num_kv_heads, cfg.llm.head_dim, torch.float32)
    a, b = eng.batch_bytes(4096, 4), eng.batch_bytes(8192, 4)
    assert b > a >= 4096 * kv
    eng.check_memory(10**9, 4)  # CPU: nothing to check, no error


def test_prefix_cache_never_shares_between_images_without_a_key():
    """Two different images with the same prompt and no content key must not share a cached prefix."""
    model, cfg = _model()
    a, b = _request(1, [5, 6, 7]), _request(2, [5, 6, 7])
    a.image_key = b.image_key = None
    s = Sampling(max_new_tokens=3, ignore_eos=True)
    plain = Engine(model, cfg).run_batch([a, b], s)
    cached = Engine(model, cfg, EngineConfig(prefix_cache=True, image_cache=True)).run_batch([a, b], s)
    assert cached.output_ids == plain.output_ids
    assert cached.stats["cached_prefix_tokens"] == [0, 0]


def test_rows_that_stop_early_finish_early():
    model, cfg = _model()
    eng = Engine(model, cfg, EngineConfig())
    reqs = _requests()[:2]
    free = eng.run_batch(reqs, Sampling(max_new_tokens=5, ignore_eos=True)).output_ids
    eng.eos = (free[0][1],)  # row 0 stops at its second token
    res = eng.run_batch(reqs, Sampling(max_new_tokens=5))
    assert res.output_ids[0] == free[0][:2]
    done = res.stats["done_s"]
    assert res.first_token_s <= done[0] <= res.end_s and done[1] <= res.end_s
    if len(res.output_ids[1]) == 5:
        assert done[0] <= done[1]


def test_padded_decode_rows_and_reused_arena_equal_plain():
    """The decode-graph layout (rows padded to 8, lengths to 128, one arena reused by every batch) on CPU, where
    the same step runs eagerly: same tokens and the same last logits as the exact-size per-batch cache."""
    from batchvl.llm.decode_step import decode_forward

    model, cfg = _model()
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    reqs = _requests()
    plain = Engine(model, cfg, EngineConfig())
    want = plain.run_batch(reqs, s).output_ids
    padded = Engine(model, cfg, EngineConfig())
    padded.row_multiple, padded.len_multiple = 8, 128
    assert padded.run_batch(reqs, s).output_ids == want
    gen = padded.arena.generation
    assert padded.run_batch(reqs[2:4], s).output_ids == plain.run_batch(reqs[2:4], s).output_ids
    assert padded.run_batch(reqs, s).output_ids == want  # stale values of the previous batches are cleared
    assert padded.arena.generation == gen  # smaller batches reuse the buffers

    # one decode step's logits, padded vs exact
    pa, pb = (e.prefill(reqs, s) for e in (plain, padded))
    assert pa.cache.rows == 5 and pb.cache.rows == 8 and pb.cache.max_len % 128 == 0
    with torch.inference_mode():
        la = decode_forward(model.llm, pa.tok, pa.lens, pa.cache)
        lb = decode_forward(model.llm, pb.tok, pb.lens, pb.cache)
    torch.testing.assert_close(lb[:5], la, rtol=1e-5, atol=1e-5)


def test_decode_graph_capture_failure_falls_back_to_eager(caplog):
    """A capture that fails (here: no CUDA at all) must not fail the job: the step runs eagerly from then on."""
    from batchvl.llm.decode_step import DecodeStep, decode_forward

    model, cfg = _model()
    eng = Engine(model, cfg, EngineConfig())
    p = eng.prefill(_requests(), Sampling(max_new_tokens=4, ignore_eos=True))
    step = DecodeStep(model.llm, graphs=True)
    with torch.inference_mode():
        got = step(p.tok, p.lens, p.cache)
        want = decode_forward(model.llm, p.tok, p.lens, p.cache)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not step.graphs and step.failed and step.captures == 0
    assert "decoding eagerly" in caplog.text


def test_warm_decode_visits_each_shape_once_largest_first_in_one_arena():
    """warm_decode steps once per padded (rows, length) shape, largest first, so the KV arena is allocated once and
    later batches view the same buffers (what a CUDA graph is keyed by); a batch after it decodes the same tokens.
    On CPU a recording step stands in for the CUDA-graph capture."""
    model, cfg = _model()
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    reqs = _requests()
    want = Engine(model, cfg, EngineConfig()).run_batch(reqs, s).output_ids
    eng = Engine(model, cfg, EngineConfig())
    eng.row_multiple, eng.len_multiple = 8, 128
    assert eng.warm_decode([(5, 100)], 4) == 0  # no CUDA graphs here: nothing to capture
    real, seen = eng.decode_step, []

    class Recording:
        graphs, captures = True, 0

        def __call__(self, tok, pos, cache):
            seen.append((cache.rows, cache.max_len, cache.k.data_ptr()))
            self.captures += 1
            return real(tok, pos, cache)

    eng.decode_step = Recording()
    # padded: (8, 128), (8, 384), (8, 128) again, (16, 128), and the batch below: 5 requests, longest 546
    assert eng.warm_decode([(5, 100), (3, 300), (5, 120), (9, 20), (5, 546)], max_new_tokens=4) == 4
    assert [(r, n) for r, n, _ in seen] == [(8, 640), (8, 384), (16, 128), (8, 128)]
    assert eng.arena.generation == 1 and len({ptr for *_, ptr in seen}) == 1
    eng.decode_step = real
    assert eng.run_batch(reqs, s).output_ids == want
    assert eng.arena.generation == 1  # the batch fit in the warmed arena


def test_warm_prefill_attention_only_for_the_per_sequence_backend():
    """warm_prefill_attention visits each padded window once with the per-sequence (cuDNN) prefill, and does
    nothing for the other backends; a batch after it gives the same tokens as without."""
    model, cfg = _model()
    s = Sampling(max_new_tokens=3, ignore_eos=True)
    reqs = _requests()
    assert Engine(model, cfg, EngineConfig()).warm_prefill_attention([5, 70, 130]) == 0
    want = Engine(model, cfg, EngineConfig(attn_backend="sdpa")).run_batch(reqs, s).output_ids
    eng = Engine(model, cfg, EngineConfig(attn_backend="cudnn"))
    assert eng.warm_prefill_attention([5, 70, 130, 64]) == 3  # windows 64, 128, 192
    assert eng.run_batch(reqs, s).output_ids == want


def test_auto_prefill_attention_goes_per_sequence_only_where_measured_faster(monkeypatch):
    """attn_backend "auto" on Hopper (here forced: `cudnn_prefill`) prefills with one cuDNN call per sequence when
    a batch's sequences average >= PER_SEQ_MIN_MEAN tokens, and with varlen/sdpa otherwise (many short sequences:
    per-call host cost) and after a cached prefix; the tokens equal the reference path's either way."""
    from batchvl.llm import decoder
    from batchvl.ops.prefill_attention import PER_SEQ_MIN_MEAN

    model, cfg = _model()
    s = Sampling(max_new_tokens=3, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    long = [
        _request(i, torch.randint(0, 150000, (n,), generator=g).tolist(), tiles=4)
        for i, n in ((3, 9), (4, 2))
    ]
    assert sum(len(r.input_ids) for r in long) >= PER_SEQ_MIN_MEAN * len(long)
    short = _requests()
    ref = Engine(model, cfg, EngineConfig(attn_backend="sdpa"))
    want_long, want_short = ref.run_batch(long, s).output_ids, ref.run_batch(short, s).output_ids
    calls = []
    real = decoder.prefill_per_seq
    monkeypatch.setattr(decoder, "prefill_per_seq", lambda *a, **k: calls.append(1) or real(*a, **k))
    eng = Engine(model, cfg, EngineConfig(attn_backend="auto"))
    assert not eng.cudnn_prefill  # CPU: never
    assert eng.run_batch(long, s).output_ids == want_long and not calls
    eng.cudnn_prefill = True  # as on an H200
    assert eng.run_batch(short, s).output_ids == want_short and not calls
    assert eng.run_batch(long, s).output_ids == want_long
    # one per layer but the last (its queries are the last tokens alone), for the prefill only
    assert len(calls) == cfg.llm.num_layers - 1
    assert eng.warm_prefill_attention([len(r.input_ids) for r in long]) == 1  # both in the window of 1088
    calls.clear()
    cached = Engine(model, cfg, EngineConfig(attn_backend="auto", prefix_cache=True))
    cached.cudnn_prefill = True
    cached.run_batch(long, s)
    # the new tokens after a cached prefix: varlen/sdpa
    assert cached.run_batch(long, s).output_ids == want_long
