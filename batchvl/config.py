"""Model configs: one dataclass per part, filled from a preset table or a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


@dataclass
class VisionConfig:
    """InternViT."""

    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    intermediate_size: int = 4096
    norm_type: str = "layer_norm"  # "layer_norm" (300M) or "rms_norm" (6B)
    qk_normalization: bool = False  # RMSNorm of q and k over the FULL hidden size (6B)
    qkv_bias: bool = True
    layer_norm_eps: float = 1e-6
    image_size: int = 448
    patch_size: int = 14
    hidden_act: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass
class LLMConfig:
    """Qwen2 or InternLM2 decoder."""

    arch: str = "qwen2"  # "qwen2" (qkv bias) or "internlm2" (packed wqkv, no bias)
    vocab_size: int = 151674
    hidden_size: int = 896
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    intermediate_size: int = 4864
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    head_dim: int = 0  # 0: hidden_size // num_heads

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads


@dataclass
class InternVLConfig:
    """The whole model: ViT -> pixel shuffle -> projector -> LLM."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    downsample_ratio: float = 0.5
    select_layer: int = -1
    ps_version: str = "v2"
    template: str = "internvl2_5"
    image_token_id: int = 151667
    min_dynamic_patch: int = 1
    max_dynamic_patch: int = 12
    use_thumbnail: bool = True

    @property
    def num_image_token(self) -> int:
        """LLM tokens per 448-px tile (256 for ratio 0.5)."""
        return int(self.vision.num_patches * self.downsample_ratio**2)

    @property
    def projector_in(self) -> int:
        return int(self.vision.hidden_size / self.downsample_ratio**2)


VIT_300M = dict(
    hidden_size=1024,
    num_layers=24,
    num_heads=16,
    intermediate_size=4096,
    norm_type="layer_norm",
    qk_normalization=False,
    qkv_bias=True,
)
VIT_6B = dict(
    hidden_size=3200,
    num_layers=45,
    num_heads=25,
    intermediate_size=12800,
    norm_type="rms_norm",
    qk_normalization=True,
    qkv_bias=False,
)
QWEN_VOCAB = 151674
INTERNLM2_VOCAB = 92553
DYN2 = {"type": "dynamic", "factor": 2.0}

# name -> (vision kwargs, llm kwargs, whole-model kwargs)
PRESETS: dict[str, tuple[dict, dict, dict]] = {
    "internvl2_5-1b": (VIT_300M, dict(arch="qwen2", vocab_size=QWEN_VOCAB, hidden_size=896, num_layers=24,
                       num_heads=14, num_kv_heads=2, intermediate_size=4864, tie_word_embeddings=True), {}),
    "internvl2_5-2b": (VIT_300M, dict(arch="internlm2", vocab_size=INTERNLM2_VOCAB, hidden_size=2048,
                       num_layers=24, num_heads=16, num_kv_heads=8, intermediate_size=8192, qkv_bias=False,
                       rope_scaling=DYN2), dict(image_token_id=92546)),
    "internvl2_5-4b": (VIT_300M, dict(arch="qwen2", vocab_size=QWEN_VOCAB, hidden_size=2048, num_layers=36,
                       num_heads=16, num_kv_heads=2, intermediate_size=11008, tie_word_embeddings=True), {}),
    "internvl2_5-8b": (VIT_300M, dict(arch="internlm2", vocab_size=INTERNLM2_VOCAB, hidden_size=4096,
                       num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336, qkv_bias=False,
                       rope_scaling=DYN2), dict(image_token_id=92546)),
    "internvl2_5-26b": (VIT_6B, dict(arch="internlm2", vocab_size=INTERNLM2_VOCAB, hidden_size=6144,
                        num_layers=48, num_heads=48, num_kv_heads=8, intermediate_size=16384, qkv_bias=False,
                        rope_scaling=DYN2), dict(image_token_id=92546)),
    "internvl2_5-38b": (VIT_6B, dict(arch="qwen2", vocab_size=QWEN_VOCAB, hidden_size=5120, num_layers=64,
                        num_heads=40, num_kv_heads=8, intermediate_size=27648), {}),
    "internvl2_5-78b": (VIT_6B, dict(arch="qwen2", vocab_size=QWEN_VOCAB, hidden_size=8192, num_layers=80,
                        num_heads=64, num_kv_heads=8, intermediate_size=29568), {}),
    # tiny presets for tests and the demo job
    "tiny-qwen2": (dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128),
                   dict(arch="qwen2", vocab_size=QWEN_VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, intermediate_size=128), {}),
    # InternLM2's vocabulary and image token id: the job gets the InternLM2 stand-in tokenizer
    "tiny-internlm2": (dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128),
                       dict(arch="internlm2", vocab_size=INTERNLM2_VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=128, qkv_bias=False), dict(image_token_id=92546)),
    "tiny-6b-style": (dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, norm_type="rms_norm",
                           qk_normalization=True, qkv_bias=False),
                      dict(arch="qwen2", vocab_size=QWEN_VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, intermediate_size=128), {}),
}  # fmt: skip


