"""Which fast-path options pay, measured on the GPU before any becomes a default (one part per device call).

    python bench/probe.py vit   # both encoders @ 64 tiles, 8 layers, compiled (cuDNN, GELU epilogue): ms per
                                # layer by kernel kind against the floor parts, and the top kernels
    python bench/probe.py attn  # LLM prefill attention: flash varlen vs per-sequence SDPA backends
    python bench/probe.py llm   # 38B LLM (64 layers), 16 x 2000 tokens: prefill and 3 decode steps, eager vs
                                # CUDA-graphed decode vs compiled layers

Random bf16 weights at real shapes (normal, std 0.02). Times are do_bench medians or CUDA-event stage times.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vit import bench_ms, random_encoder  # noqa: E402

from batchvl.encoder.internvit_compiled import compile_encoder, sdpa_context  # noqa: E402
from batchvl.model.config import from_preset  # noqa: E402

DEV, DT = torch.device("cuda"), torch.bfloat16


def row(*cells) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "GEMM"
    if any(k in n for k in ("fmha", "flash", "cudnn", "attn", "attention")):
        return "attention"
    if n.startswith("triton"):
        return "triton (fused elementwise / norms)"
    return "other"


def vit(tiles: int = 64, layers: int = 8) -> None:
    """Both encoders, `layers` layers, compiled with cuDNN attention and the GELU epilogue: ms per layer by kernel
    kind against the floor parts, and the top kernels (where the time above the floor goes)."""
    for preset in ("internvl2_5-38b", "internvl2_5-8b"):
        cfg = from_preset(preset)
        cfg = replace(cfg, vision=replace(cfg.vision, num_layers=layers))
        v = cfg.vision
        enc = random_encoder(cfg, DEV, DT)
        px = torch.randn(tiles, 3, v.image_size, v.image_size, device=DEV, dtype=DT)
        ce = compile_encoder(enc, buckets=[tiles], gelu_epilogue=True)
        ce(px)
        ms = bench_ms(lambda ce=ce, px=px: ce(px), DEV, warmup=3, rep=20)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            ce(px)
            torch.cuda.synchronize()
        evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        tot = lambda e: getattr(e, "device_time_total", None) or e.cuda_time_total  # noqa: E731
        by_kind: dict[str, float] = {}
        for e in evs:
            by_kind[kernel_kind(e.key)] = by_kind.get(kernel_kind(e.key), 0.0) + tot(e) / 1e3 / layers
        T, C, ff, M = v.num_patches + 1, v.hidden_size, v.intermediate_size, tiles * (v.num_patches + 1)
        floor = {}
        for nm, (m, k, n) in {
            "qkv": (M, C, 3 * C),
            "proj": (M, C, C),
            "fc1": (M, C, ff),
            "fc2": (M, ff, C),
        }.items():
            a, w = torch.randn(m, k, device=DEV, dtype=DT), torch.randn(n, k, device=DEV, dtype=DT)
            floor[nm] = bench_ms(lambda a=a, w=w: F.linear(a, w), DEV)
        q = torch.randn(tiles, v.num_heads, T, v.head_dim, device=DEV, dtype=DT)
        with sdpa_context("cudnn", DEV):
            floor["attn"] = bench_ms(lambda q=q: F.scaled_dot_product_attention(q, q, q), DEV)
        print(
            f"\n## {preset} vision: {tiles} tiles, {layers} layers; compiled (cudnn, gelu epilogue): "
            f"{ms:.1f} ms / forward = {ms / layers:.3f} ms / layer (incl. embed + head)\n"
        )
        row("kernel kind", "ms / layer (profiled)")
        row("---", "---")
        for k_, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            row(k_, f"{t:.3f}")
        row("floor: GEMMs", f"{sum(floor[g] for g in ('qkv', 'proj', 'fc1', 'fc2')):.3f}")
        row("floor: attention (cudnn)", f"{floor['attn']:.3f}")
        print()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=90))
        torch._dynamo.reset()  # Inductor options are not guarded: recompile from scratch with coordinate descent
        with torch._inductor.config.patch(coordinate_descent_tuning=True):
            ce = compile_encoder(enc, buckets=[tiles], gelu_epilogue=True)
            ce(px)
        ms_cd = bench_ms(lambda ce=ce, px=px: ce(px), DEV, warmup=3, rep=20)
        print(f"with coordinate_descent_tuning: {ms_cd:.1f} ms / forward (vs {ms:.1f})")
        torch._dynamo.reset()
        del enc, ce, px
        torch.cuda.empty_cache()


def llm(batch: int = 16, length: int = 2000, layers: int = 64) -> None:
    from batchvl.engine import Engine, EngineConfig, Request, Sampling
    from batchvl.model.loader import random_model

    cfg = from_preset("internvl2_5-38b")
    cfg = replace(cfg, vision=replace(cfg.vision, num_layers=1), llm=replace(cfg.llm, num_layers=layers))
    model, cfg = random_model(cfg, DEV, DT, seed=0)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(0, 150000, (length - 17 * i,), generator=g)) for i in range(batch)]
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    c = cfg.llm
    params = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
              + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size) * layers  # fmt: skip
    tokens = sum(int(r.input_ids.shape[0]) for r in reqs)
    print(f"## LLM 38B shapes, {layers} layers, {batch} x ~{length} tokens ({tokens} prefill tokens)\n")
    row("variant", "first prefill ms", "prefill ms", "linear TFLOP/s", "decode ms (3 steps)", "ms / step",
        "tokens == eager")  # fmt: skip
    row(*["---"] * 7)
    want = None
    for name, ecfg in (
        ("eager, no graphs", EngineConfig(cuda_graphs=False, compile_llm=False)),
        ("eager, CUDA-graphed decode", EngineConfig(compile_llm=False)),
        ("compiled layers, graphed decode", EngineConfig(compile_llm=True)),
    ):
        eng = Engine(model, cfg, ecfg, DEV, DT)
        r0 = eng.run_batch(reqs, s)
        runs = [eng.run_batch(reqs, s) for _ in range(2)]
        pre = min(r.prefill_ms for r in runs)
        dec = min(r.decode_ms for r in runs)
        want = want or r0.output_ids
        same = all(r.output_ids == want for r in runs)
        row(name, f"{r0.prefill_ms:.0f}", f"{pre:.0f}", f"{2 * tokens * params / pre / 1e9:.0f}", f"{dec:.1f}",
            f"{dec / 3:.2f}", same)  # fmt: skip
        print(f"  decode graphs captured: {eng.decode_step.captures}", flush=True)
    weights = params * 2 + 2 * c.hidden_size * c.vocab_size * 2
    print(f"\ndecode weight-read floor at 4.8 TB/s: {weights / 4.8e12 * 1e3:.1f} ms per step")


def attn() -> None:
    """LLM prefill attention alone at 38B (16 sequences) and 8B (32 sequences) shapes: flash varlen vs SDPA per
    sequence with each backend."""
    from profile_llm import prefill_attention

    for preset, batch in (("internvl2_5-38b", 16), ("internvl2_5-8b", 32)):
        print(f"\n## {preset}")
        prefill_attention(batch, from_preset(preset).llm, DEV, DT)


if __name__ == "__main__":
    torch.manual_seed(0)
    {"vit": vit, "llm": llm, "attn": attn}[sys.argv[1]]()
