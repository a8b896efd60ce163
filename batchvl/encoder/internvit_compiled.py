"""Fast InternViT forward: the eager modules and weights, regionally compiled one layer at a time.

Same math as `internvit.py` (the eager reference, kept beside it); what differs is where the graph boundaries lie and
which kernels run:

- one compiled graph per layer, shared by all layers (parameters are graph inputs, so 45 layers compile once);
- a layer's graph ends with the NEXT layer's norm, so each norm reads the residual stream right after it is written
  (the last layer computes its own norm1 again, unused: a graph of its own would be traced at every start);
- the residual stream x is written in place by the proj / fc2 GEMMs (`addmm_into`), with the layer scales folded
  into those weights (`fold_scales`) and the biases collected in an fp32 `shift` that each norm adds
  (`fused_norm.shifted_norm`);
- fc1 + GELU is one cuBLASLt GEMM with a GELU epilogue (tanh GELU on CUDA, exact on CPU);
- attention runs `vit_attention`'s CLS-aware Triton kernel where it has a config (the 300M), else SDPA after the 6B's
  q / k RMSNorm as one Triton pass (`fast_mix`);
- the tile count is a dynamic dimension of every graph (tokens per tile and widths stay static), so any count runs
  through one set of graphs; Dynamo specializes a size of 1, so a lone tile runs with a zero tile beside it rather
  than compiling a second set.

`fast_layer` is the plain compiled path, for layers whose linears are not `nn.Linear` (FP8) and for the tests' diffs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchvl.config import graph_key
from batchvl.encoder.internvit import (
    InternViTAttention,
    InternViTEmbeddings,
    InternViTLayer,
    InternViTMLP,
    Projector,
    VisionEncoder,
    vit_to_tokens,
)
from batchvl.ops.fused_norm import addmm_into, norm_params, shifted_norm
from batchvl.ops.norm import RMSNorm
from batchvl.ops.sdpa import sdpa_context
from batchvl.ops.vit_attention import kernel_config, vit_attention, vit_attention_sdpa
from batchvl.precompile import Precompiled

SDPA_BACKEND = "cudnn"  # tried first for the ViT's SDPA calls (the others are the fallback)


def patch_embed_gemm(conv: nn.Conv2d, pixel_values: Tensor) -> tuple[Tensor, int, int]:
    """The stride-p patch conv as one GEMM over unfolded patches: [B, 3, S, S] -> ([B, N, C], gh, gw).
    The same sums as the conv, without cuDNN's slow conv kernel for this shape."""
    B, ch, S1, S2 = pixel_values.shape
    p = conv.kernel_size[0]
    gh, gw = S1 // p, S2 // p
    x = pixel_values[:, :, : gh * p, : gw * p].reshape(B, ch, gh, p, gw, p)
    # [B*N, ch*p*p], each patch in the conv weight's (c, i, j) order
    x = x.permute(0, 2, 4, 1, 3, 5).reshape(B * gh * gw, ch * p * p)
    w = conv.weight.reshape(conv.out_channels, -1)  # [C, ch*p*p]
    return F.linear(x.to(w.dtype), w, conv.bias).view(B, gh * gw, -1), gh, gw


def fast_embed(emb: InternViTEmbeddings, norm1: nn.Module, pixel_values: Tensor) -> tuple[Tensor, Tensor]:
    """Embeddings (patch conv as a GEMM) and layer 0's norm1 in one graph: returns (x [B, 1+N, C], norm1(x))."""
    x = emb.add_cls_and_position(*patch_embed_gemm(emb.patch_embedding, pixel_values))
    return x, norm1(x)


def mlp_hidden(mlp: InternViTMLP, x: Tensor) -> Tensor:
    """GELU(fc1(x)): [B, T, C] -> [B*T, ff]; one GEMM with a GELU epilogue for a plain Linear fc1."""
    B, T, C = x.shape
    if isinstance(mlp.fc1, nn.Linear):
        return torch._addmm_activation(mlp.fc1.bias, x.reshape(B * T, C), mlp.fc1.weight.t(), use_gelu=True)
    return F.gelu(mlp.fc1(x.reshape(B * T, C)))


def fast_mix(attn: InternViTAttention, h: Tensor) -> Tensor:
    """attn.mix(h) as [B*T, C]: `vit_attention`'s kernel where it takes the shape (decided while tracing), else the
    q/k norm as one Triton pass, then SDPA. Both read the q/k norms' weights, so they stand for plain `RMSNorm`s
    only; other norms (split_overlap's ShardedRMSNorm, reduced over a TP group) keep the module's own `mix`."""
    B, T, C = h.shape
    if attn.qk_normalization and not all(type(n) is RMSNorm for n in (attn.q_norm, attn.k_norm)):
        return attn.mix(h).reshape(B * T, C)
    qkv = attn.qkv(h).reshape(B * T, -1)  # [B*T, 3C]
    H = qkv.shape[1] // 3 // attn.head_dim
    wq, wk, eps = (None, None, 0.0)
    if attn.qk_normalization:
        wq, wk, eps = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps
    attend = vit_attention if kernel_config(qkv, T, H) is not None else vit_attention_sdpa
    return attend(qkv, T, H, attn.head_dim**-0.5, wq, wk, eps)


