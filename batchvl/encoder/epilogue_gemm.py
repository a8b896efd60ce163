"""InternViT's linears with the layer's elementwise work inside the GEMM (Triton: persistent, TMA tile loads).

A layer of the compiled encoder otherwise writes each row-parallel GEMM's output, reads it back with the residual in
`fused_norm.residual_norm`, and writes the residual stream and the next norm's output, which the next GEMM reads.
Here the norm's output is never written:

- `gemm_residual(a, w, bias, ls, x)`: x + ls * (a @ w^T + bias) from the epilogue, plus the new rows' sums and
  sums of squares (fp32, added up over the row's output tiles by atomics): the next norm's statistics.
- `gemm_normed(x, stats, w_f, colsum, bias_f, ...)`: norm(x) @ w^T + bias with the norm folded in. A norm is
  per row (mean, rstd) and per column (weight g, bias c), and the row part commutes with the product:
  `((x - mean) * rstd * g + c) @ w^T + b = rstd * (x @ (w * g)^T - mean * colsum) + (b + w @ c)`, where
  colsum = the rows of w * g summed (`fold_norm` precomputes w * g, colsum and the bias). mean = 0 for RMSNorm.
  Optionally exact GELU on the result (fc1).

Numerics differ from the eager layer's only in rounding: the GEMM reads x (bf16) instead of the rounded normalized
rows, the statistics come from the fp32 sum before it is rounded for storage (as `residual_norm` does), and w * g
is rounded once to the weights' dtype. Registered with `torch.library` plus fake implementations, so a compiled
layer traces each as one opaque node; off CUDA (or without Triton) they run `*_reference`, the same sums in torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the ops run the references
    triton = None


# --------------------------------------------------------------------------- the folded norm


@dataclass
class FoldedLinear:
    """norm followed by linear, as `gemm_normed` takes them: w_f = w * g [N, K], colsum [N] and bias_f [N] fp32."""

    w_f: Tensor
    colsum: Tensor
    bias_f: Tensor
    eps: float
    rms: bool


def fold_norm(norm: nn.Module, linear: nn.Linear) -> FoldedLinear:
    """Fold a LayerNorm or InternViT RMSNorm (its weight g, bias c) into the linear that follows it."""
    w = linear.weight.detach()
    g = norm.weight.detach().float()
    w_f = (w.float() * g).to(w.dtype)  # [N, K]
    bias_f = (
        linear.bias.detach().float() if linear.bias is not None else torch.zeros(w.shape[0], device=w.device)
    )
    rms = not isinstance(norm, nn.LayerNorm)
    if not rms and norm.bias is not None:
        bias_f = bias_f + w.float() @ norm.bias.detach().float()
    return FoldedLinear(w_f, w_f.float().sum(-1), bias_f, norm.eps, rms)


def row_stats(x: Tensor) -> Tensor:
    """[M, C] -> [2, M] fp32: each row's sum and sum of squares (what `gemm_residual` returns for its output)."""
    xf = x.float()
    return torch.stack([xf.sum(-1), xf.pow(2).sum(-1)])


def norm_of_stats(stats: Tensor, C: int, eps: float, rms: bool) -> tuple[Tensor, Tensor]:
    """[2, M] sums -> (mean [M], rstd [M]); mean = 0 for RMSNorm."""
    if rms:
        return torch.zeros_like(stats[0]), torch.rsqrt(stats[1] / C + eps)
    mean = stats[0] / C
    return mean, torch.rsqrt((stats[1] / C - mean * mean).clamp_min(0.0) + eps)


# --------------------------------------------------------------------------- references (CPU, and the meaning)


def gemm_residual_reference(
    a: Tensor, w: Tensor, bias: Tensor, ls: Tensor, x: Tensor
) -> tuple[Tensor, Tensor]:
    """a [M, K], w [N, K], x [M, N] -> (x + ls * (a @ w^T + bias) [M, N], its row_stats [2, M])."""
    y = x.float() + ls.float() * (a.float() @ w.float().t() + bias.float())
    return y.to(x.dtype), torch.stack([y.sum(-1), y.pow(2).sum(-1)])


