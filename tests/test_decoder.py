"""The LLM decoder: packed prefill, prefill + decode, InternLM2's packed wqkv, against references (fp32 CPU)."""

from __future__ import annotations

import json

import torch
from conftest import tiny_hf_config

from batchvl.engine import packed_meta
from batchvl.ops.prefill_attention import AttnMeta
from batchvl.llm.decoder import Decoder
from batchvl.llm.kv_cache import KVCache
from batchvl.llm.sampling import sample
from batchvl.config import LLMConfig
from batchvl.model.loader import init_random, load_model

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


def _run(dec, ids_list, cache=None, prefix=None):
    lens = [len(t) for t in ids_list]
    pos, meta = packed_meta(lens, prefix or [0] * len(lens), "cpu")
    h = dec.embed_tokens(torch.cat(ids_list))
    return dec.logits(dec(h, pos, meta, cache))


def test_packed_prefill_equals_each_alone():
    dec = _decoder()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (7, 1, 23, 12)]
    with torch.no_grad():
        packed = _run(dec, seqs)
        alone = torch.cat([_run(dec, [s]) for s in seqs])
    torch.testing.assert_close(packed, alone, **TOL)


def test_per_sequence_attention_backend_equals_reference():
    """backend "cudnn" (one SDPA call per sequence in a custom op, GQA by enable_gqa) equals the reference
    per-sequence path; after a cached prefix it falls back (here to the reference) and still matches."""
    dec = _decoder()
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (7, 1, 23, 12)]
    with torch.no_grad():
        want = _run(dec, seqs)
        for layer in dec.layers:
            layer.attn.backend = "cudnn"
        torch.testing.assert_close(_run(dec, seqs), want, **TOL)
        # long enough that windows rounded up to PER_SEQ_ROWS borrow the next sequence's rows (70 -> 128, 5 -> 64),
        # and the last ones run past the end (130 -> 192, 3 -> 64: zero rows appended)
        long = [torch.randint(0, 1000, (n,), generator=g) for n in (70, 5, 130, 3)]
        for layer in dec.layers:
            layer.attn.backend = "sdpa"
        want_long = _run(dec, long)
        for layer in dec.layers:
            layer.attn.backend = "cudnn"
        torch.testing.assert_close(_run(dec, long), want_long, **TOL)
        full = _run(dec, [seqs[2]])
        cache = KVCache(2, 1, 23, 2, 16, "cpu", torch.float32)
        _run(dec, [seqs[2][:9]], cache)
        torch.testing.assert_close(_run(dec, [seqs[2][9:]], cache, prefix=[9]), full[9:], **TOL)


