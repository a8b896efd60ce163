"""Fast InternViT forward: the eager modules and weights, regionally compiled one layer at a time.

Same math as `internvit.py`; what differs is only where the graph boundaries lie:

- one compiled graph per layer, shared by all layers (parameters are graph inputs, so 45 layers compile
  once per tile-count bucket, not 45 times);
- a layer's graph ends with the NEXT layer's norm1, so `ls2 * mlp + residual + norm1` is one Inductor
  kernel, as is `ls1 * attn + residual + norm2` inside the layer;
- qkv is one GEMM ([q; k; v] rows); the 6B's full-width q/k RMSNorm is one Triton pass per part over those rows
  (`fused_norm.qk_norm`: H200, 64 tiles, 0.407 ms against Inductor's 0.486, +0.4% for the 6B, session 15);
- SDPA runs under an explicit backend choice (flash / cuDNN / efficient) on GPU;
- fc1 + GELU is one cuBLASLt GEMM with a GELU epilogue (`gelu_epilogue`, on by default), which saves the MLP's
  widest elementwise pass (H200, 64 tiles: InternViT-6B 48.9 -> 50.4 tiles/s, 300M 604 -> 652). On CUDA that
  epilogue is GELU's tanh form, at most 4.7e-4 from exact GELU (at |x| = 2.7, where bf16's spacing is 1.6e-2);
  `bench/gpu_parity.py` bounds the bf16 feature error. On CPU the same call computes exact GELU;
- tile batches are padded up to a bucket so a long job compiles a handful of shapes, never one per count;
- each residual added by its GEMM in place (`fast_layer_inplace`): +1.2% (6B, session 14) and +1.4% (300M,
  session 9) on an H200 at 64 tiles (bench/RESULTS.md); the layer scales folded into copies of the proj / fc2
  weights, or into the encoder's own weights (`fold_in_place`, what the runner does).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchvl.encoder.fused_norm import addmm_into, norm_params, residual_norm, shifted_norm
from batchvl.encoder.internvit import (
    InternViTAttention,
    InternViTEmbeddings,
    InternViTLayer,
    InternViTMLP,
    Projector,
    RMSNorm,
    VisionEncoder,
    vit_to_tokens,
)
from batchvl.encoder.vit_attention import kernel_config, vit_attention, vit_attention_sdpa

# --------------------------------------------------------------------------- the fast forward (eager-callable)


def patch_embed_gemm(conv: nn.Conv2d, pixel_values: Tensor) -> tuple[Tensor, int, int]:
    """The stride-p patch conv as one GEMM over unfolded patches: [B, 3, S, S] -> ([B, N, C], gh, gw).

    The same sums as the conv. On an H200 at 64 tiles cuDNN's conv took 12.0 ms (6B) / 3.9 ms (300M), the GEMM
    with the unfold fused in front 0.59 / 0.30 ms (`bench/probe.py parts`)."""
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


def mlp_hidden(mlp: InternViTMLP, x: Tensor, gelu_epilogue: bool) -> Tensor:
    """GELU(fc1(x)): [B, T, C] -> [B*T, ff]; with gelu_epilogue one GEMM (cuBLASLt epilogue on CUDA)."""
    B, T, C = x.shape
    if gelu_epilogue:
        return torch._addmm_activation(mlp.fc1.bias, x.reshape(B * T, C), mlp.fc1.weight.t(), use_gelu=True)
    return F.gelu(mlp.fc1(x.reshape(B * T, C)))


def fast_mlp(mlp: InternViTMLP, x: Tensor) -> Tensor:
    """mlp(x) with fc1 + GELU in one GEMM (cuBLASLt epilogue on CUDA): [B, T, C] -> [B, T, C]. An fc1 that is not
    a plain Linear (FP8, `encoder/fp8.py`) runs the module's own forward."""
    if not isinstance(mlp.fc1, nn.Linear):
        return mlp(x)
    B, T, _ = x.shape
    return mlp.fc2(mlp_hidden(mlp, x, True)).view(B, T, -1)


