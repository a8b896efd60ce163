"""The engine's fast paths (batching, image-embedding cache, shared-prefix cache, compiled layers, graphed decode
layout) against the plain path, and what the engine must not do (change its model)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import IMG_CONTEXT_ID

from batchvl.engine import Engine, Request, Sampling
from batchvl.job import EngineSpec
from batchvl.model.build import prepare_llm
from batchvl.model.loader import random_model
from batchvl.preprocess import pixel_input

SYSTEM = list(range(100, 130))
GREEDY = Sampling(max_new_tokens=4, ignore_eos=True)


def _request(image_seed: int, question: list[int], tiles: int = 1, sampling: Sampling = GREEDY) -> Request:
    pv = torch.randn(tiles, 3, 448, 448, generator=torch.Generator().manual_seed(image_seed))
    ids = SYSTEM + [151665] + [IMG_CONTEXT_ID] * (256 * tiles) + [151666, 198] + question
    return Request(torch.tensor(ids), pv, image_key=f"img{image_seed}", sampling=sampling)


def _requests(sampling: Sampling = GREEDY):
    g = torch.Generator().manual_seed(0)
    q = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (5, 9, 1, 14, 7)]
    # the same image in rows 0, 1, 3 (and twice in one batch); another in 2; a text-only row
    reqs = [_request(1, q[0]), _request(1, q[1]), _request(2, q[2], tiles=2), _request(1, q[3])]
    reqs.append(Request(torch.tensor(SYSTEM + q[4])))
    for r in reqs:
        r.sampling = sampling
    return reqs


def _model():
    model, cfg = random_model("tiny-6b-style", seed=0)
    # a larger logit scale makes greedy margins wide, so the token comparison is meaningful
    with torch.no_grad():
        model.llm.lm_head.weight.mul_(20)
    return model, cfg


def _engine(model, cfg, spec: EngineSpec | None = None) -> Engine:
    return Engine(model, cfg, spec, max_seq_len=2048, pool_blocks=160)


def _tokens(eng: Engine, reqs: list[Request]) -> list[list[int]]:
    return [f.output_ids for f in eng.generate(reqs)]


def test_batch_equals_each_alone():
    model, cfg = _model()
    eng = _engine(model, cfg)
    batched = _tokens(eng, _requests())
    alone = [_tokens(eng, [r])[0] for r in _requests()]
    assert batched == alone
    assert all(len(o) == 4 for o in batched)


def test_raw_uint8_tiles_equal_their_normalized_float_tiles():
    """A row's raw uint8 tiles (as preprocessing hands them over, normalized by the engine) give the same first-token
    logits and tokens as the float tiles to_pixel_values makes of them, alone and in a batch that mixes both."""
    g = torch.Generator().manual_seed(3)
    raw = [torch.randint(0, 256, (n, 448, 448, 3), dtype=torch.uint8, generator=g) for n in (2, 1)]
    model, cfg = _model()
    eng = _engine(model, cfg)

    def reqs(float_tiles: list[bool]) -> list[Request]:
        out = [_request(0, [7 + i, 8, 9], tiles=len(t)) for i, t in enumerate(raw)]
        for r, t, f in zip(out, raw, float_tiles, strict=True):
            r.pixel_values = pixel_input(t) if f else t
        return out

    want = eng.prefill_logits(reqs([True, True]))
    assert reqs([True, True])[0].pixel_values.dtype == torch.float32
    for mix in ([False, False], [False, True]):
        assert torch.equal(eng.prefill_logits(reqs(mix)), want)
    assert _tokens(eng, reqs([False, False])) == _tokens(eng, reqs([True, True]))
    unnormalized = reqs([True, True])
    unnormalized[0].pixel_values = raw[0].permute(0, 3, 1, 2).float()  # the logits do see the pixels
    assert not torch.allclose(eng.prefill_logits(unnormalized)[0], want[0])


def test_sampled_rows_do_not_depend_on_their_batch():
    """Each request samples from its own stream (its seed): batched, alone or in another order, the same tokens."""
    from batchvl.llm.sampling import row_seed

    model, cfg = _model()
    eng = _engine(model, cfg)

    def reqs(seed: int = 0):
        out = _requests(Sampling(max_new_tokens=6, temperature=30.0, ignore_eos=True))
        for i, r in enumerate(out):
            r.seed = row_seed(seed, f"row{i}")
        return out

    batched = _tokens(eng, reqs())
    assert batched == [_tokens(eng, [r])[0] for r in reqs()]
    assert _tokens(eng, reqs()[::-1]) == batched[::-1]
    assert batched != _tokens(eng, _requests(Sampling(max_new_tokens=6, ignore_eos=True)))  # it does sample
    assert batched != _tokens(eng, reqs(seed=1))


def test_prefix_cache_logits_close_to_full_prefill():
    """Tokens equal is weak evidence; compare the first-token logits too (new tokens after the shared blocks)."""
    model, cfg = _model()
    reqs = _requests()[:3]
    want = _engine(model, cfg).prefill_logits(reqs)
    cached = _engine(model, cfg, EngineSpec(prefix_cache=True))
    cached.prefill_logits(reqs)  # fills the prefix cache
    got = cached.prefill_logits(reqs)
    assert cached.counters["prefix_cache_hits"] == 3
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_packed_prefill_after_cached_prefixes_equals_the_plain_engine(monkeypatch):
    """Through the packed op as on a GPU: a batch whose rows hit two cached prefixes, interleaved with a row without
    one, is prefilled with each prefix's rows side by side (their queries read it together, `CascadePrefix`); the
    first-token logits come back in the order asked and equal the plain engine's, without caches."""
    model, cfg = _model()
    reqs = _requests()
    batch = [reqs[i] for i in (4, 2, 0, 3, 1)]  # text-only, image 2, image 1 three times
    want = _engine(model, cfg).prefill_logits(batch)
    monkeypatch.setattr("batchvl.engine.prefill_backend", lambda *a: "packed")
    eng = _engine(model, cfg, EngineSpec(prefix_cache=True))
    eng.prefill_logits(reqs[:3])  # stores the prefixes of images 1 and 2
    metas = []
    prefill = eng._prefill
    monkeypatch.setattr(eng, "_prefill", lambda *a: metas.append(a) or prefill(*a))
    got = eng.prefill_logits(batch)
    assert eng.counters["prefix_cache_hits"] == 4
    ids, feats, prefix_lens, rows, groups = metas[0]
    assert prefix_lens == [
        512,
        256,
        256,
        256,
        0,
    ]  # image 2's row (2 tiles), image 1's rows, then the text row
    assert groups[1:4] == [groups[1]] * 3 and groups[0] not in (groups[1], -1) and groups[4] == -1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_eos_stops_unless_ignored():
    model, cfg = _model()
    r = _requests(Sampling(max_new_tokens=6, ignore_eos=True))[:1]
    free = _tokens(_engine(model, cfg), r)[0]
    eng = Engine(model, cfg, eos_token_ids=(free[1],), max_seq_len=2048, pool_blocks=64)
    assert _tokens(eng, _requests(Sampling(max_new_tokens=6))[:1])[0] == free[:2]
    assert _tokens(eng, r)[0] == free