def from_preset(name: str, **overrides: Any) -> InternVLConfig:
    """Build a config from PRESETS; `overrides` are whole-model fields."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    v, llm, top = PRESETS[name]
    return replace(InternVLConfig(vision=VisionConfig(**v), llm=LLMConfig(**llm), **top), **overrides)


def _pick(d: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def _as_int(x: Any) -> int:
    return int(x[0] if isinstance(x, (list, tuple)) else x)


def vision_from_dict(d: dict) -> VisionConfig:
    """Parse an OpenGVLab (`InternVisionConfig`) or transformers (`InternVLVisionConfig`) vision config."""
    return VisionConfig(
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        intermediate_size=d["intermediate_size"],
        norm_type=_pick(d, "norm_type", default="rms_norm"),
        qk_normalization=bool(_pick(d, "qk_normalization", "use_qk_norm", default=False)),
        qkv_bias=bool(_pick(d, "qkv_bias", "attention_bias", default=False)),
        layer_norm_eps=float(_pick(d, "layer_norm_eps", default=1e-6)),
        image_size=_as_int(_pick(d, "image_size", default=448)),
        patch_size=_as_int(_pick(d, "patch_size", default=14)),
        hidden_act=_pick(d, "hidden_act", default="gelu"),
    )


def llm_from_dict(d: dict) -> LLMConfig:
    """Parse a Qwen2 or InternLM2 config dict."""
    archs = " ".join(d.get("architectures") or []) + " " + str(d.get("model_type", ""))
    arch = "internlm2" if "internlm2" in archs.lower() else "qwen2"
    if arch == "qwen2" and "qwen2" not in archs.lower() and "llama" not in archs.lower():
        raise ValueError(
            f"unsupported LLM architecture {archs.strip()!r}: batchvl supports Qwen2 and InternLM2"
        )
    num_heads = d["num_attention_heads"]
    return LLMConfig(
        arch=arch,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=_pick(d, "num_key_value_heads", default=num_heads),
        intermediate_size=d["intermediate_size"],
        rope_theta=float(
            _pick(d, "rope_theta", default=(d.get("rope_parameters") or {}).get("rope_theta", 1e6))
        ),
        rope_scaling=_rope_scaling(d),
        rms_norm_eps=float(_pick(d, "rms_norm_eps", default=1e-6)),
        # InternLM2: `bias`; transformers' Llama (an InternLM2 LLM converted): `attention_bias`; Qwen2: always
        qkv_bias=bool(
            _pick(d, "bias", "attention_bias", default=arch == "qwen2" and "llama" not in archs.lower())
        ),
        tie_word_embeddings=bool(_pick(d, "tie_word_embeddings", default=False)),
        max_position_embeddings=int(_pick(d, "max_position_embeddings", default=32768)),
        head_dim=int(_pick(d, "head_dim", default=0)),
    )


def _rope_scaling(d: dict) -> dict | None:
    rs = d.get("rope_scaling")
    if rs is None and isinstance(d.get("rope_parameters"), dict):
        rs = d["rope_parameters"]
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "dynamic"):  # e.g. yarn, llama3, longrope change RoPE at every position
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported (batchvl implements linear and dynamic)"
        )
    return {"type": kind, "factor": float(rs.get("factor", 1.0))}


def from_dict(cfg: dict) -> InternVLConfig:
    """Parse config.json of either checkpoint layout (OpenGVLab InternVLChatConfig or transformers InternVLConfig)."""
    if "vision_config" not in cfg:
        raise ValueError("config.json has no 'vision_config': not an InternVL checkpoint")
    llm_d = cfg.get("llm_config") or cfg.get("text_config")
    if llm_d is None:
        raise ValueError("config.json has neither 'llm_config' (OpenGVLab) nor 'text_config' (transformers)")
    vision = vision_from_dict(cfg["vision_config"])
    llm = llm_from_dict(llm_d)
    if "tie_word_embeddings" in cfg and "llm_config" not in cfg:
        llm.tie_word_embeddings = bool(cfg["tie_word_embeddings"])  # transformers ties at the top level
    select_layer = _pick(cfg, "select_layer", "vision_feature_layer", default=-1)
    if select_layer != -1:
        raise ValueError(f"select_layer={select_layer} is not supported (InternVL2.5 uses -1)")
    if cfg.get("ps_version", "v2") != "v2":
        raise ValueError(f"ps_version={cfg['ps_version']!r} is not supported (InternVL2.5 uses 'v2')")
    out = InternVLConfig(
        vision=vision,
        llm=llm,
        downsample_ratio=float(_pick(cfg, "downsample_ratio", default=0.5)),
        select_layer=-1,
        template=_pick(cfg, "template", default="internvl2_5"),
        image_token_id=int(_pick(cfg, "image_token_id", "image_token_index", default=-1)),
        min_dynamic_patch=int(_pick(cfg, "min_dynamic_patch", default=1)),
        max_dynamic_patch=int(_pick(cfg, "max_dynamic_patch", default=12)),
        use_thumbnail=bool(_pick(cfg, "use_thumbnail", default=True)),
    )
    force = cfg.get("force_image_size")
    if force:
        out.vision.image_size = int(force)
    return out


def load_config(path: str | Path) -> InternVLConfig:
    """Read `<dir>/config.json`."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
    return from_dict(json.loads(p.read_text()))