def fast_mix(attn: InternViTAttention, h: Tensor, triton_attn: bool) -> Tensor:
    """attn.mix(h) as [B*T, C]. triton_attn: where `vit_attention`'s Triton kernel takes the shape (decided while
    tracing: device, dtype, head_dim, T), one call of it over the qkv rows (CLS-aware, qk-norm folded in); elsewhere
    the same sums as `mix` with the q/k RMSNorm as one Triton pass per part (`vit_attention_sdpa`), then SDPA;
    without triton_attn `mix` itself (the norms for Inductor to fuse). Both read the q/k norms' weights, so they
    stand for plain `RMSNorm` modules only; other norms (e.g. split_overlap's ShardedRMSNorm, whose mean square is
    all-reduced over a TP group) keep the module's own `mix`."""
    B, T, C = h.shape
    plain_norms = not attn.qk_normalization or all(type(n) is RMSNorm for n in (attn.q_norm, attn.k_norm))
    if not (triton_attn and plain_norms):
        return attn.mix(h).reshape(B * T, C)
    qkv = attn.qkv(h).reshape(B * T, -1)  # [B*T, 3C]
    H = qkv.shape[1] // 3 // attn.head_dim
    wq, wk, eps = (
        (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
        if attn.qk_normalization
        else (None, None, 0.0)
    )
    attend = vit_attention if kernel_config(qkv, T, H) is not None else vit_attention_sdpa
    return attend(qkv, T, H, attn.head_dim**-0.5, wq, wk, eps)


def fast_layer(
    layer: InternViTLayer,
    x: Tensor,
    h: Tensor,
    next_norm: nn.Module | None,
    gelu_epilogue: bool = False,
    fused_norm: bool = False,
    triton_attn: bool = False,
) -> tuple[Tensor, Tensor]:
    """`layer(x)` given h = layer.norm1(x); also returns next_norm(x_out) (x_out itself after the last layer).
    fused_norm: the residual + layer scale + next norm steps through `fused_norm.residual_norm` (plain Linear
    proj / fc2 only; FP8 layers take the other path). triton_attn: see `fast_mix`."""
    if fused_norm and all(isinstance(m, nn.Linear) for m in (layer.attn.proj, layer.mlp.fc1, layer.mlp.fc2)):
        return fast_layer_fused(layer, x, h, next_norm, gelu_epilogue, triton_attn)
    a = layer.attn.proj(fast_mix(layer.attn, h, triton_attn)).view(x.shape)  # qkv GEMM, attention, proj
    x = x + layer.ls1 * a
    h2 = layer.norm2(x)
    x = x + layer.ls2 * (fast_mlp(layer.mlp, h2) if gelu_epilogue else layer.mlp(h2))
    return x, (next_norm(x) if next_norm is not None else x)


def fast_layer_fused(
    layer: InternViTLayer, x: Tensor, h: Tensor, next_norm: nn.Module | None, gelu_epilogue: bool,
    triton_attn: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`fast_layer` with each "x + ls * (y + bias), then norm" as one `residual_norm` pass over [B*T, C] rows."""
    B, T, C = x.shape
    a, m = layer.attn, layer.mlp
    y = F.linear(fast_mix(a, h, triton_attn), a.proj.weight)  # [B*T, C], bias added in the next pass
    x, h2 = residual_norm(x.reshape(B * T, C), y, a.proj.bias, layer.ls1, *norm_params(layer.norm2))
    y = F.linear(mlp_hidden(m, h2.view(B, T, C), gelu_epilogue), m.fc2.weight)  # [B*T, C]
    if next_norm is None:
        x = x + layer.ls2 * (y + m.fc2.bias)
        return x.view(B, T, C), x.view(B, T, C)
    x, h = residual_norm(x, y, m.fc2.bias, layer.ls2, *norm_params(next_norm))
    return x.view(B, T, C), h.view(B, T, C)


def fast_layer_inplace(
    layer: InternViTLayer, x: Tensor, h: Tensor, shift: Tensor, next_norm: nn.Module | None,
    folded: tuple[Tensor, Tensor, Tensor, Tensor], gelu_epilogue: bool, triton_attn: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`fast_layer` with each residual added by the GEMM itself, in place: the residual stream is x [M, C] plus a
    column vector `shift` [C] (fp32) that collects the proj / fc2 biases times their layer scales, and the layer
    scales live in the weights (`fold_scales`: ls1 * proj, ls2 * fc2, and those biases). Each step is then
    `x += a @ (ls * w)^T` (cuBLAS reading x as its C) and one pass `h = norm(x + shift)`: two passes over [M, C]
    fewer per residual than `fast_layer_fused`. Mutates x; returns (shift after this layer, next_norm's output)."""
    B, T, C = h.shape
    a, m = layer.attn, layer.mlp
    w_proj, b_proj, w_fc2, b_fc2 = folded
    addmm_into(x, fast_mix(a, h, triton_attn), w_proj)
    shift = shift + b_proj
    h2 = shifted_norm(x, shift, *norm_params(layer.norm2))
    addmm_into(x, mlp_hidden(m, h2.view(B, T, C), gelu_epilogue), w_fc2)
    shift = shift + b_fc2
    if next_norm is None:
        return shift, h
    return shift, shifted_norm(x, shift, *norm_params(next_norm)).view(B, T, C)


def fold_scales(enc: VisionEncoder, in_place: bool = False) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per layer (ls1 * proj.weight, ls1 * proj.bias in fp32, ls2 * fc2.weight, ls2 * fc2.bias in fp32), each scale
    multiplying its linear's output rows; weights rounded once to their dtype. A layer scale of exactly ones takes
    the linear's own weight (no copy); any other a copy. in_place: first fold every scale into the encoder's own
    proj / fc2 weights and biases and set it to ones, so nothing is copied: the module then computes the same
    function, up to that one rounding of ls * W (and of ls * b) to the weights' dtype."""
    out = []
    with torch.inference_mode():  # also writes parameters created under inference mode
        for layer in enc.vit.layers:
            entry: list[Tensor] = []
            for lin, ls in ((layer.attn.proj, layer.ls1), (layer.mlp.fc2, layer.ls2)):
                if in_place and not bool((ls == 1).all()):
                    s = ls.detach().float()
                    lin.weight.copy_((s[:, None] * lin.weight.float()).to(lin.weight.dtype))
                    lin.bias.copy_((s * lin.bias.float()).to(lin.bias.dtype))
                    ls.fill_(1)
                if bool((ls == 1).all()):
                    entry += [lin.weight.detach(), lin.bias.detach().float()]
                else:
                    s = ls.detach().float()
                    entry += [(s[:, None] * lin.weight.detach().float()).to(lin.weight.dtype),
                              s * lin.bias.detach().float()]  # fmt: skip
            out.append(tuple(entry))
    return out


def fold_copy_bytes(enc: VisionEncoder) -> int:
    """What `fold_scales(enc)` copies: the proj / fc2 weights whose layer scale is not exactly ones."""
    return sum(
        lin.weight.nbytes
        for layer in enc.vit.layers
        for lin, ls in ((layer.attn.proj, layer.ls1), (layer.mlp.fc2, layer.ls2))
        if not bool((ls == 1).all())
    )


def fast_forward_inplace(
    enc: VisionEncoder, pixel_values: Tensor, folded: list, embed: Callable = fast_embed,
    layer_fn: Callable = fast_layer_inplace, head: Callable | None = None, gelu_epilogue: bool = False,
    triton_attn: bool = False,
) -> Tensor:  # fmt: skip
    """`fast_forward` through `fast_layer_inplace` (folded = `fold_scales(enc)`)."""
    layers = enc.vit.layers
    x, h = embed(enc.vit.embeddings, layers[0].norm1, pixel_values)  # [B, 1+N, C] x2
    B, T, C = x.shape
    x = x.reshape(B * T, C)  # the residual stream (a fresh tensor), written in place from here on
    shift = torch.zeros(C, device=x.device, dtype=torch.float32)
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].norm1 if i + 1 < len(layers) else None
        shift, h = layer_fn(layer, x, h, shift, nxt, folded[i], gelu_epilogue, triton_attn)
    x = (x.float() + shift).to(x.dtype).view(B, T, C)
    return (head or fast_head)(enc.projector, x, enc.cfg.downsample_ratio)  # [B, num_image_token, H]


def fast_head(projector: Projector, x: Tensor, ratio: float) -> Tensor:
    """Drop CLS, pixel shuffle, project: [B, 1+N, C] -> [B, N*r^2, H]."""
    return projector(vit_to_tokens(x, ratio))


def fast_forward(
    enc: VisionEncoder,
    pixel_values: Tensor,
    embed: Callable = fast_embed,
    layer_fn: Callable = fast_layer,
    head: Callable = fast_head,
    gelu_epilogue: bool = False,
    fused_norm: bool = False,
    triton_attn: bool = False,
) -> Tensor:
    """The whole encoder through the fast pieces (pass compiled versions of them to run compiled)."""
    layers = enc.vit.layers
    x, h = embed(enc.vit.embeddings, layers[0].norm1, pixel_values)  # [B, 1+N, C] x2
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].norm1 if i + 1 < len(layers) else None
        x, h = layer_fn(layer, x, h, nxt, gelu_epilogue, fused_norm, triton_attn)
    return head(enc.projector, x, enc.cfg.downsample_ratio)  # [B, num_image_token, H]


