"""FP8 (e4m3) linears for InternViT, opt-in (`engine.vit_fp8`): accuracy traded for speed.

Applied from outside the model, like tensor-parallel sharding: `fp8_vit(encoder)` swaps the four linears of every
ViT layer (qkv, proj, fc1, fc2) for `batchvl.ops.fp8.Fp8Linear`s in place. The patch embedding and the projector
stay bf16. In the compiled encoder the activations' quantization fuses into the norm / GELU kernel in front and the
bias add into the next elementwise kernel.

Its feature error against bf16 is reported by `bench/gpu_parity.py` and `bench/vit.py --fp8`.
"""

from __future__ import annotations

from batchvl.encoder.internvit import VisionEncoder
from batchvl.ops.fp8 import to_fp8

VIT_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def fp8_vit(enc: VisionEncoder) -> VisionEncoder:
    """Swap qkv, proj, fc1 and fc2 of every ViT layer for `Fp8Linear`s, in place; returns `enc`."""
    to_fp8(enc, [f"vit.layers.{i}.{n}" for i in range(len(enc.vit.layers)) for n in VIT_LINEARS])
    return enc


__all__ = ["fp8_vit"]