def config_to_dict(cfg: InternVLConfig) -> dict:
    """Plain dict (for manifests and fingerprints)."""

    def d(x: Any) -> dict:
        return {f.name: getattr(x, f.name) for f in fields(x)}

    top = d(cfg)
    top["vision"], top["llm"] = d(cfg.vision), d(cfg.llm)
    return top


def config_from_dict(d: dict) -> InternVLConfig:
    """`config_to_dict`'s inverse."""
    rest = {k: v for k, v in d.items() if k not in ("vision", "llm")}
    return InternVLConfig(vision=VisionConfig(**d["vision"]), llm=LLMConfig(**d["llm"]), **rest)


def with_layers(cfg: InternVLConfig, n: int) -> InternVLConfig:
    """The same model with at most n layers in the ViT and in the LLM (what a compiled layer's graph sees is
    unchanged: `graph_key`)."""
    vision = replace(cfg.vision, num_layers=min(n, cfg.vision.num_layers))
    return replace(cfg, vision=vision, llm=replace(cfg.llm, num_layers=min(n, cfg.llm.num_layers)))


def graph_key(cfg: InternVLConfig | LLMConfig) -> str:
    """What a compiled graph of one layer depends on in a config: all of it but the layer counts (graphs take the
    layer's weights as inputs, so a model with fewer layers compiles the same ones)."""
    if isinstance(cfg, LLMConfig):
        return repr(replace(cfg, num_layers=0))
    return repr(with_layers(cfg, 0))