# --------------------------------------------------------------------------- SDPA backend


def sdpa_context(
    backend: str = "auto", device: torch.device | str = "cpu"
) -> contextlib.AbstractContextManager:
    """Prefer one SDPA backend ("flash" | "cudnn" | "efficient" | "math"); "auto" keeps torch's choice."""
    if backend == "auto" or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    first = names[backend]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        rest = [b for b in names.values() if b != first]
        return sdpa_kernel([first, *rest], set_priority=True)  # falls back if `first` can't take the shape
    return sdpa_kernel([first])


# --------------------------------------------------------------------------- compile modes

COMPILE_MODES = ("default", "tuned", "multi-kernel", "max-autotune-no-cudagraphs")


def compile_kwargs(mode: str) -> dict:
    """torch.compile arguments for a ViT compile mode: "default"; "tuned", the default plus Inductor's
    coordinate-descent search over its own fused kernels' launch configs (norms, residuals; the GEMMs stay
    cuBLAS); "multi-kernel", the default with each reduction (the residual + norm kernels) generated both
    persistent and looped and the faster one picked on first run (Inductor only makes a norm over 1024 columns
    persistent when it reads its inputs as plain rows, and never over 3200); or a torch.compile mode name.

    "tuned" on an H200 at 64 tiles: +0.3% (6B) and +2.3% (300M) throughput for ~18 s more compile per bucket
    (bench/RESULTS.md). On a cold Inductor cache that pays back only after about 9 h (6B) or 1 h (300M) of ViT
    time, so it is not the default; Inductor's cache makes later runs start fast either way."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown ViT compile mode {mode!r}; choose one of {COMPILE_MODES}")
    if mode == "default":
        return {}
    if mode == "tuned":
        return {"options": {"coordinate_descent_tuning": True}}
    if mode == "multi-kernel":
        return {"options": {"triton.multi_kernel": 1}}
    return {"mode": mode}


# --------------------------------------------------------------------------- buckets and stats


def default_buckets(max_tiles: int = 128) -> list[int]:
    """1, 2, 4, 8, 16, then multiples of 16 up to max_tiles (padding waste <= 2x below 16, < 16 tiles above)."""
    out = [b for b in (1, 2, 4, 8, 16) if b < max_tiles]
    out += list(range(16, max_tiles + 1, 16)) if max_tiles >= 16 else []
    return sorted(set(out + [max_tiles]))


def bucket_for(n: int, buckets: list[int]) -> int:
    """Smallest bucket >= n (n must not exceed the largest)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} tiles exceed the largest bucket {buckets[-1]}")


