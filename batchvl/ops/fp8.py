"""FP8 (e4m3) linears, one home for the ViT's (`engine.vit_fp8`) and the LLM's (`model.quantization: fp8`).

- Weights: e4m3 with one fp32 scale per output row (each row's amax maps to 448). Activations: e4m3 with one scale
  per token (row), computed at run time, so the quantization is a row-wise amax + scale + cast that Inductor fuses
  into the kernel in front.
- The product is one `torch._scaled_mm` with row-wise scales and a bf16 result (on CUDA: compute capability >= 8.9,
  Ada / Hopper); the bias is added after it. `fp8_linear_reference` computes the same from dequantized operands in
  fp32, for tests and parity checks.
- Swapped in from outside the model (`to_fp8`), like tensor-parallel sharding; the loader swaps on the meta model
  and fills each weight as it is read (`Fp8Linear.quantize_from` / `load_quantized`), so no full-precision copy of
  the quantized linears is ever whole on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with x ~ q * scale; each row's amax maps to FP8_MAX."""
    # the bound from torch, not the module's FP8_MAX: Dynamo guards a float global through an alias of this module
    # that a graph loaded in another process lacks (`Precompiled` would compile anew at every start)
    top = torch.finfo(torch.float8_e4m3fn).max
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / top  # [M, 1]
    return (xf / scale).clamp(-top, top).to(torch.float8_e4m3fn), scale


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """e4m3 [M, K] with a scale per row ([M, 1] or [1, M]) -> fp32 [M, K]."""
    return q.float() * scale.reshape(-1, 1)


def fp8_unsupported(device: torch.device) -> str | None:
    """Why FP8 GEMMs (`torch._scaled_mm`, row-wise) cannot run on `device`, or None when they can."""
    if device.type != "cuda":
        return (
            f"FP8 GEMMs need an NVIDIA GPU of compute capability >= 8.9 (Ada / Hopper), not the {device.type}"
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"{name} has compute capability {cap[0]}.{cap[1]}; FP8 GEMMs need >= 8.9 (Ada / Hopper)"
    return None


def fp8_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ w^T (+ bias): w [N, K] e4m3, w_scale [1, N] fp32; x quantized per token; bf16 product."""
    lead = x.shape[:-1]
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))  # [M, K] e4m3, [M, 1]
    y = torch._scaled_mm(  # [M, N]; w.t() is the column-major operand _scaled_mm wants
        xq, w.t(), scale_a=xs, scale_b=w_scale, out_dtype=torch.bfloat16
    ).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w.shape[0])


def fp8_linear_reference(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """`fp8_linear` from dequantized operands: the same e4m3 values, multiplied in fp32, rounded to bf16."""
    lead = x.shape[:-1]
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = (dequantize(xq, xs) @ dequantize(w, w_scale).t()).to(torch.bfloat16).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w.shape[0])


class Fp8Linear(nn.Module):
    """`nn.Linear` with e4m3 weights (scale per output row) and e4m3 activations (scale per token).

    `weight` is a frozen e4m3 parameter (so checkpoint loading and random init find it by name, like a Linear's);
    `weight_scale` [1, N] fp32 is a buffer. Build one from a Linear (`from_linear`), or empty (on meta) and fill it
    with `quantize_from(full_precision_weight)` or `load_quantized(e4m3, scale)`."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None
    ) -> None:
        super().__init__()
        if in_features % 16 or out_features % 16:
            raise ValueError(
                f"FP8 linears need in and out features divisible by 16 (torch._scaled_mm); got "
                f"{in_features} -> {out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=FP8), False)
        self.register_buffer("weight_scale", torch.ones(1, out_features, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), False) if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantized from `linear` (on its device; on meta only the shapes); the bias is kept as it is."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, device=w.device)
        out.bias = linear.bias
        if w.device.type != "meta":
            out.quantize_from(w.detach())
        return out

    @torch.no_grad()
    def quantize_from(self, w: Tensor, rows: int = 4096) -> None:
        """Set the weight from a full-precision [N, K] (quantized on this module's device), `rows` rows at a time:
        quantizing takes two fp32 temporaries of its input, and a whole 72B gate_up's would be 3.6 GiB."""
        if w.shape != self.weight.shape:
            raise ValueError(
                f"weight {tuple(w.shape)} for an Fp8Linear {self.in_features} -> {self.out_features}"
            )
        scale = self.weight_scale.view(-1)
        for i in range(0, w.shape[0], rows):
            q, s = quantize_rows(w[i : i + rows].to(self.weight.device))
            self.weight[i : i + rows].copy_(q)
            scale[i : i + rows].copy_(s.view(-1))

    @torch.no_grad()
    def load_quantized(self, q: Tensor, scale: Tensor) -> None:
        """Set the weight from e4m3 [N, K] and its per-row fp32 scale ([N, 1] or [1, N])."""
        if q.shape != self.weight.shape or q.dtype != FP8 or scale.numel() != self.out_features:
            raise ValueError(
                f"FP8 weight {tuple(q.shape)} {q.dtype} with {scale.numel()} scales for an Fp8Linear "
                f"{self.in_features} -> {self.out_features}"
            )
        self.weight.copy_(q)
        self.weight_scale.copy_(scale.reshape(1, -1))

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def reference(self, x: Tensor) -> Tensor:
        return fp8_linear_reference(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def to_fp8(root: nn.Module, names: list[str]) -> None:
    """Swap the `nn.Linear` submodules `names` (dotted paths under `root`) for `Fp8Linear`s, in place."""
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = root.get_submodule(parent)
        lin = getattr(owner, attr)
        if not isinstance(lin, nn.Linear):
            continue
        if lin._forward_hooks or lin._forward_pre_hooks:  # e.g. tensor parallelism's all-reduce: lost
            raise ValueError(f"{name} has forward hooks; FP8 linears cannot take them over")
        setattr(owner, attr, Fp8Linear.from_linear(lin))


def dequantized_weight(lin: Fp8Linear) -> Tensor:
    """The weight an `Fp8Linear` multiplies by, as fp32 [N, K] (for references and tests)."""
    return dequantize(lin.weight, lin.weight_scale)


__all__ = [
    "FP8",
    "FP8_MAX",
    "Fp8Linear",
    "dequantize",
    "dequantized_weight",
    "fp8_linear",
    "fp8_linear_reference",
    "fp8_unsupported",
    "quantize_rows",
    "to_fp8",
]
