"""Shared by the bench scripts: matmul ceiling, FLOP counts, a transformers model that shares our weights."""

from __future__ import annotations

import time

import torch

from batchvl.config import InternVLConfig, LLMConfig


def matmul_ceiling(device: str = "cuda", n: int = 8192) -> dict:
    """bf16 n^3 matmul TFLOP/s two ways: CUDA events over 20 back-to-back runs, and triton do_bench's median."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    flop = 2 * n**3
    for _ in range(5):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        a @ b
    e.record()
    e.synchronize()
    out = {"events_b2b": flop / (s.elapsed_time(e) / 20 * 1e-3) / 1e12}
    from triton.testing import do_bench

    ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    out["do_bench_median"] = flop / (ms * 1e-3) / 1e12
    return out


def tile_flops(cfg: InternVLConfig) -> float:
    """FLOPs per 448-px tile: the ViT layers (`split_overlap.vit_flops_per_tile`), patch embedding and projector."""
    from batchvl.encoder.split_overlap import vit_flops_per_tile

    v, h = cfg.vision, cfg.llm.hidden_size
    patch = 2 * v.num_patches * 3 * v.patch_size**2 * v.hidden_size
    proj = 2 * cfg.num_image_token * (cfg.projector_in + h) * h
    return sum(vit_flops_per_tile(v)) + patch + proj


def llm_linear_params(c: LLMConfig) -> int:
    """Per-token GEMM parameters of the decoder layers (no embedding, no lm_head)."""
    qkv = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    o = c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return (qkv + o + mlp) * c.num_layers


def llm_prefill_flops(c: LLMConfig, length: int, prefix: int = 0) -> float:
    """Prefill FLOPs of `length` new tokens after `prefix` cached ones, with one lm_head row."""
    linear = 2 * length * llm_linear_params(c)
    # causal attention: QK^T and PV over the keys each new token sees
    keys = length * prefix + length * (length + 1) / 2
    attn = 4 * keys * c.num_heads * c.head_dim * c.num_layers
    return float(linear + attn + 2 * c.hidden_size * c.vocab_size)


def request_flops(cfg: InternVLConfig, tiles: int, length: int, new_tokens: int) -> float:
    """Everything one uncached request costs: ViT on its tiles, prefill, decode steps."""
    vit = tiles * tile_flops(cfg)
    dec = (new_tokens - 1) * 2 * (llm_linear_params(cfg.llm) + cfg.llm.hidden_size * cfg.llm.vocab_size)
    return vit + llm_prefill_flops(cfg.llm, length) + dec


def hf_config(cfg: InternVLConfig, attn: str = "sdpa"):
    """The transformers InternVLConfig of the same shapes."""
    from transformers import InternVLConfig as HFConfig

    v, c = cfg.vision, cfg.llm
    # InternLM2 is remote code in transformers; once wqkv is unpacked it is exactly Llama
    text_type = "qwen2" if c.arch == "qwen2" else "llama"
    hf = HFConfig(
        vision_config=dict(hidden_size=v.hidden_size, num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
                           intermediate_size=v.intermediate_size, norm_type=v.norm_type,
                           use_qk_norm=v.qk_normalization, attention_bias=v.qkv_bias, layer_norm_eps=v.layer_norm_eps,
                           image_size=v.image_size, patch_size=v.patch_size),
        text_config=dict(model_type=text_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, intermediate_size=c.intermediate_size,
                         rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
                         max_position_embeddings=c.max_position_embeddings),
        image_token_id=cfg.image_token_id, downsample_ratio=cfg.downsample_ratio,
        tie_word_embeddings=c.tie_word_embeddings,
    )  # fmt: skip
    hf._attn_implementation = attn
    hf.vision_config._attn_implementation = attn
    hf.text_config._attn_implementation = attn
    return hf


def hf_sharing_weights(model, cfg: InternVLConfig, attn: str = "sdpa"):
    """transformers' InternVLForConditionalGeneration whose parameters are views of ours (no extra memory)."""
    from accelerate import init_empty_weights
    from torch import nn
    from transformers import InternVLForConditionalGeneration

    from batchvl.model.loader import plan

    dev = next(model.parameters()).device
    with init_empty_weights(include_buffers=False), torch.device(dev):
        hf = InternVLForConditionalGeneration(hf_config(cfg, attn))
    shapes = {k: v.shape for k, v in hf.named_parameters()}
    ours = dict(model.named_parameters())
    for name, r in plan(model, set(shapes), llm_arch="qwen2").items():
        t, start = ours[name].detach(), 0
        for src in r.sources:
            n = shapes[src][0] if r.combine == "cat" else t.shape[0]
            mod, _, leaf = src.rpartition(".")
            setattr(
                hf.get_submodule(mod),
                leaf,
                nn.Parameter(t[start : start + n].view(shapes[src]), requires_grad=False),
            )
            start += n
    if cfg.llm.tie_word_embeddings:
        hf.lm_head.weight = hf.model.language_model.embed_tokens.weight
    elif "lm_head.weight" not in dict(hf.named_parameters()) or hf.lm_head.weight.is_meta:
        hf.lm_head.weight = nn.Parameter(model.llm.lm_head.weight.detach(), requires_grad=False)
    left = [k for k, p in hf.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"transformers parameters left unset: {left[:5]}")
    return hf.eval()