def bucket_plan(n: int, buckets: list[int], min_split: int = 16) -> list[int]:
    """The calls (each a bucket size, computed in order over consecutive tiles) that encode n tiles.

    Full largest buckets first; a rest takes the largest bucket that fits in it while that is >= min_split, and
    the last small rest is padded up to its bucket. So 231 tiles over the default buckets run as 128 + 96 + 8
    (one padded tile) rather than 128 + 112 (nine): the 8B seed job's batches of 33 requests x 7 tiles."""
    plan, rest, top = [], n, buckets[-1]
    while rest > 0:
        b = top if rest >= top else bucket_for(rest, buckets)
        lower = max((x for x in buckets if x <= rest), default=0)
        if b > rest and lower >= min_split:
            b = lower  # exact, no padding; the rest goes on
        plan.append(b)
        rest -= b
    return plan


@dataclass
class CompileStats:
    """What compilation cost, for the runner's log."""

    mode: str = "default"
    buckets: list[int] = field(default_factory=list)
    # bucket -> seconds of its first (compiling) call, and the Dynamo graphs that call compiled
    compile_s: dict[int, float] = field(default_factory=dict)
    graphs: dict[int, int] = field(default_factory=dict)
    calls: int = 0
    tiles: int = 0
    padded_tiles: int = 0  # dummy tiles computed for padding
    caches: dict[str, object] = field(default_factory=dict)  # Inductor cache settings in effect

    @property
    def total_compile_s(self) -> float:
        return sum(self.compile_s.values())

    def summary(self) -> str:
        per = ", ".join(f"{b}:{s:.1f}s" for b, s in sorted(self.compile_s.items()))
        pad = self.padded_tiles / max(self.tiles, 1)
        return f"vit compile {self.total_compile_s:.1f}s ({per}); {self.calls} calls, padding {pad:.1%}"


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