def gemm_normed_reference(
    x: Tensor, stats: Tensor, w_f: Tensor, colsum: Tensor, bias_f: Tensor, eps: float, rms: bool, gelu: bool
) -> Tensor:
    """x [M, K] with row_stats(x) -> norm(x) @ w^T + bias [M, N] through the folded form (exact GELU if gelu)."""
    mean, rstd = norm_of_stats(stats, x.shape[-1], eps, rms)
    y = rstd[:, None] * (x.float() @ w_f.float().t() - mean[:, None] * colsum[None, :]) + bias_f[None, :]
    return (F.gelu(y) if gelu else y).to(x.dtype)


# --------------------------------------------------------------------------- the kernel

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps): the configs `triton.autotune` tries per shape
CONFIGS = [
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 5, 4),
    (256, 128, 64, 8, 3, 8),
]

if triton is not None:

    @triton.jit
    def _grouped_tile(tile, n_m, n_n, GROUP_M: tl.constexpr):
        """Output tile number -> (pid_m, pid_n) in grouped order: GROUP_M row tiles in a row share the weight
        tiles they read while those sit in L2."""
        per_group = GROUP_M * n_n
        first_m = (tile // per_group) * GROUP_M
        size_m = min(n_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m

    @triton.jit
    def _epilogue_gemm_kernel(
        A, B, C, X, LS, BIAS, STATS_IN, COLSUM, STATS_OUT, M, N, K, eps,
        EPI: tl.constexpr, RMS: tl.constexpr, GELU: tl.constexpr, NUM_SMS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        """C = A @ B^T with EPI 1: X + LS * (acc + BIAS), its row sums / sums of squares added into STATS_OUT
        [2, M]; EPI 2: rstd * (acc - mean * COLSUM) + BIAS from STATS_IN [2, M] (the norm of A), GELU if set."""
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
        c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        x_desc = tl.make_tensor_descriptor(X, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        n_m, n_n, k_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_SMS, flatten=True):
            pid_m, pid_n = _grouped_tile(tile, n_m, n_n, GROUP_M)
            om, on = pid_m * BLOCK_M, pid_n * BLOCK_N
            rows, cols = om + tl.arange(0, BLOCK_M), on + tl.arange(0, BLOCK_N)
            rmask, cmask = rows < M, cols < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
            for kk in range(k_tiles):
                a = a_desc.load([om, kk * BLOCK_K])  # [BLOCK_M, BLOCK_K]
                b = b_desc.load([on, kk * BLOCK_K])  # [BLOCK_N, BLOCK_K]: rows of the [N, K] weight
                acc = tl.dot(a, b.T, acc)
            bias = tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)
            if EPI == 1:
                ls = tl.load(LS + cols, mask=cmask, other=0.0).to(tl.float32)
                acc = x_desc.load([om, on]).to(tl.float32) + ls[None, :] * (acc + bias[None, :])
                tl.atomic_add(STATS_OUT + rows, tl.sum(acc, axis=1), mask=rmask, sem="relaxed")
                tl.atomic_add(STATS_OUT + M + rows, tl.sum(acc * acc, axis=1), mask=rmask, sem="relaxed")
            else:
                ssq = tl.load(STATS_IN + M + rows, mask=rmask, other=1.0)
                if RMS:
                    rstd = tl.rsqrt(ssq / K + eps)
                    acc = rstd[:, None] * acc + bias[None, :]
                else:
                    mean = tl.load(STATS_IN + rows, mask=rmask, other=0.0) / K
                    rstd = tl.rsqrt(tl.maximum(ssq / K - mean * mean, 0.0) + eps)
                    cs = tl.load(COLSUM + cols, mask=cmask, other=0.0)
                    acc = rstd[:, None] * (acc - mean[:, None] * cs[None, :]) + bias[None, :]
                if GELU:  # exact GELU, as the eager MLP
                    acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
            c_desc.store([om, on], acc.to(C.dtype.element_ty))


def _use_triton(x: Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


_CONFIG_CACHE: dict[tuple, tuple] = {}  # (M, N, K, EPI, dtype) -> the fastest config, timed on first use


def _launch(a, w, out, x, ls, bias, stats_in, colsum, stats_out, eps, epi, rms, gelu, cfg=None) -> None:
    M, K = a.shape
    N = w.shape[0]
    if a.is_cuda:  # device-side TMA descriptors need scratch memory
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=a.device))
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4

    def run(c):
        bm, bn, bk, gm, stages, warps = c
        programs = min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn))
        _epilogue_gemm_kernel[(programs,)](
            a, w, out, x, ls, bias, stats_in, colsum, stats_out, M, N, K, eps,
            EPI=epi, RMS=rms, GELU=gelu, NUM_SMS=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
            num_stages=stages, num_warps=warps,
        )  # fmt: skip

    if cfg is None and a.is_cuda:
        key = (M, N, K, epi, a.dtype)
        if key not in _CONFIG_CACHE:
            _CONFIG_CACHE[key] = _pick_config(run, stats_out if epi == 1 else None)
        cfg = _CONFIG_CACHE[key]
    run(cfg or CONFIGS[0])