def same_tokens(got: list[list[int]], want: list[list[int]]) -> int:
    """How many generated tokens are equal, position by position."""
    return sum(x == y for a, b in zip(got, want) for x, y in zip(a, b))


def sync_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def hf_llm_sharing_weights(llm):
    """transformers' Qwen2Model (Qwen2) or LlamaModel (InternLM2 is Llama once wqkv is unpacked) whose
    parameters are views of our decoder's (no extra memory); returns the final-normed hidden states."""
    from accelerate import init_empty_weights
    from torch import nn
    from transformers import LlamaConfig, LlamaModel, Qwen2Config, Qwen2Model

    c = llm.cfg
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
              num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              intermediate_size=c.intermediate_size, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
              max_position_embeddings=c.max_position_embeddings)  # fmt: skip
    hcfg = Qwen2Config(**kw) if c.arch == "qwen2" else LlamaConfig(**kw, attention_bias=False, mlp_bias=False)
    hcfg._attn_implementation = "sdpa"
    dev = llm.embed_tokens.weight.device
    with init_empty_weights(include_buffers=False), torch.device(dev):
        hf = (Qwen2Model if c.arch == "qwen2" else LlamaModel)(hcfg)

    def put(mod, leaf, t):
        setattr(mod, leaf, nn.Parameter(t.detach(), requires_grad=False))

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    put(hf.embed_tokens, "weight", llm.embed_tokens.weight)
    put(hf.norm, "weight", llm.norm.weight)
    for ours, theirs in zip(llm.layers, hf.layers, strict=True):
        a, m = ours.attn, ours.mlp
        for name, sl in (
            ("q_proj", slice(0, q)),
            ("k_proj", slice(q, q + kv)),
            ("v_proj", slice(q + kv, q + 2 * kv)),
        ):
            put(getattr(theirs.self_attn, name), "weight", a.qkv.weight[sl])
            if a.qkv.bias is not None:
                put(getattr(theirs.self_attn, name), "bias", a.qkv.bias[sl])
        put(theirs.self_attn.o_proj, "weight", a.o_proj.weight)
        put(theirs.mlp.gate_proj, "weight", m.gate_up.weight[: c.intermediate_size])
        put(theirs.mlp.up_proj, "weight", m.gate_up.weight[c.intermediate_size :])
        put(theirs.mlp.down_proj, "weight", m.down.weight)
        put(theirs.input_layernorm, "weight", ours.input_norm.weight)
        put(theirs.post_attention_layernorm, "weight", ours.post_attn_norm.weight)
    left = [k for k, p in hf.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"transformers parameters left unset: {left[:5]}")
    return hf.eval()
