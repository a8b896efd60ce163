"""Eager InternViT + projector vs transformers' InternVLModel (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers

from batchvl.config import InternVLConfig, LLMConfig, VisionConfig
from batchvl.encoder.internvit import VisionEncoder, pixel_shuffle

ATOL, RTOL = 1e-5, 1e-4

KINDS = {
    # InternViT-6B style: RMSNorm, full-width qk-norm, no qkv bias
    "6b": dict(norm_type="rms_norm", qk_normalization=True, qkv_bias=False),
    # InternViT-300M style: LayerNorm, qkv bias
    "300m": dict(norm_type="layer_norm", qk_normalization=False, qkv_bias=True),
}


def make_cfg(kind: str, image_size: int = 112, hidden: int = 64, heads: int = 4) -> InternVLConfig:
    """Tiny batchvl config (8x8 patch grid at 112 px)."""
    vision = VisionConfig(hidden_size=hidden, num_layers=2, num_heads=heads, intermediate_size=2 * hidden,
                          image_size=image_size, **KINDS[kind])  # fmt: skip
    llm = LLMConfig(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=128
    )
    return InternVLConfig(vision=vision, llm=llm)


def hf_config(cfg: InternVLConfig) -> transformers.InternVLConfig:
    """The equivalent transformers config."""
    v = cfg.vision
    vision = dict(hidden_size=v.hidden_size, num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
                  intermediate_size=v.intermediate_size, norm_type=v.norm_type, use_qk_norm=v.qk_normalization,
                  attention_bias=v.qkv_bias, layer_norm_eps=v.layer_norm_eps, image_size=v.image_size,
                  patch_size=v.patch_size, use_mean_pooling=True, model_type="internvl_vision")  # fmt: skip
    text = dict(model_type="qwen2", hidden_size=cfg.llm.hidden_size, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=64, vocab_size=128)  # fmt: skip
    hc = transformers.InternVLConfig(
        vision_config=vision, text_config=text, downsample_ratio=cfg.downsample_ratio
    )
    hc._attn_implementation = "sdpa"
    hc.vision_config._attn_implementation = "sdpa"
    return hc


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial weights: no ones/zeros left in norms, layer scales, biases or embeddings."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith(("lambda_1", "lambda_2", "ls1", "ls2")):
                p.copy_(0.1 + 0.05 * r)
            elif p.ndim == 1 and ("norm" in name or "layernorm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * r)
            elif "position" in name:
                p.copy_(0.5 * r)
            else:
                p.copy_(r / max(p.shape[-1], 1) ** 0.5 if p.ndim > 1 else 0.1 * r)


def hf_to_ours(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map transformers InternVLModel vision/projector weights onto VisionEncoder names."""
    out: dict[str, torch.Tensor] = {}
    pre = "vision_tower."
    for k, v in hf_sd.items():
        if k.startswith("multi_modal_projector."):
            k2 = k.removeprefix("multi_modal_projector.")
            k2 = k2.replace("layer_norm", "norm").replace("linear_1", "fc1").replace("linear_2", "fc2")
            out["projector." + k2] = v
            continue
        if not k.startswith(pre):
            continue
        k = k.removeprefix(pre)
        if k.startswith("encoder.layer."):
            i, rest = k.removeprefix("encoder.layer.").split(".", 1)
            if rest.startswith("attention.") and rest.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                continue  # fused below
            rest = (rest.replace("attention.", "attn.").replace("projection_layer", "proj")
                    .replace("layernorm_before", "norm1").replace("layernorm_after", "norm2")
                    .replace("lambda_1", "ls1").replace("lambda_2", "ls2"))  # fmt: skip
            out[f"vit.layers.{i}.{rest}"] = v
            a = f"{pre}encoder.layer.{i}.attention."
            for kind in ("weight", "bias"):
                if rest == f"attn.proj.{kind}" and a + f"q_proj.{kind}" in hf_sd:
                    out[f"vit.layers.{i}.attn.qkv.{kind}"] = torch.cat(
                        [hf_sd[a + f"{p}_proj.{kind}"] for p in "qkv"]
                    )
        else:
            k = (k.replace("cls_token", "class_embedding").replace("patch_embeddings.projection", "patch_embedding")
                 .replace("position_embeddings", "position_embedding"))  # fmt: skip
            out["vit." + k] = v
    return out


def build_pair(kind: str, **kw) -> tuple[VisionEncoder, transformers.InternVLModel]:
    """Our encoder and a transformers model with identical random weights."""
    cfg = make_cfg(kind, **kw)
    torch.manual_seed(0)
    hf = transformers.InternVLModel(hf_config(cfg)).eval()
    randomize_(hf)
    ours = VisionEncoder(cfg).eval()
    missing, unexpected = ours.load_state_dict(hf_to_ours(hf.state_dict()), strict=True)
    assert not missing and not unexpected
    return ours, hf