def test_per_sequence_warm_up_visits_every_shape_a_prefill_uses(monkeypatch):
    """`warm_per_seq` calls SDPA with every (shape, strides) key a packed per-sequence prefill of those lengths
    does (cuDNN keys its execution plans on both), and with nothing else; whatever the packing and the layout of
    the inputs (v arrives as a view of the fused qkv output)."""
    import torch.nn.functional as F

    from batchvl.llm import attention

    keys = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        keys.append(tuple((tuple(t.shape), t.stride()) for t in (q, k, v)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    lengths = [70, 5, 130, 3, 64, 65]
    heads, kv_heads, d = 4, 2, 16
    attention.warm_per_seq(lengths, heads, kv_heads, d, "cpu", torch.float32)
    warm, keys[:] = set(keys), []
    assert len(warm) == len({attention.per_seq_window(n) for n in lengths}) == 3  # 64, 128, 192
    for order in (lengths, lengths[::-1], [130, 70]):
        cu = torch.tensor([0, *torch.tensor(order).cumsum(0).tolist()])
        qkv = torch.randn(int(cu[-1]), (heads + 2 * kv_heads) * d)
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
        q = q.reshape(-1, heads, d).contiguous()
        attention.causal_attn_per_seq(q, k.reshape(-1, kv_heads, d), v.view(-1, kv_heads, d), cu, "cudnn")
    assert set(keys) <= warm and len(keys) == 2 * len(lengths) + 2


def test_prefill_then_decode_equals_full_forward():
    dec = _decoder()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (9, 15)]
    steps = 3
    with torch.no_grad():
        full = [_run(dec, [s]) for s in seqs]  # [L, V] each
        prompts = [s[:-steps] for s in seqs]
        cache = KVCache(2, 2, max(len(s) for s in seqs), 2, 16, "cpu", torch.float32)
        got = _run(dec, prompts, cache)
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        torch.testing.assert_close(
            got[last], torch.stack([f[len(p) - 1] for f, p in zip(full, prompts)]), **TOL
        )
        lens = torch.tensor([len(p) for p in prompts])
        for step in range(steps):
            tok = torch.stack([s[len(p) + step] for s, p in zip(seqs, prompts)])
            meta = AttnMeta(torch.arange(3, dtype=torch.int32), 1, torch.arange(2), lens, True, lens + 1)
            logits = dec.logits(dec(dec.embed_tokens(tok), lens, meta, cache))
            want = torch.stack([f[len(p) + step] for f, p in zip(full, prompts)])
            torch.testing.assert_close(logits, want, **TOL)
            lens = lens + 1


def test_prefix_in_cache_equals_full_prefill():
    """New tokens prefilled after a cached prefix match a full prefill (the shared-prefix cache path)."""
    dec = _decoder()
    g = torch.Generator().manual_seed(3)
    s = torch.randint(0, 1000, (20,), generator=g)
    with torch.no_grad():
        full = _run(dec, [s])
        cache = KVCache(2, 1, 20, 2, 16, "cpu", torch.float32)
        _run(dec, [s[:12]], cache)
        tail = _run(dec, [s[12:]], cache, prefix=[12])
    torch.testing.assert_close(tail, full[12:], **TOL)


def test_last_layer_for_last_tokens_equals_full():
    """`Decoder.forward(last=...)` (the last layer's queries, attention output and MLP for each sequence's last token
    only) = the full forward's rows `last`, and leaves the same KV cache; also after a cached prefix, and with qkv
    bias (Qwen2) and without (InternLM2). Asking for it without a cache, or in a decode step, is an error."""
    import dataclasses

    import pytest

    g = torch.Generator().manual_seed(5)
    for cfg in (CFG, dataclasses.replace(CFG, arch="internlm2", qkv_bias=False)):
        dec = _decoder(cfg)
        seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (7, 1, 23, 12)]
        lens = [len(t) for t in seqs]
        for prefix in ([0, 0, 0, 0], [5, 0, 9, 3]):
            caches = [KVCache(2, 4, 40, 2, 16, "cpu", torch.float32) for _ in range(2)]
            if any(prefix):
                for c in caches:  # the prefix's k / v as a first prefill left them
                    _run(dec, [torch.randint(0, 1000, (max(p, 1),), generator=g) for p in prefix], c)
                caches[1].k.copy_(caches[0].k)
                caches[1].v.copy_(caches[0].v)
            pos, meta = packed_meta(lens, prefix, "cpu")
            last = meta.cu_seqlens[1:].long() - 1
            with torch.no_grad():
                h = dec.embed_tokens(torch.cat(seqs))
                want = dec.logits(dec(h, pos, meta, caches[0])[last])
                got = dec.logits(dec(h, pos, meta, caches[1], last=last))
            torch.testing.assert_close(got, want, **TOL)
            torch.testing.assert_close(caches[1].k, caches[0].k, **TOL)
            torch.testing.assert_close(caches[1].v, caches[0].v, **TOL)
        with pytest.raises(ValueError, match="prefill into a KV cache"):
            dec(h, pos, meta, None, last=last)


def _pack_wqkv(q, k, v, n_heads, n_kv, head_dim):
    """InternLM2's layout, written from its documentation: per kv group, its q heads, then k, then v."""
    hidden = q.shape[1]
    qg = q.view(n_kv, n_heads // n_kv, head_dim, hidden)
    return torch.cat([qg, k.view(n_kv, 1, head_dim, hidden), v.view(n_kv, 1, head_dim, hidden)], 1).reshape(
        -1, hidden
    )


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
    sd = {}
    for n, t in llama.state_dict().items():
        n = n.replace("model.", "language_model.model.", 1).replace("lm_head", "language_model.output")
        n = n.replace("embed_tokens", "tok_embeddings").replace("input_layernorm", "attention_norm")
        n = n.replace("post_attention_layernorm", "ffn_norm").replace("self_attn.o_proj", "attention.wo")
        n = n.replace("mlp.gate_proj", "feed_forward.w1").replace("mlp.up_proj", "feed_forward.w3")
        n = n.replace("mlp.down_proj", "feed_forward.w2")
        sd[n] = t
    for i in range(2):
        p = f"language_model.model.layers.{i}.self_attn."
        q, k, v = (sd.pop(p + f"{x}_proj.weight") for x in "qkv")
        sd[f"language_model.model.layers.{i}.attention.wqkv.weight"] = _pack_wqkv(q, k, v, nh, nkv, hd)
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
    assert torch.equal(sample(logits, 0.0, 1.0, None), logits.argmax(-1))
    a = sample(logits, 1.0, 0.9, torch.Generator().manual_seed(7))
    b = sample(logits, 1.0, 0.9, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    # top_p tiny keeps only the arg-max token
    assert torch.equal(sample(logits, 1.0, 1e-6, torch.Generator().manual_seed(1)), logits.argmax(-1))


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
        assert dec._head_padded.shape == (1024, cfg.hidden_size) and got.shape == (5, 1001)
        assert dec.lm_head.weight.data_ptr() == dec._head_padded.data_ptr()
        assert (dec.embed_tokens.weight is dec.lm_head.weight) == tied
        assert not dec._head_padded[1001:].any()
        torch.testing.assert_close(got, ref, **TOL)