def fast_layer(layer: InternViTLayer, x: Tensor, h: Tensor, next_norm: nn.Module) -> tuple[Tensor, Tensor]:
    """`layer(x)` given h = layer.norm1(x); also returns next_norm(x_out)."""
    B, T, C = x.shape
    x = x + layer.ls1 * layer.attn.proj(fast_mix(layer.attn, h)).view(B, T, C)
    h2 = layer.norm2(x)
    x = x + layer.ls2 * layer.mlp.fc2(mlp_hidden(layer.mlp, h2)).view(B, T, C)
    return x, next_norm(x)


def fast_layer_inplace(
    layer: InternViTLayer, x: Tensor, h: Tensor, shift: Tensor, next_norm: nn.Module
) -> tuple[Tensor, Tensor]:
    """`fast_layer` on a residual stream held as x [B*T, C] plus an fp32 column vector `shift` [C] (the biases so
    far), with the layer scales folded into proj / fc2 (`fold_scales`). Each residual is `x += a @ w^T` written by
    the GEMM itself, and each norm one pass over x + shift. Mutates x; returns (shift after this layer, next norm)."""
    B, T, C = h.shape
    a, m = layer.attn, layer.mlp
    addmm_into(x, fast_mix(a, h), a.proj.weight)
    shift = shift + a.proj.bias.float()
    h2 = shifted_norm(x, shift, *norm_params(layer.norm2))
    addmm_into(x, mlp_hidden(m, h2.view(B, T, C)), m.fc2.weight)
    shift = shift + m.fc2.bias.float()
    return shift, shifted_norm(x, shift, *norm_params(next_norm)).view(B, T, C)


def fold_scales(enc: VisionEncoder) -> None:
    """Fold each layer scale into its proj / fc2 weight and bias and set it to ones, in place: the module computes
    the same function, up to one rounding of ls * W to the weights' dtype."""
    with torch.inference_mode():  # also writes parameters created under inference mode
        for layer in enc.vit.layers:
            for lin, ls in ((layer.attn.proj, layer.ls1), (layer.mlp.fc2, layer.ls2)):
                if bool((ls == 1).all()):
                    continue
                s = ls.detach().float()
                lin.weight.copy_((s[:, None] * lin.weight.float()).to(lin.weight.dtype))
                lin.bias.copy_((s * lin.bias.float()).to(lin.bias.dtype))
                ls.fill_(1)


def fast_head(projector: Projector, x: Tensor, ratio: float) -> Tensor:
    """Drop CLS, pixel shuffle, project: [B, 1+N, C] -> [B, N*r^2, H]."""
    return projector(vit_to_tokens(x, ratio))


def tiles_dynamic(*ts: Tensor) -> None:
    """Mark dim 0 (tiles, or tiles x tokens) of each tensor dynamic, so a new tile count does not recompile (callers
    pass 2 tiles or more: Dynamo specializes a size of 1)."""
    for t in ts:
        torch._dynamo.mark_dynamic(t, 0)


def _mark_embed(embeddings, norm, px: Tensor) -> None:
    tiles_dynamic(px)


def _mark_layer(layer, x: Tensor, h: Tensor, *rest) -> None:
    tiles_dynamic(x, h)


def _mark_head(projector, x: Tensor, ratio: float) -> None:
    tiles_dynamic(x)


def fast_forward(
    enc: VisionEncoder,
    pixel_values: Tensor,
    embed: Callable = fast_embed,
    layer_fn: Callable = fast_layer,
    head: Callable = fast_head,
    layers: Sequence[InternViTLayer] | None = None,
) -> Tensor:
    """The whole encoder through `fast_layer` (pass compiled pieces to run compiled); `layers`: a subset, for
    compiling without computing every layer."""
    layers = enc.vit.layers if layers is None else layers
    x, h = embed(enc.vit.embeddings, layers[0].norm1, pixel_values)  # [B, 1+N, C] x2
    for i, layer in enumerate(layers):
        x, h = layer_fn(layer, x, h, layers[min(i + 1, len(layers) - 1)].norm1)  # the last: unused
    return head(enc.projector, x, enc.cfg.downsample_ratio)  # [B, num_image_token, H]


def fast_forward_inplace(
    enc: VisionEncoder,
    pixel_values: Tensor,
    embed: Callable = fast_embed,
    layer_fn: Callable = fast_layer_inplace,
    head: Callable = fast_head,
    layers: Sequence[InternViTLayer] | None = None,
) -> Tensor:
    """The whole encoder through `fast_layer_inplace`; `enc`'s layer scales must be folded (`fold_scales`)."""
    layers = enc.vit.layers if layers is None else layers
    x, h = embed(enc.vit.embeddings, layers[0].norm1, pixel_values)  # [B, 1+N, C] x2
    B, T, C = x.shape
    x = x.reshape(B * T, C)  # the residual stream (a fresh tensor), written in place from here on
    shift = torch.zeros(C, device=x.device, dtype=torch.float32)
    for i, layer in enumerate(layers):
        shift, h = layer_fn(layer, x, h, shift, layers[min(i + 1, len(layers) - 1)].norm1)  # the last: unused
    x = (x.float() + shift).to(x.dtype).view(B, T, C)
    return head(enc.projector, x, enc.cfg.downsample_ratio)  # [B, num_image_token, H]


