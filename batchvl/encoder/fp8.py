"""FP8 (e4m3) linears for InternViT, opt-in (`engine.vit_fp8`): accuracy traded for speed.

- Weights are quantized once, one scale per output row; activations per token (row) at run time, so the
  quantization is a row-wise amax + scale + cast that Inductor fuses into the norm / GELU kernel in front.
- The product is one `torch._scaled_mm` with row-wise scales and a bf16 result; the bias is added after it (in
  the compiled encoder that add fuses into the next elementwise kernel).
- Applied from outside the model, like tensor-parallel sharding: `fp8_vit(encoder)` swaps the four linears of
  every ViT layer (qkv, proj, fc1, fc2) in place. The patch embedding and the projector stay bf16.

Its feature error against bf16 is reported by `bench/gpu_parity.py` and `bench/vit.py --fp8`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchvl.encoder.internvit import VisionEncoder

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with x ~ q * scale; each row's amax maps to FP8_MAX."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [M, 1]
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """`nn.Linear` with e4m3 weights (scale per output row) and e4m3 activations (scale per token)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.in_features % 16 or linear.out_features % 16:
            raise ValueError(
                f"FP8 linears need in and out features divisible by 16 (torch._scaled_mm); got "
                f"{linear.in_features} -> {linear.out_features}"
            )
        w, s = quantize_rows(linear.weight.detach())  # [N, K], [N, 1]
        self.register_buffer("weight_fp8", w)
        self.register_buffer("weight_scale", s.t().contiguous())  # [1, N]: scale_b of _scaled_mm
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        xq, xs = quantize_rows(x.reshape(-1, self.in_features))  # [M, K] e4m3, [M, 1]
        y = torch._scaled_mm(  # [M, N]; w.t() is the column-major operand _scaled_mm wants
            xq, self.weight_fp8.t(), scale_a=xs, scale_b=self.weight_scale, out_dtype=torch.bfloat16
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def fp8_vit(enc: VisionEncoder) -> VisionEncoder:
    """Swap qkv, proj, fc1 and fc2 of every ViT layer for `Fp8Linear`s, in place; returns `enc`."""
    for layer in enc.vit.layers:
        for parent, name in (
            (layer.attn, "qkv"),
            (layer.attn, "proj"),
            (layer.mlp, "fc1"),
            (layer.mlp, "fc2"),
        ):
            lin = getattr(parent, name)
            if isinstance(lin, nn.Linear):
                setattr(parent, name, Fp8Linear(lin))
    return enc


def dequantized_weight(lin: Fp8Linear) -> Tensor:
    """The weight an `Fp8Linear` multiplies by, as fp32 [N, K] (for references and tests)."""
    return lin.weight_fp8.float() * lin.weight_scale.t()


__all__ = ["FP8_MAX", "Fp8Linear", "dequantized_weight", "fp8_vit", "quantize_rows"]
