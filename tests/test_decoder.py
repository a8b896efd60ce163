"""The LLM decoder: packed prefill, prefill + decode, InternLM2's packed wqkv, against references (fp32 CPU)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import llama_to_internlm2, tiny_hf_config

from batchvl.config import LLMConfig
from batchvl.engine import packed_meta
from batchvl.llm.decode_step import decode_forward
from batchvl.llm.decoder import Decoder
from batchvl.llm.kv_cache import KVPool, blocks_for
from batchvl.llm.sampling import row_seed, sample, sample_rows
from batchvl.model.loader import init_random, load_model
from batchvl.ops.prefill_attention import prefill_backend

TOL = dict(atol=2e-5, rtol=1e-4)
CFG = LLMConfig(arch="qwen2", vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128, rope_theta=10000.0)  # fmt: skip


def _decoder(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    d = Decoder(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 and not p.shape[0] % 64 == 1 else 0.0))
    return d.eval()


def _pool(blocks=40):
    return KVPool(2, blocks, 2, 16, "cpu", torch.float32)


def _tables(pool, lengths):
    """A block-table row per sequence, its blocks taken from `pool` (none without a pool)."""
    w = blocks_for(max(lengths))
    if pool is None:
        return torch.zeros(len(lengths), w, dtype=torch.int32)
    rows = [pool.allocate(blocks_for(n)) for n in lengths]
    return torch.tensor([r + [0] * (w - len(r)) for r in rows], dtype=torch.int32)


def _run(dec, ids_list, pool=None, prefix=None, table=None, backend="sdpa", last=False):
    lens = [len(t) for t in ids_list]
    prefix = prefix or [0] * len(lens)
    table = table if table is not None else _tables(pool, [p + n for p, n in zip(prefix, lens)])
    pos, meta = packed_meta(lens, prefix, table, backend)
    h = dec.embed_tokens(torch.cat(ids_list))
    if last:
        return dec.logits(dec(h, pos, meta, pool, last=meta.cu_seqlens[1:].long() - 1))
    return dec.logits(dec(h, pos, meta, pool))


def test_packed_prefill_equals_each_alone():
    dec = _decoder()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (7, 1, 23, 12)]
    with torch.no_grad():
        packed = _run(dec, seqs)
        alone = torch.cat([_run(dec, [s]) for s in seqs])
        into_pool = _run(dec, seqs, _pool())
    torch.testing.assert_close(packed, alone, **TOL)
    torch.testing.assert_close(into_pool, packed, **TOL)


def test_per_sequence_and_packed_attention_equal_reference():
    """backend "cudnn" (one SDPA call per sequence, GQA by enable_gqa) equals the reference, also with windows
    rounded up to PER_SEQ_ROWS that borrow the next sequence's rows (70 -> 128, 5 -> 64) and run past the end
    (130 -> 192, 3 -> 64: zero rows appended); so does "packed", the custom op that picks its kernel per call."""
    dec = _decoder()
    g = torch.Generator().manual_seed(4)
    for lengths in ((7, 1, 23, 12), (70, 5, 130, 3)):
        seqs = [torch.randint(0, 1000, (n,), generator=g) for n in lengths]
        with torch.no_grad():
            want = _run(dec, seqs)
            torch.testing.assert_close(_run(dec, seqs, backend="cudnn"), want, **TOL)
            torch.testing.assert_close(_run(dec, seqs, backend="packed"), want, **TOL)


def test_prefill_backend_and_packed_kernel_are_chosen_in_one_place(monkeypatch):
    """The reference off CUDA or in fp32; on CUDA the packed op. Inside the op, per call: on Hopper in bf16 cuDNN
    per sequence for long sequences with all heads and no cached prefix; flash varlen otherwise."""
    from batchvl.ops import prefill_attention as pa

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert prefill_backend(cpu, torch.bfloat16) == "sdpa"
    assert prefill_backend(cuda, torch.float32) == "sdpa"
    assert prefill_backend(cuda, torch.bfloat16) == "packed"
    assert pa.packed_kernel(cpu, torch.bfloat16, 128, [4000], True) == "sdpa"
    monkeypatch.setattr(pa, "_VARLEN", object())
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for major, want in ((9, "cudnn"), (8, "varlen")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, m=major: (m, 0))
        assert pa.packed_kernel(cuda, torch.bfloat16, 128, [2000, 1500], True) == want
    assert pa.packed_kernel(cuda, torch.bfloat16, 128, [2000, 1500], True, True) == "varlen"  # after a prefix
    assert pa.packed_kernel(cuda, torch.bfloat16, 128, [2000, 10], True) == "varlen"  # short on average
    assert pa.packed_kernel(cuda, torch.bfloat16, 128, [2000], False) == "varlen"  # tensor parallel
    monkeypatch.setattr(pa, "_VARLEN", None)
    assert pa.packed_kernel(cuda, torch.bfloat16, 128, [20], True) == "sdpa"


def test_prefill_then_decode_equals_full_forward():
    dec = _decoder()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (9, 70)]
    steps = 3
    with torch.no_grad():
        full = [_run(dec, [s]) for s in seqs]  # [L, V] each
        prompts = [s[:-steps] for s in seqs]
        pool = _pool()
        table = _tables(pool, [len(s) for s in seqs])
        got = _run(dec, prompts, pool, table=table)
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        torch.testing.assert_close(
            got[last], torch.stack([f[len(p) - 1] for f, p in zip(full, prompts)]), **TOL
        )
        pos = torch.tensor([len(p) for p in prompts])
        for step in range(steps):
            tok = torch.stack([s[len(p) + step] for s, p in zip(seqs, prompts)])
            logits = decode_forward(dec, tok, pos, table, pool)
            want = torch.stack([f[len(p) + step] for f, p in zip(full, prompts)])
            torch.testing.assert_close(logits, want, **TOL)
            pos = pos + 1


def test_prefix_in_pool_equals_full_prefill():
    """New tokens prefilled after a prefix already in the pool match a full prefill (the shared-prefix path)."""
    dec = _decoder()
    g = torch.Generator().manual_seed(3)
    s = torch.randint(0, 1000, (150,), generator=g)
    with torch.no_grad():
        full = _run(dec, [s])
        pool = _pool()
        table = _tables(pool, [150])
        _run(dec, [s[:128]], pool, table=table)  # two whole blocks, as the prefix cache shares them
        tail = _run(dec, [s[128:]], pool, prefix=[128], table=table)
        packed = _run(dec, [s[128:]], pool, prefix=[128], table=table, backend="packed")
    torch.testing.assert_close(tail, full[128:], **TOL)
    torch.testing.assert_close(packed, full[128:], **TOL)


def test_last_layer_for_last_tokens_equals_full():
    """`Decoder.forward(last=...)` (the last layer's queries, attention output and MLP for each sequence's last token
    only) = the full forward's rows `last`, and leaves the same KV pool; also after a prefix in the pool, and with
    qkv bias (Qwen2) and without (InternLM2). Asking for it without a pool, or in a decode step, is an error."""
    import dataclasses

    import pytest

    g = torch.Generator().manual_seed(5)
    for cfg in (CFG, dataclasses.replace(CFG, arch="internlm2", qkv_bias=False)):
        dec = _decoder(cfg)
        seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (7, 1, 23, 12)]
        lens = [len(t) for t in seqs]
        for prefix in ([0, 0, 0, 0], [64, 0, 128, 64]):
            pools = [_pool(), _pool()]
            table = _tables(pools[1], [p + n for p, n in zip(prefix, lens)])
            _tables(pools[0], [p + n for p, n in zip(prefix, lens)])  # the same blocks in both pools
            if any(prefix):  # the prefix's k / v as a first prefill left them
                first = [torch.randint(0, 1000, (max(p, 1),), generator=g) for p in prefix]
                _run(dec, first, pools[0], table=table)
                pools[1].k.copy_(pools[0].k)
                pools[1].v.copy_(pools[0].v)
            pos, meta = packed_meta(lens, prefix, table)
            last = meta.cu_seqlens[1:].long() - 1
            with torch.no_grad():
                h = dec.embed_tokens(torch.cat(seqs))
                want = dec.logits(dec(h, pos, meta, pools[0])[last])
                got = dec.logits(dec(h, pos, meta, pools[1], last=last))
            torch.testing.assert_close(got, want, **TOL)
            torch.testing.assert_close(pools[1].k, pools[0].k, **TOL)
            torch.testing.assert_close(pools[1].v, pools[0].v, **TOL)
        with pytest.raises(ValueError, match="prefill into a KV cache"):
            dec(h, pos, meta, None, last=last)


def test_cascade_after_a_shared_prefix_equals_the_reference():
    """The packed op after cached prefixes attends in two parts merged by log-sum-exp: each run of rows sharing
    prefix blocks against those keys read once, and every row causally against its own new keys. It equals the
    reference (each row's prefix + new keys gathered, masked), for every token's logits and the pool it writes:
    rows sharing a prefix at the front (their queries taken as they lie) and spread out (gathered), a row with a
    prefix of its own, rows without one, a one-token row, and a run split by a row without a prefix."""
    dec = _decoder()
    g = torch.Generator().manual_seed(6)
    pool = _pool(80)
    shared, own = pool.allocate(2), pool.allocate(1)  # a 128-token prefix and a 64-token one
    with torch.no_grad():
        w = blocks_for(128)
        first = torch.tensor([shared, own + [0] * (w - 1)], dtype=torch.int32)
        _run(dec, [torch.randint(0, 1000, (n,), generator=g) for n in (128, 64)], pool, table=first)
    layouts = [  # (prefix blocks, new tokens, group) per row: prefixed rows lead, then spread out
        [(shared, 5, 0), (shared, 17, 0), (own, 9, 1), (None, 12, -1), (None, 1, -1)],
        [(None, 7, -1), (shared, 1, 0), (shared, 30, 0), (None, 3, -1), (shared, 4, 0), (own, 20, 1)],
    ]
    for layout in layouts:
        prefix = [64 * len(b) if b else 0 for b, _, _ in layout]
        lens = [n for _, n, _ in layout]
        pools = [copy.deepcopy(pool), copy.deepcopy(pool)]
        rows = [
            (b or []) + pools[0].allocate(blocks_for(p + n) - len(b or []))
            for (b, n, _), p in zip(layout, prefix)
        ]
        width = max(len(r) for r in rows)
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
        seqs = [torch.randint(0, 1000, (n,), generator=g) for n in lens]
        h = dec.embed_tokens(torch.cat(seqs))
        got = []
        for backend, kv in (("sdpa", pools[0]), ("packed", pools[1])):
            pos, meta = packed_meta(lens, prefix, table, backend, groups=[grp for _, _, grp in layout])
            with torch.no_grad():
                got.append(dec.logits(dec(h, pos, meta, kv)))
        leading = meta.prefix.q_index.numel() == 0
        assert leading == (layout is layouts[0]) and meta.prefix.cu_q_host.tolist() == (
            [0, 22, 31] if leading else [0, 31, 35, 55]
        )
        torch.testing.assert_close(got[1], got[0], **TOL)
        torch.testing.assert_close(pools[1].k, pools[0].k, **TOL)
        torch.testing.assert_close(pools[1].v, pools[0].v, **TOL)
    with pytest.raises(
        ValueError, match="share a prefix group"
    ):  # one group, two prefix lengths: a caller's bug
        packed_meta([3, 3], [64, 128], table[:2, :3], "packed", groups=[0, 0])


def test_internlm2_wqkv_matches_llama(tmp_path):
    """An OpenGVLab InternLM2 checkpoint loads to the same logits as transformers' Llama with unpacked weights."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    nh, nkv, hd, hidden = 8, 2, 8, 64
    lc = LlamaConfig(vocab_size=151674, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=nh,
                     num_key_value_heads=nkv, intermediate_size=96, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    llama = LlamaForCausalLM(lc).eval()
    with torch.no_grad():
        for n, p in llama.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
    sd = {"language_model." + n: t for n, t in llama.state_dict().items()}
    sd = llama_to_internlm2(sd, 2, nh, nkv, hd)
    # a tiny InternViT from the shared fixture config, so the checkpoint is a whole InternVL
    from conftest import to_opengvlab
    from transformers import InternVLForConditionalGeneration

    hf = InternVLForConditionalGeneration(tiny_hf_config("300m"))
    hf_dir = tmp_path / "vit"
    hf.save_pretrained(hf_dir)
    og = to_opengvlab(hf_dir, tmp_path / "og")
    from safetensors.torch import load_file

    vit = {k: v for k, v in load_file(og / "model.safetensors").items() if not k.startswith("language_model")}
    vit["mlp1.1.weight"] = torch.randn(hidden, vit["mlp1.1.weight"].shape[1]) * 0.05
    vit["mlp1.1.bias"] = torch.zeros(hidden)
    vit["mlp1.3.weight"] = torch.randn(hidden, hidden) * 0.05
    vit["mlp1.3.bias"] = torch.zeros(hidden)
    save_file({**sd, **vit}, og / "model.safetensors")
    cfg = json.loads((og / "config.json").read_text())
    cfg["llm_config"] = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "vocab_size": 151674,
                         "hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": nh,
                         "num_key_value_heads": nkv, "intermediate_size": 96, "rope_theta": 1e6, "bias": False,
                         "rms_norm_eps": 1e-6, "tie_word_embeddings": False}  # fmt: skip
    (og / "config.json").write_text(json.dumps(cfg))
    model, mcfg = load_model(og)
    assert mcfg.llm.arch == "internlm2" and not mcfg.llm.qkv_bias
    ids = torch.randint(0, 151643, (17,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = llama(input_ids=ids[None]).logits[0]
        ours = _run(model.llm, [ids])
    torch.testing.assert_close(ours, ref, **TOL)


def test_sampling_greedy_seeded_and_top_p():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    seeds, steps = torch.tensor([row_seed(0, f"r{i}") for i in range(4)]), torch.zeros(4, dtype=torch.int64)
    assert torch.equal(sample(logits, 0.0, 1.0, seeds, steps), logits.argmax(-1))
    a = sample(logits, 1.0, 0.9, seeds, steps)
    assert torch.equal(a, sample(logits, 1.0, 0.9, seeds, steps))
    # top_p tiny keeps only the arg-max token
    assert torch.equal(sample(logits, 1.0, 1e-6, seeds, steps), logits.argmax(-1))
    # a tiny temperature is greedy in the limit, not a NaN softmax
    assert torch.equal(sample(logits, 1e-38, 1.0, seeds, steps), logits.argmax(-1))


def test_sampling_draws_each_token_with_its_probability():
    """The exponential race over each row's own counter-based noise is a correct sampler: 40000 streams, one row of
    known probabilities (with top-p cutting the tail)."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    n = 40000
    seeds = torch.tensor([row_seed(3, str(i)) for i in range(n)])
    for top_p, want in (
        (1.0, [0.5, 0.25, 0.15, 0.07, 0.03]),
        (0.85, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0]),
    ):
        got = sample(logits.expand(n, 5), 1.0, top_p, seeds, torch.full((n,), 7)).bincount(minlength=5) / n
        assert (got - torch.tensor(want)).abs().max() < 0.01, (top_p, got)
    steps = torch.arange(n)  # one stream, successive tokens: independent draws too
    got = sample(logits.expand(n, 5), 1.0, 1.0, seeds[:1].expand(n), steps).bincount(minlength=5) / n
    assert (got - logits.exp()).abs().max() < 0.01


def test_a_rows_draws_do_not_depend_on_its_batch():
    """sample_rows: each row's token depends on its own logits, seed and step only (issue 27: a resumed sampled run
    differed from an uninterrupted one because the stream followed batch positions)."""
    from types import SimpleNamespace

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    hot = SimpleNamespace(temperature=1.0, top_p=0.95)
    cold = SimpleNamespace(temperature=0.0, top_p=1.0)
    settings = [hot, cold, hot, hot, SimpleNamespace(temperature=0.7, top_p=1.0), hot]
    seeds, steps = [row_seed(0, f"r{i}") for i in range(6)], [0, 3, 1, 9, 2, 5]
    together = sample_rows(logits, settings, seeds, steps).tolist()
    alone = [sample_rows(logits[i : i + 1], settings[i : i + 1], seeds[i : i + 1], steps[i : i + 1]).item()
             for i in range(6)]  # fmt: skip
    order = [4, 0, 5, 2, 1, 3]
    shuffled = sample_rows(logits[order], [settings[i] for i in order], [seeds[i] for i in order],
                           [steps[i] for i in order]).tolist()  # fmt: skip
    assert together == alone == [shuffled[order.index(i)] for i in range(6)]
    other = sample_rows(logits, settings, [row_seed(1, f"r{i}") for i in range(6)], steps).tolist()
    assert other != together  # the seed matters


def test_random_init_shards_like_full():
    """init_random with a shard hook keeps exactly the slice of the full draw (what a TP rank loads)."""
    from batchvl.model.loader import build_empty, random_model

    full, cfg = random_model("tiny-qwen2", seed=5)
    part = build_empty(cfg)
    shapes = {n: p.shape for n, p in part.named_parameters()}
    part.to_empty(device="cpu")

    def half(name, t):
        return t[: t.shape[0] // 2] if t.dim() == 2 else t

    with torch.no_grad():
        for p in part.parameters():
            if p.dim() == 2:
                p.data = p.data[: p.shape[0] // 2].clone()
    init_random(part, 5, shard=half, full_shapes=shapes)
    for (n, a), b in zip(full.named_parameters(), part.parameters(), strict=True):
        torch.testing.assert_close(half(n, a), b, atol=0, rtol=0, msg=n)


def test_random_init_holds_one_draw_at_a_time(monkeypatch):
    """init_random's peak is the weights + one fp32 draw: no earlier draw is alive when the next is made (two
    embedding tables at once were 2.9 GiB over a 38B stand-in's plan)."""
    import weakref

    import batchvl.model.loader as loader

    drawn, randn = [], torch.randn

    def tracked(*args, **kwargs):
        assert all(r() is None for r in drawn), "an earlier fp32 draw is still alive"
        t = randn(*args, **kwargs)
        drawn.append(weakref.ref(t))
        return t

    monkeypatch.setattr(loader.torch, "randn", tracked)
    for quantization in ("none", "fp8"):
        drawn.clear()
        loader.random_model("tiny-qwen2", quantization=quantization)
        assert len(drawn) > 10


def test_materialize_allocates_a_tied_table_once():
    """A tied embedding is one allocation: to_empty gave lm_head a second table, which CUDA then kept reserved
    (0.6 GiB over a 4B stand-in's plan)."""
    import dataclasses

    from torch.utils._python_dispatch import TorchDispatchMode

    import batchvl.model.loader as loader
    from batchvl.config import from_preset

    class Allocated(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith("empty"):
                self.nbytes += out.numel() * out.element_size()
            return out

    cfg = from_preset("tiny-qwen2")
    for tied in (False, True):
        llm = dataclasses.replace(cfg.llm, tie_word_embeddings=tied)
        model = loader.build_empty(dataclasses.replace(cfg, llm=llm))
        with Allocated() as allocated:
            loader._materialize(model, torch.device("cpu"), torch.float32)
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        assert allocated.nbytes == held
        assert (model.llm.lm_head.weight is model.llm.embed_tokens.weight) == tied


def test_padded_vocab_logits_equal_plain():
    """pad_vocab (aligned logits rows on CUDA): same logits and the same parameter objects' values, tied or not."""
    for tied in (False, True):
        cfg = LLMConfig(**{**CFG.__dict__, "vocab_size": 1001, "tie_word_embeddings": tied})
        dec = _decoder(cfg)
        h = torch.randn(5, cfg.hidden_size)
        with torch.no_grad():
            ref = dec.logits(h)
            dec.pad_vocab(64)
            got = dec.logits(h)
        w = dec.lm_head.weight
        assert w.shape == (1001, cfg.hidden_size) and got.shape == (5, 1001)
        # the parameter is a view of storage padded to 1024 rows, the padding zero
        storage = torch.empty(0).set_(w.untyped_storage(), 0, (1024, cfg.hidden_size))
        assert w.data_ptr() == storage.data_ptr() and not storage[1001:].any()
        assert (dec.embed_tokens.weight is w) == tied
        torch.testing.assert_close(got, ref, **TOL)