@pytest.mark.slow
def test_compiled_llm_equals_eager_and_compiles_only_at_warm_up(monkeypatch, tmp_path):
    """The LLM as the builder prepares it for CUDA (each decoder layer compiled, and the last layer's last-tokens
    path), prefill through the packed attention op as on a GPU, with the prefix cache: same tokens and logits as
    eager, over admissions of 1 to 5 rows, some after cached prefixes; and after the warm-up's dummy rows and one
    decode per row bucket, no batch compiles a graph (a lone row, a one-block row, a row count equal to a model
    dimension or a cached prefix each compiled again, at every start). A model prepared later on the same cache
    folder, as at the next start, loads those 3 graphs, traces none, and gives the same tokens."""
    from torch._dynamo.utils import counters

    from batchvl.llm.decode_step import decode_forward
    from batchvl.precompile import COUNTS

    model, cfg = _model()
    monkeypatch.setattr("batchvl.engine.prefill_backend", lambda *a: "packed")
    reqs = _requests()
    batches = [reqs[:2], reqs[2:], reqs[3:4], [Request(torch.tensor(SYSTEM[:5]), sampling=GREEDY)], reqs]
    spec = EngineSpec(prefix_cache=True)  # later batches prefill after cached prefixes, in the same graph
    eager = _engine(model, cfg, spec)
    want = [_tokens(eager, b) for b in batches]
    ref = eager.prefill_logits(reqs)

    def compiled_engine() -> Engine:
        fast_model = copy.deepcopy(model)
        prepare_llm(fast_model.llm, compile=True, cache_dir=str(tmp_path))
        fast = _engine(fast_model, cfg, spec)

        class GraphedDecode:  # as on CUDA: rows padded to a bucket, full-width tables (capturing needs CUDA)
            graphs = True

            def __call__(self, tok, pos, table, pool):
                return decode_forward(fast_model.llm, tok, pos, table, pool)

        fast.decode_step = GraphedDecode()
        with torch.inference_mode():
            fast._warm_prefill()
            for rows in (64, 32, 8):
                z = torch.zeros(rows, dtype=torch.long)
                fast.decode_step(z, z.clone(), fast.tables[:rows], fast.pool)
        return fast

    torch._dynamo.reset()
    start, loaded = int(counters["stats"]["unique_graphs"]), COUNTS["loaded"]  # (earlier tests' included)
    fast = compiled_engine()
    graphs = int(counters["stats"]["unique_graphs"])
    assert graphs - start == 3  # prefill layers, the last layer's last tokens (any row count), decode layers
    assert [_tokens(fast, b) for b in batches] == want
    assert fast.counters["prefix_cache_hits"] >= 3
    torch.testing.assert_close(fast.prefill_logits(reqs), ref, atol=1e-4, rtol=1e-4)
    assert int(counters["stats"]["unique_graphs"]) == graphs and COUNTS["loaded"] == loaded

    later = compiled_engine()  # the next start: its graphs come from tmp_path
    assert COUNTS["loaded"] - loaded == 3
    assert [_tokens(later, b) for b in batches] == want
    torch.testing.assert_close(later.prefill_logits(reqs), ref, atol=1e-4, rtol=1e-4)
    assert int(counters["stats"]["unique_graphs"]) == graphs