@dataclass
class CompileStats:
    """What compilation cost, for the runner's log: the seconds of the first (compiling) call and the Dynamo graphs
    it compiled (None: not compiled yet)."""

    compile_s: float | None = None
    graphs: int = 0
    calls: int = 0
    tiles: int = 0
    padded_tiles: int = 0  # zero tiles run beside a lone tile

    @property
    def total_compile_s(self) -> float:
        return self.compile_s or 0.0

    def summary(self) -> str:
        return (f"vit compile {self.total_compile_s:.1f}s ({self.graphs} graphs); {self.calls} calls, {self.tiles} "
                f"tiles, {self.padded_tiles} padding")  # fmt: skip


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledEncoder:
    """Callable tiles -> tokens: the per-layer compiled fast forward of one VisionEncoder, for any tile count.

    Takes the in-place path (`fast_forward_inplace`) when every layer's linears are plain `nn.Linear`, folding the
    layer scales into `enc`'s own weights (so it changes `enc`: build it on the model it will serve); otherwise
    (FP8 linears) the plain path. The tile count is dynamic in the graphs (`tiles_dynamic`); a lone tile runs with a
    zero tile beside it (tiles never interact), so one set of graphs serves every call. Calls over `max_tiles` run in
    near-equal chunks of at most max_tiles (activation memory). `.stats` for the log.
    """

    def __init__(self, enc: VisionEncoder, max_tiles: int = 128, cache_dir: str | None = None) -> None:
        if max_tiles < 1:
            raise ValueError(f"max_tiles must be >= 1, got {max_tiles}")
        self.enc, self.max_tiles = enc, max_tiles
        self.stats = CompileStats()
        lins = [m for layer in enc.vit.layers for m in (layer.attn.proj, layer.mlp.fc1, layer.mlp.fc2)]
        self.inplace = all(type(m) is nn.Linear for m in lins)
        if self.inplace:
            fold_scales(enc)
        # static but for the dimensions `tiles_dynamic` marks; graphs saved under cache_dir (`Precompiled`)
        tag = f"{graph_key(enc.cfg)} {next(enc.parameters()).dtype}"
        layer = fast_layer_inplace if self.inplace else fast_layer
        self.embed = Precompiled(fast_embed, cache_dir, tag, mark=_mark_embed, dynamic=False)
        self.layer = Precompiled(layer, cache_dir, tag, mark=_mark_layer, dynamic=False)
        self.head = Precompiled(fast_head, cache_dir, tag, mark=_mark_head, dynamic=False)

    def _run(self, px: Tensor, layers: Sequence[InternViTLayer] | None = None) -> Tensor:
        # always inference mode and an inference tensor: Dynamo guards on both, so a warm-up under no_grad and an
        # engine call under inference_mode would otherwise compile everything twice
        with torch.inference_mode(), sdpa_context(SDPA_BACKEND, px.device):
            px = px if px.is_inference() else px.clone()
            forward = fast_forward_inplace if self.inplace else fast_forward
            return forward(self.enc, px, self.embed, self.layer, self.head, layers)

    def _call(self, px: Tensor, layers: Sequence[InternViTLayer] | None = None) -> Tensor:
        """Run px (2 tiles or more); the first (compiling) call timed into the stats."""
        if self.stats.compile_s is not None:
            return self._run(px, layers)
        g0, t0 = _graphs_compiled(), time.perf_counter()
        out = self._run(px, layers)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.stats.compile_s = time.perf_counter() - t0
        self.stats.graphs = _graphs_compiled() - g0
        return out

    def _call_padded(self, px: Tensor) -> Tensor:
        if px.shape[0] > 1:
            return self._call(px)
        self.stats.padded_tiles += 1
        return self._call(torch.cat([px, torch.zeros_like(px)]))[:1]

    def __call__(self, pixel_values: Tensor) -> Tensor:
        """[tiles, 3, S, S] -> [tiles, num_image_token, llm_hidden]."""
        n = pixel_values.shape[0]
        if n == 0:
            raise ValueError("no tiles to encode")
        self.stats.calls += 1
        self.stats.tiles += n
        outs = [self._call_padded(px) for px in pixel_values.tensor_split(-(-n // self.max_tiles))]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def warmup(self) -> CompileStats:
        """Compile up front, with max(2, max_tiles) zero tiles (the size most calls of a long job have, as Inductor's
        hint), through the first layer only: the others share its graph, so they would add compute, not compiles."""
        p = next(self.enc.parameters())
        S = self.enc.cfg.vision.image_size
        if self.stats.compile_s is None:
            px = torch.zeros(max(2, self.max_tiles), 3, S, S, device=p.device, dtype=p.dtype)
            self._call(px, self.enc.vit.layers[:1])
        return self.stats