@pytest.mark.parametrize("kind", ["6b", "300m"])
def test_encoder_matches_transformers(kind: str) -> None:
    ours, hf = build_pair(kind)
    px = torch.randn(3, 3, 112, 112)
    with torch.no_grad():
        ref = hf.get_image_features(px, vision_feature_layer=-1, vision_feature_select_strategy="default")
        got = ours(px)
    assert got.shape == (3, ours.cfg.num_image_token, ours.cfg.llm.hidden_size)
    torch.testing.assert_close(got, ref.pooler_output, atol=ATOL, rtol=RTOL)
    # the ViT's last hidden state (CLS included) matches too
    torch.testing.assert_close(ours.vit(px), ref.last_hidden_state, atol=ATOL, rtol=RTOL)


def test_param_names() -> None:
    """The loader depends on these exact names and shapes."""
    cfg = make_cfg("6b")
    sd = VisionEncoder(cfg).state_dict()
    C, N = 64, 64
    expect = {
        "vit.embeddings.patch_embedding.weight": (C, 3, 14, 14),
        "vit.embeddings.patch_embedding.bias": (C,),
        "vit.embeddings.class_embedding": (1, 1, C),
        "vit.embeddings.position_embedding": (1, 1 + N, C),
        "vit.layers.0.norm1.weight": (C,),
        "vit.layers.0.attn.qkv.weight": (3 * C, C),
        "vit.layers.0.attn.q_norm.weight": (C,),
        "vit.layers.0.attn.k_norm.weight": (C,),
        "vit.layers.0.attn.proj.weight": (C, C),
        "vit.layers.0.attn.proj.bias": (C,),
        "vit.layers.0.ls1": (C,),
        "vit.layers.0.norm2.weight": (C,),
        "vit.layers.0.mlp.fc1.weight": (2 * C, C),
        "vit.layers.0.mlp.fc2.weight": (C, 2 * C),
        "vit.layers.0.ls2": (C,),
        "projector.norm.weight": (4 * C,),
        "projector.fc1.weight": (32, 4 * C),
        "projector.fc2.weight": (32, 32),
    }
    for k, shape in expect.items():
        assert tuple(sd[k].shape) == shape, k
    assert "vit.layers.0.attn.qkv.bias" not in sd and "vit.layers.0.norm1.bias" not in sd
    sd300 = VisionEncoder(make_cfg("300m")).state_dict()
    assert "vit.layers.0.attn.qkv.bias" in sd300 and "vit.layers.0.norm1.bias" in sd300
    assert "vit.layers.0.attn.q_norm.weight" not in sd300


@pytest.mark.parametrize("kind", ["6b", "300m"])
def test_pos_embedding_interpolation(kind: str) -> None:
    """A 6x6 (84 px) grid on a model trained at 8x8 (112 px): bicubic resize like transformers."""
    ours, hf = build_pair(kind)
    px = torch.randn(2, 3, 84, 84)
    with torch.no_grad():
        ref = hf.get_image_features(px, vision_feature_layer=-1, vision_feature_select_strategy="default")
        got = ours(px)
    assert got.shape == (2, 9, 32)
    torch.testing.assert_close(got, ref.pooler_output, atol=ATOL, rtol=RTOL)


def test_pos_embedding_interpolation_upscale() -> None:
    """Larger grid (10x10 at 140 px) on the ViT hidden states."""
    ours, hf = build_pair("6b")
    px = torch.randn(1, 3, 140, 140)
    with torch.no_grad():
        torch.testing.assert_close(ours.vit(px), hf.vision_tower(px).last_hidden_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", [(2, 8, 8, 12), (1, 32, 32, 16), (3, 4, 6, 8)])
def test_pixel_shuffle_matches_transformers(shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    hf = transformers.InternVLModel.pixel_shuffle(None, x, scale_factor=0.5)
    got = pixel_shuffle(x, 0.5)
    assert got.shape == hf.shape
    assert torch.equal(got, hf)


def test_pixel_shuffle_layout() -> None:
    """out[b, i, j] = concat(x[2i, 2j], x[2i, 2j+1], x[2i+1, 2j], x[2i+1, 2j+1])."""
    x = torch.randn(1, 4, 4, 3)
    y = pixel_shuffle(x)
    i, j = 1, 0
    want = torch.cat(
        [x[0, 2 * i, 2 * j], x[0, 2 * i, 2 * j + 1], x[0, 2 * i + 1, 2 * j], x[0, 2 * i + 1, 2 * j + 1]]
    )
    assert torch.equal(y[0, i, j], want)


def test_bf16_runs() -> None:
    """bf16 weights and fp32 pixels: output dtype follows the weights, close to fp32."""
    ours, _ = build_pair("6b")
    px = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        ref = ours(px)
        got = ours.to(torch.bfloat16)(px)
    assert got.dtype == torch.bfloat16
    err = (got.float() - ref).norm() / ref.norm()
    assert err < 2e-2