def test_the_engine_leaves_its_model_unchanged():
    model, cfg = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = _engine(model, cfg, EngineSpec(image_cache=True, prefix_cache=True))
    eng.generate(_requests())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.llm.compiled_layer is None and model.llm.compiled_last is None


def test_activation_estimate_grows_with_the_budget():
    model, cfg = _model()
    eng = _engine(model, cfg, EngineSpec(max_prefill_tokens=1024, max_vit_tiles=1))
    assert eng.max_prefill_tokens == 1024
    assert eng.activation_bytes(1 << 20) > eng.activation_bytes(1 << 19) > 0  # the LLM's, past the ViT's
    assert _engine(model, cfg).max_prefill_tokens == 16384  # auto, off CUDA


def test_prefix_cache_never_shares_between_images_without_a_key():
    """Two different images with the same prompt and no content key must not share a cached prefix."""
    model, cfg = _model()
    a, b = _request(1, [5, 6, 7]), _request(2, [5, 6, 7])
    a.image_key = b.image_key = None
    plain = _tokens(_engine(model, cfg), [a, b])
    cached = _engine(model, cfg, EngineSpec(prefix_cache=True, image_cache=True))
    first = cached.generate([a, b])
    again = cached.generate([a, b])
    assert [f.output_ids for f in first] == [f.output_ids for f in again] == plain
    assert [f.cached_prefix_tokens for f in again] == [0, 0] and not cached.prefix_cache


def test_decode_graph_capture_failure_falls_back_to_eager(caplog):
    """A capture that fails (here: no CUDA at all) must not fail the job: the step runs eagerly from then on."""
    from batchvl.llm.decode_step import DecodeStep, decode_forward

    model, cfg = _model()
    eng = _engine(model, cfg)
    eng.admit(_requests())
    live = [s for s in eng.rows if s is not None]
    tok = torch.tensor([s.out[-1] for s in live] + [0] * 3)
    pos = torch.tensor([s.length for s in live] + [0] * 3)
    step = DecodeStep(model.llm, graphs=True)
    with torch.inference_mode():
        got = step(tok, pos, eng.tables[:8], eng.pool)
        want = decode_forward(model.llm, tok, pos, eng.tables[:8], eng.pool)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not step.graphs and step.failed and step.captures == 0
    assert "decoding eagerly" in caplog.text