def _pick_config(run, stats_out: Tensor | None) -> tuple:
    """The fastest of CONFIGS for one launch (CUDA events, median of 5 after a warm-up); the stats it sums are
    zeroed again afterwards."""
    best = (float("inf"), CONFIGS[0])
    for c in CONFIGS:
        try:
            run(c)
        except Exception:  # noqa: BLE001 - a config the GPU cannot fit (shared memory) is skipped
            continue
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(c)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        best = min(best, (sorted(times)[2], c), key=lambda t: t[0])
    if stats_out is not None:
        stats_out.zero_()
    return best[1]


# --------------------------------------------------------------------------- the ops


@torch.library.custom_op("batchvl::gemm_residual", mutates_args=())
def gemm_residual(a: Tensor, w: Tensor, bias: Tensor, ls: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """a [M, K], w [N, K], bias / ls [N], x [M, N] (contiguous) -> (x + ls * (a @ w^T + bias), row_stats [2, M])."""
    if not _use_triton(a):
        return gemm_residual_reference(a, w, bias, ls, x)
    a, x = a.contiguous(), x.contiguous()
    out = torch.empty_like(x)
    stats = torch.zeros(2, a.shape[0], device=a.device, dtype=torch.float32)
    _launch(a, w, out, x, ls, bias, stats, bias, stats, 0.0, 1, False, False)
    return out, stats


@gemm_residual.register_fake
def _(a, w, bias, ls, x):
    return torch.empty_like(x), x.new_empty(2, x.shape[0], dtype=torch.float32)


@torch.library.custom_op("batchvl::gemm_normed", mutates_args=())
def gemm_normed(
    x: Tensor, stats: Tensor, w_f: Tensor, colsum: Tensor, bias_f: Tensor, eps: float, rms: bool, gelu: bool
) -> Tensor:
    """x [M, K] with its row_stats [2, M] -> norm(x) @ w^T + bias [M, N] (then exact GELU if gelu), the norm folded
    into w_f, colsum and bias_f (`fold_norm`)."""
    if not _use_triton(x):
        return gemm_normed_reference(x, stats, w_f, colsum, bias_f, eps, rms, gelu)
    x = x.contiguous()
    out = x.new_empty(x.shape[0], w_f.shape[0])
    _launch(x, w_f, out, out, bias_f, bias_f, stats, colsum, stats, eps, 2, rms, gelu)
    return out


@gemm_normed.register_fake
def _(x, stats, w_f, colsum, bias_f, eps, rms, gelu):
    return x.new_empty(x.shape[0], w_f.shape[0])


def normed_linear(x: Tensor, stats: Tensor, f: FoldedLinear, gelu: bool = False) -> Tensor:
    """`gemm_normed` with a FoldedLinear."""
    return gemm_normed(x, stats, f.w_f, f.colsum, f.bias_f, f.eps, f.rms, gelu)