_ENTRIES_NEEDED = (
    0  # Dynamo cache entries that all CompiledEncoders of this process may create per code object
)


def _raise_recompile_limit(entries: int) -> None:
    """Buckets (and encoders) recompile the same code objects: keep Dynamo's per-code limit above their sum."""
    global _ENTRIES_NEEDED
    _ENTRIES_NEEDED += entries
    cfg = torch._dynamo.config
    for name, need in (
        ("recompile_limit", _ENTRIES_NEEDED),
        ("accumulated_recompile_limit", 4 * _ENTRIES_NEEDED),
    ):
        old = name.replace("recompile_limit", "cache_size_limit")
        attr = name if hasattr(cfg, name) else old  # renamed in torch 2.7-ish; both exist as aliases later
        if hasattr(cfg, attr) and getattr(cfg, attr) < need:
            setattr(cfg, attr, need)


def _cache_settings(cache_dir: str | None) -> dict[str, object]:
    if cache_dir:  # read lazily by Inductor, so this works as long as nothing has compiled yet
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser(cache_dir))
    ind = torch._inductor.config
    return {
        "fx_graph_cache": getattr(ind, "fx_graph_cache", None),
        "autograd_cache": getattr(torch._functorch.config, "enable_autograd_cache", None),
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(default)"),
    }


# --------------------------------------------------------------------------- the compiled encoder


# `CompiledEncoder(inplace_residual=None)`: the most its weight copies may take for the in-place path to be on
INPLACE_AUTO_MAX_BYTES = 1 << 30


