"""Multi-GPU InternViT: tensor parallel (with split-batch comm/compute overlap) or data parallel.

Tensor parallel is applied from outside the model (`shard_vit_tp` slices the eager modules' weights in place):
qkv and fc1 are column-parallel, proj and fc2 row-parallel with one all-reduce each, the projector stays
replicated. The 6B's q/k RMSNorm runs over the FULL hidden size (3200), so each rank all-reduces the
per-token sum of squares of its channel shard before normalizing (normalizing over the local shard only,
as lmdeploy first did, changes the result).

Heads that don't divide (InternViT-6B: 25 heads on 4 ranks) are split UNEVENLY, 7/6/6/6, rather than padded
with dummy heads to 28: the slowest rank does 7 heads' work either way, so padding buys no speed, while it
costs 12% more weights and FLOPs everywhere and would need the dummy channels masked out of the full-width
qk-norm mean. The MLP width is split the same way (12800 divides by 2, 4 and 8, so it is even there).

`TPVisionEncoder` splits the tile batch into micro-batches and runs them round-robin through the layers, each
written as a generator that yields at every collective: while micro-batch i's all-reduce is in flight
(`async_op=True`, waited just before i resumes), micro-batch i+1 computes. One micro-batch is plain TP.

`DPVisionEncoder` keeps the weights replicated; each rank encodes a contiguous share of the tiles and the
features are all-gathered (uneven shares padded to the largest) back into tile order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from batchvl.config import InternVLConfig, VisionConfig
from batchvl.encoder.internvit import InternViTLayer, InternViTMLP, VisionEncoder, vit_to_tokens


def split_sizes(n: int, world: int) -> list[int]:
    """n items over `world` ranks as evenly as possible, larger shares first (25 over 4 -> 7, 6, 6, 6)."""
    return [n // world + (r < n % world) for r in range(world)]


def _share(n: int, world: int, rank: int) -> slice:
    sizes = split_sizes(n, world)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def all_reduce_sum(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The one all-reduce of the tensor-parallel ViT (in place in eager, functional under torch.compile)."""
    if torch.compiler.is_compiling():
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(t, "sum", group or dist.group.WORLD)
    dist.all_reduce(t, group=group)
    return t


# --------------------------------------------------------------------------- tensor-parallel sharding


