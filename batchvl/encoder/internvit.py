"""Eager reference InternViT + pixel shuffle + MLP projector (InternVL2.5 vision side)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchvl.config import InternVLConfig, VisionConfig
from batchvl.ops.norm import RMSNorm


def make_norm(cfg: VisionConfig, dim: int | None = None) -> nn.Module:
    """LayerNorm (300M) or RMSNorm (6B) as the config says."""
    dim = dim or cfg.hidden_size
    if cfg.norm_type == "layer_norm":
        return nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
    if cfg.norm_type == "rms_norm":
        return RMSNorm(dim, eps=cfg.layer_norm_eps)
    raise ValueError(f"unknown norm_type {cfg.norm_type!r}")


class InternViTEmbeddings(nn.Module):
    """Patch conv + CLS token + (bicubically resized) absolute position embedding."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        C, p = cfg.hidden_size, cfg.patch_size
        self.grid = cfg.image_size // p  # side of the pre-trained position grid
        self.patch_embedding = nn.Conv2d(3, C, kernel_size=p, stride=p, bias=True)
        self.class_embedding = nn.Parameter(torch.zeros(1, 1, C))
        self.position_embedding = nn.Parameter(torch.zeros(1, 1 + self.grid**2, C))

    def position_for(self, h: int, w: int) -> Tensor:
        """Position embedding [1, 1+h*w, C] for an h x w patch grid."""
        pos = self.position_embedding
        if (h, w) == (self.grid, self.grid):
            return pos
        C = pos.shape[-1]
        grid = pos[:, 1:].float().reshape(1, self.grid, self.grid, C).permute(0, 3, 1, 2)  # [1, C, g, g]
        grid = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)  # [1, C, h, w]
        grid = grid.permute(0, 2, 3, 1).reshape(1, h * w, C).to(pos.dtype)
        return torch.cat([pos[:, :1], grid], dim=1)

    def forward(self, pixel_values: Tensor) -> Tensor:
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(w.dtype))  # [B, C, h, w]
        _, _, gh, gw = x.shape
        return self.add_cls_and_position(x.flatten(2).transpose(1, 2), gh, gw)

    def add_cls_and_position(self, x: Tensor, gh: int, gw: int) -> Tensor:
        """Patch features [B, N, C] of a gh x gw grid -> [B, 1+N, C] with CLS first and positions added."""
        B, _, C = x.shape
        cls = self.class_embedding.to(x.dtype).expand(B, 1, C)  # [B, 1, C]
        return torch.cat([cls, x], dim=1) + self.position_for(gh, gw)  # [B, 1+N, C]


class InternViTAttention(nn.Module):
    """Multi-head self-attention with a fused [q; k; v] projection and optional full-width qk RMSNorm."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        C = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(C, 3 * C, bias=cfg.qkv_bias)
        self.qk_normalization = cfg.qk_normalization
        if cfg.qk_normalization:
            self.q_norm = RMSNorm(C, eps=cfg.layer_norm_eps)
            self.k_norm = RMSNorm(C, eps=cfg.layer_norm_eps)
        self.proj = nn.Linear(C, C, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.mix(x))  # [B, T, C]

    def mix(self, x: Tensor) -> Tensor:
        """Everything before the output projection: [B, T, C] -> heads' outputs [B, T, C]."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x [B, T, C]
        if self.qk_normalization:
            q, k = self.q_norm(q), self.k_norm(k)  # over the full hidden size, before the head split
        # head count comes from the weight width, so a tensor-parallel shard needs no bookkeeping here
        q, k, v = (t.reshape(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # [B, H, T, D]
        return o.transpose(1, 2).reshape(B, T, -1)  # [B, T, C]


class InternViTMLP(nn.Module):
    """fc1 -> exact GELU -> fc2."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "gelu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (InternViT uses exact gelu)")
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class InternViTLayer(nn.Module):
    """Pre-norm block with layer scales: x += ls1*attn(norm1(x)); x += ls2*mlp(norm2(x))."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        C = cfg.hidden_size
        self.norm1 = make_norm(cfg)
        self.attn = InternViTAttention(cfg)
        self.ls1 = nn.Parameter(torch.ones(C))
        self.norm2 = make_norm(cfg)
        self.mlp = InternViTMLP(cfg)
        self.ls2 = nn.Parameter(torch.ones(C))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.ls1 * self.attn(self.norm1(x))
        return x + self.ls2 * self.mlp(self.norm2(x))


class InternViT(nn.Module):
    """InternViT-300M / -6B; returns the last layer's hidden states (no final norm)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = InternViTEmbeddings(cfg)
        self.layers = nn.ModuleList(InternViTLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, pixel_values: Tensor) -> Tensor:
        x = self.embeddings(pixel_values)  # [B, 1+N, C]
        for layer in self.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    """mlp1: LayerNorm(4C) -> Linear -> GELU -> Linear."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(in_features, eps=1e-5)
        self.fc1 = nn.Linear(in_features, out_features)
        self.fc2 = nn.Linear(out_features, out_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def pixel_shuffle(x: Tensor, ratio: float = 0.5) -> Tensor:
    """[B, h, w, C] -> [B, h*r, w*r, C/r^2]; out[b, i, j] = concat over (dy, dx) of x[b, i*s+dy, j*s+dx], s=1/r."""
    B, h, w, C = x.shape
    s = round(1 / ratio)
    if h % s or w % s:
        raise ValueError(f"grid {h}x{w} is not divisible by {s}")
    x = x.reshape(B, h // s, s, w // s, s, C)  # [B, i, dy, j, dx, C]
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, h // s, w // s, s * s * C)  # channels ordered (dy, dx, C)


def vit_to_tokens(feats: Tensor, ratio: float) -> Tensor:
    """ViT output [B, 1+N, C] -> shuffled tokens [B, N*r^2, C/r^2] (drop CLS, grid, pixel shuffle)."""
    x = feats[:, 1:]  # [B, N, C]
    B, N, C = x.shape
    g = int(N**0.5)
    x = pixel_shuffle(x.reshape(B, g, g, C), ratio)  # [B, g*r, g*r, C/r^2]
    return x.reshape(B, -1, x.shape[-1])


class VisionEncoder(nn.Module):
    """Tiles -> LLM-space image tokens: InternViT, pixel shuffle, projector."""

    def __init__(self, cfg: InternVLConfig) -> None:
        super().__init__()
        if cfg.select_layer != -1 or cfg.ps_version != "v2":
            raise ValueError("only select_layer=-1 and ps_version='v2' are supported")
        self.cfg = cfg
        self.vit = InternViT(cfg.vision)
        self.projector = Projector(cfg.projector_in, cfg.llm.hidden_size)

    def forward(self, pixel_values: Tensor) -> Tensor:
        feats = self.vit(pixel_values)  # [tiles, 1+N, C]
        return self.projector(vit_to_tokens(feats, self.cfg.downsample_ratio))  # [tiles, num_image_token, H]