class CompiledEncoder:
    """Callable tiles -> tokens: bucket-padded, per-layer compiled fast forward of one VisionEncoder.

    mode: one of `COMPILE_MODES` (see `compile_kwargs`); `.stats` for the log. Tile counts are padded up to
    `buckets` (default: `default_buckets(max_tiles)`); larger calls run in several (`bucket_plan`).
    `cache_dir` sets TORCHINDUCTOR_CACHE_DIR (if unset) for the FX/AOT/autotune caches.
    attn_backend: the SDPA backend tried first ("cudnn" measured fastest at these shapes on an H200; the others
    are the fallback). gelu_epilogue: fc1 + GELU as one cuBLASLt GEMM (module docstring); off: exact GELU in Inductor.
    fused_norm: residual + layer scale + next norm as one Triton pass per row (`fused_norm.residual_norm`).
    inplace_residual: instead, each residual added by its GEMM in place (`fast_layer_inplace`); keeps a copy of the
    proj and fc2 weights with the layer scales folded in (plain Linear layers only). None (the default): on where
    those copies take at most `INPLACE_AUTO_MAX_BYTES` (InternViT-300M: 0.25 GB in bf16; the 6B's 4.6 GB stay off)
    and the layers are plain Linear (not FP8).
    fold_in_place: fold the layer scales into `enc`'s own weights instead (mutates enc: `fold_scales(in_place=True)`),
    so the in-place path copies nothing and is on at any size under None. The runner does this (the engine owns its
    model); off by default, since it changes the caller's module.
    triton_attn: attention through `vit_attention`'s CLS-aware Triton kernel where it has a config (the 300M), else
    SDPA after a Triton q/k RMSNorm (the 6B) (`fast_mix`).
    """

    def __init__(
        self,
        enc: VisionEncoder,
        mode: str = "default",
        dynamic: bool = False,
        max_tiles: int = 128,
        buckets: list[int] | None = None,
        attn_backend: str = "cudnn",
        cache_dir: str | None = None,
        gelu_epilogue: bool = True,
        fused_norm: bool = True,
        inplace_residual: bool | None = None,
        triton_attn: bool = True,
        fold_in_place: bool = False,
    ) -> None:
        self.enc, self.dynamic, self.attn_backend, self.triton_attn = enc, dynamic, attn_backend, triton_attn
        self.gelu_epilogue, self.fused_norm = gelu_epilogue, fused_norm
        self.buckets = sorted(buckets) if buckets else default_buckets(max_tiles)
        self.stats = CompileStats(mode=mode, buckets=self.buckets, caches=_cache_settings(cache_dir))
        # fast_layer: with/without next norm per bucket, and room to spare: a hit limit fails hard (fullgraph)
        _raise_recompile_limit(4 * len(self.buckets))
        opts = dict(**compile_kwargs(mode), dynamic=dynamic, fullgraph=True)
        lins = [m for layer in enc.vit.layers for m in (layer.attn.proj, layer.mlp.fc1, layer.mlp.fc2)]
        plain = all(type(m) is nn.Linear for m in lins)
        if fold_in_place and plain:
            fold_scales(enc, in_place=True)  # the layer scales into the weights: nothing left to copy
        if inplace_residual is None:  # auto: on where the folded copies are small
            inplace_residual = plain and fold_copy_bytes(enc) <= INPLACE_AUTO_MAX_BYTES
        if inplace_residual and not plain:
            raise ValueError("inplace_residual needs plain Linear layers (not FP8)")
        self.inplace_residual = inplace_residual
        self.folded = None  # `fold_scales`, on the first call
        self.embed = torch.compile(fast_embed, **opts)
        self.layer = torch.compile(fast_layer_inplace if inplace_residual else fast_layer, **opts)
        self.head = torch.compile(fast_head, **opts)

    def _run(self, px: Tensor) -> Tensor:
        # always inference mode and an inference tensor: Dynamo guards on both, so a warm-up under no_grad and an
        # engine call under inference_mode would otherwise compile every bucket twice
        with torch.inference_mode(), sdpa_context(self.attn_backend, px.device):
            px = px if px.is_inference() else px.clone()
            if self.inplace_residual:
                if self.folded is None:  # not in __init__: an encoder built but unused costs nothing
                    self.folded = fold_scales(self.enc)
                return fast_forward_inplace(
                    self.enc, px, self.folded, self.embed, self.layer, self.head, self.gelu_epilogue,
                    self.triton_attn,
                )  # fmt: skip
            return fast_forward(
                self.enc, px, self.embed, self.layer, self.head, self.gelu_epilogue, self.fused_norm,
                self.triton_attn,
            )  # fmt: skip

    def _chunks(self, n: int) -> Iterator[tuple[int, int, int]]:
        """(start, tiles, bucket) per call, as `bucket_plan` splits n."""
        s = 0
        for b in bucket_plan(n, self.buckets):
            yield s, min(b, n - s), b
            s += b

    def __call__(self, pixel_values: Tensor) -> Tensor:
        """[tiles, 3, S, S] -> [tiles, num_image_token, llm_hidden]."""
        n = pixel_values.shape[0]
        self.stats.calls += 1
        self.stats.tiles += n
        if self.dynamic:
            return self._run(pixel_values)
        outs = []
        for s, m, b in self._chunks(n):
            px = pixel_values[s : s + m]
            if b > m:
                px = F.pad(px, (0, 0, 0, 0, 0, 0, 0, b - m))  # zero tiles; tiles never interact
                self.stats.padded_tiles += b - m
            if b not in self.stats.compile_s:
                g0, t0 = _graphs_compiled(), time.perf_counter()
                out = self._run(px)
                if out.is_cuda:
                    torch.cuda.synchronize(out.device)
                self.stats.compile_s[b] = time.perf_counter() - t0
                self.stats.graphs[b] = _graphs_compiled() - g0
            else:
                out = self._run(px)
            outs.append(out[:m])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def warmup(self, sizes: list[int] | None = None) -> CompileStats:
        """Compile the given buckets (all by default) up front with zero tiles."""
        p = next(self.enc.parameters())
        S = self.enc.cfg.vision.image_size
        for b in sizes or self.buckets:
            self(torch.zeros(b, 3, S, S, device=p.device, dtype=p.dtype))
        return self.stats


compile_encoder = CompiledEncoder  # the call site's one line: `encode = compile_encoder(model.vision, ...)`


def padded_fraction(n: int, buckets: list[int]) -> float:
    """Share of computed tiles that are padding for a call with n tiles."""
    computed = sum(bucket_plan(n, buckets))
    return 1 - n / computed if computed else 0.0


__all__ = [
    "COMPILE_MODES",
    "CompileStats",
    "CompiledEncoder",
    "bucket_plan",
    "compile_encoder",
    "compile_kwargs",
    "fast_forward",
    "fast_layer",
    "sdpa_context",
]