class ShardedRMSNorm(nn.Module):
    """RMSNorm whose feature dim is split over ranks: the mean square is taken over the FULL width."""

    def __init__(self, weight: Tensor, full_dim: int, eps: float, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.full_dim, self.eps, self.group = full_dim, eps, group

    def local_sumsq(self, x: Tensor) -> Tensor:
        return x.float().pow(2).sum(-1, keepdim=True)  # [..., 1] fp32

    def finish(self, x: Tensor, sumsq: Tensor) -> Tensor:
        xf = x.float() * torch.rsqrt(sumsq / self.full_dim + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.finish(x, all_reduce_sum(self.local_sumsq(x), self.group))


def _reduce_hook(lin: nn.Linear, args: tuple, out: Tensor) -> Tensor:
    return all_reduce_sum(out, lin.tp_group) + lin.reduced_bias


def _column_parallel_(lin: nn.Linear, rows: Tensor | slice) -> None:
    lin.weight = nn.Parameter(lin.weight.detach()[rows].clone())
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias.detach()[rows].clone())
    lin.out_features = lin.weight.shape[0]


def _row_parallel_(lin: nn.Linear, cols: slice, group: dist.ProcessGroup | None) -> None:
    """Keep input columns `cols`; the bias is added once, after the all-reduce (forward hook)."""
    lin.weight = nn.Parameter(lin.weight.detach()[:, cols].clone())
    lin.in_features = lin.weight.shape[1]
    bias = lin.bias
    lin.bias = None
    lin.register_parameter("reduced_bias", bias)
    lin.tp_group = group
    lin.register_forward_hook(_reduce_hook)


def shard_vit_tp(enc: VisionEncoder, group: dist.ProcessGroup | None = None) -> None:
    """Slice the ViT's weights in place for this rank; afterwards `enc(px)` is plain (non-overlapped) TP."""
    if hasattr(enc, "tp_group"):
        raise ValueError("encoder is already sharded")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    v = enc.cfg.vision
    C, D = v.hidden_size, v.head_dim
    if v.num_heads < world:
        raise ValueError(f"{v.num_heads} heads cannot be split over {world} ranks")
    h = _share(v.num_heads, world, rank)
    ch = slice(h.start * D, h.stop * D)  # this rank's channels within q, k and v
    qkv_rows = torch.cat([torch.arange(ch.start, ch.stop) + j * C for j in range(3)])
    ff = _share(v.intermediate_size, world, rank)
    for layer in enc.vit.layers:
        a = layer.attn
        _column_parallel_(a.qkv, qkv_rows)  # [3 * local C, C], still [q; k; v]
        if a.qk_normalization:
            a.q_norm = ShardedRMSNorm(a.q_norm.weight[ch], C, a.q_norm.eps, group)
            a.k_norm = ShardedRMSNorm(a.k_norm.weight[ch], C, a.k_norm.eps, group)
        _row_parallel_(a.proj, ch, group)
        _column_parallel_(layer.mlp.fc1, ff)
        _row_parallel_(layer.mlp.fc2, ff, group)
    enc.tp_group = group


# --------------------------------------------------------------------------- TP layer as comm-delimited stages


def tp_attn_in(layer: InternViTLayer, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """norm1 + local qkv (+ local q/k sums of squares [B, T, 2] to all-reduce)."""
    a = layer.attn
    q, k, v = a.qkv(layer.norm1(x)).chunk(3, dim=-1)  # 3 x [B, T, local C]
    ss = torch.cat([a.q_norm.local_sumsq(q), a.k_norm.local_sumsq(k)], -1) if a.qk_normalization else None
    return q, k, v, ss


def tp_attn_out(layer: InternViTLayer, q: Tensor, k: Tensor, v: Tensor, ss: Tensor | None) -> Tensor:
    """qk-norm with the global sums, local heads' SDPA, partial proj [B, T, C] to all-reduce."""
    a = layer.attn
    B, T, _ = q.shape
    if ss is not None:
        q, k = a.q_norm.finish(q, ss[..., :1]), a.k_norm.finish(k, ss[..., 1:])
    q, k, v = (t.reshape(B, T, -1, a.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, local H, T, D]
    o = F.scaled_dot_product_attention(q, k, v, scale=a.head_dim**-0.5)
    return F.linear(o.transpose(1, 2).reshape(B, T, -1), a.proj.weight)


def tp_mlp(layer: InternViTLayer, x: Tensor, o: Tensor) -> tuple[Tensor, Tensor]:
    """Attention residual, norm2, local fc1/gelu, partial fc2 [B, T, C] to all-reduce."""
    x = x + layer.ls1 * (o + layer.attn.proj.reduced_bias)
    m: InternViTMLP = layer.mlp
    return x, F.linear(F.gelu(m.fc1(layer.norm2(x))), m.fc2.weight)


def tp_residual(layer: InternViTLayer, x: Tensor, f: Tensor) -> Tensor:
    """MLP residual with the reduced fc2 output."""
    return x + layer.ls2 * (f + layer.mlp.fc2.reduced_bias)


TP_STAGES: dict[str, Callable] = dict(
    attn_in=tp_attn_in, attn_out=tp_attn_out, mlp=tp_mlp, residual=tp_residual
)


def tp_vit_steps(enc: VisionEncoder, x: Tensor, fns: dict[str, Callable] = TP_STAGES) -> Generator:
    """All layers for one micro-batch; yields each tensor to all-reduce and receives the reduced sum."""
    for layer in enc.vit.layers:
        q, k, v, ss = fns["attn_in"](layer, x)
        if ss is not None:
            ss = yield ss
        o = yield fns["attn_out"](layer, q, k, v, ss)
        x, f = fns["mlp"](layer, x, o)
        f = yield f
        x = fns["residual"](layer, x, f)
    return x


def run_interleaved(gens: list[Generator], group: dist.ProcessGroup | None) -> list[Tensor]:
    """Round-robin the generators; one's async all-reduce is in flight while the next one computes."""
    results: list = [None] * len(gens)
    pending: dict[int, tuple[Tensor, dist.Work]] = {}

    def advance(i: int, value: Tensor | None) -> None:
        try:
            t = gens[i].send(value)
        except StopIteration as stop:
            results[i] = stop.value
            return
        pending[i] = (t, dist.all_reduce(t, group=group, async_op=True))

    for i in range(len(gens)):
        advance(i, None)
    while pending:
        for i in sorted(pending):  # same order on every rank, so collectives match up
            t, work = pending.pop(i)
            work.wait()  # NCCL: the compute stream waits, the host does not
            advance(i, t)
    return results


class TPVisionEncoder(nn.Module):
    """Tensor-parallel VisionEncoder whose forward overlaps micro-batches' all-reduces with compute."""

    def __init__(
        self,
        enc: VisionEncoder,
        group: dist.ProcessGroup | None = None,
        micro_batches: int = 2,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if not hasattr(enc, "tp_group"):
            shard_vit_tp(enc, group)
        self.enc, self.group, self.micro_batches = enc, group, micro_batches
        # dynamic: the micro-batches' tile counts vary from call to call (no buckets here)
        opts = dict(dynamic=True, fullgraph=True)
        self.fns = {k: torch.compile(f, **opts) for k, f in TP_STAGES.items()} if compile else TP_STAGES

    @torch.no_grad()
    def forward(self, pixel_values: Tensor) -> Tensor:
        """[tiles, 3, S, S] -> [tiles, num_image_token, H], identical on every rank."""
        x = self.enc.vit.embeddings(pixel_values)  # [B, 1+N, C], replicated
        chunks = x.tensor_split(max(1, min(self.micro_batches, x.shape[0])))
        outs = run_interleaved([tp_vit_steps(self.enc, c, self.fns) for c in chunks], self.group)
        return self.enc.projector(vit_to_tokens(torch.cat(outs), self.enc.cfg.downsample_ratio))


# --------------------------------------------------------------------------- data parallel


def all_gather_uneven(x: Tensor, sizes: list[int], group: dist.ProcessGroup | None = None) -> Tensor:
    """Concatenate every rank's x (dim 0 of length sizes[rank]) in rank order on all ranks."""
    top = max(sizes)
    if x.shape[0] < top:
        x = torch.cat([x, x.new_zeros(top - x.shape[0], *x.shape[1:])])
    bufs = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(bufs, x.contiguous(), group=group)
    return torch.cat([b[:s] for b, s in zip(bufs, sizes, strict=True)])


class DPVisionEncoder(nn.Module):
    """Replicated VisionEncoder; each rank encodes a contiguous share of the tiles, all ranks get all features."""

    def __init__(
        self, enc: VisionEncoder, group: dist.ProcessGroup | None = None, encode: Callable | None = None
    ) -> None:
        super().__init__()
        self.enc, self.group = enc, group
        self.encode = encode or enc  # e.g. a CompiledEncoder of the same enc

    @torch.no_grad()
    def forward(self, pixel_values: Tensor) -> Tensor:
        """[tiles, 3, S, S] (the same on every rank) -> [tiles, num_image_token, H] on every rank."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        sizes = split_sizes(pixel_values.shape[0], world)
        mine = pixel_values[_share(pixel_values.shape[0], world, rank)]
        if mine.shape[0]:
            out = self.encode(mine)
        else:
            w = self.enc.projector.fc2.weight
            out = w.new_zeros(0, self.enc.cfg.num_image_token, w.shape[0])
        return all_gather_uneven(out, sizes, self.group)


# --------------------------------------------------------------------------- choosing a mode

# Defaults, replaced by measured numbers when given:
#   flops_per_s  achieved bf16 rate of one GPU on the ViT
#   t_tile       seconds per tile on one GPU (overrides flops_per_s)
#   bus_bw       all-reduce bus bandwidth in bytes/s (nccl-tests "busbw"; the default a conservative NVLink figure)
#   latency_s    fixed cost per collective
#   overlap      share of TP communication hidden by split-batch overlap (0: none)
#   tp_gemm_eff  efficiency of the 1/world-wide GEMMs relative to full-width ones
COST_DEFAULTS = dict(flops_per_s=628e12, bus_bw=350e9, latency_s=25e-6, overlap=0.0, tp_gemm_eff=0.9)


def vit_flops_per_tile(v: VisionConfig) -> tuple[float, float]:
    """(attention-side, MLP-side) FLOPs of one tile through the ViT layers (the projector not counted)."""
    T, C, ff = v.num_patches + 1, v.hidden_size, v.intermediate_size
    attn = 2 * T * 4 * C * C + 4 * T * T * C  # qkv + proj GEMMs, QK^T and PV
    return v.num_layers * attn, v.num_layers * 2 * T * 2 * C * ff


def vit_mode_costs(
    tiles: int, cfg: InternVLConfig, world: int, measured: dict | None = None
) -> dict[str, float]:
    """Estimated seconds of the ViT for `tiles` tiles in each mode ("dp", "tp")."""
    p = {**COST_DEFAULTS, **(measured or {})}
    v = cfg.vision
    attn, mlp = vit_flops_per_tile(v)
    t_tile = p.get("t_tile") or (attn + mlp) / p["flops_per_s"]
    bytes_el = p.get("bytes_per_el", 2)

    def coll(nbytes: float) -> float:  # ring all-reduce
        return 2 * (world - 1) / world * nbytes / p["bus_bw"] + p["latency_s"]

    out_bytes = tiles * cfg.num_image_token * cfg.llm.hidden_size * bytes_el
    dp = math.ceil(tiles / world) * t_tile + (world - 1) / world * out_bytes / p["bus_bw"] + p["latency_s"]
    # the slowest rank holds the most heads / MLP columns
    skew = (
        attn * max(split_sizes(v.num_heads, world)) / v.num_heads
        + mlp * max(split_sizes(v.intermediate_size, world)) / v.intermediate_size
    ) / (attn + mlp)
    compute = tiles * t_tile * skew / p["tp_gemm_eff"]
    act = tiles * (v.num_patches + 1) * v.hidden_size * bytes_el
    per_layer = 2 * coll(act) + (coll(tiles * (v.num_patches + 1) * 8) if v.qk_normalization else 0.0)
    tp = compute + (1 - p["overlap"]) * v.num_layers * per_layer
    return {"dp": dp, "tp": tp}


def choose_vit_mode(tiles: int, cfg: InternVLConfig, world: int, measured: dict | None = None) -> str:
    """ "tp" or "dp", whichever the cost model says is faster for this many tiles (DP on ties and world 1)."""
    if world <= 1 or tiles <= 0:
        return "dp"
    c = vit_mode_costs(tiles, cfg, world, measured)
    return "tp" if c["tp"] < c["dp"] else "dp"
