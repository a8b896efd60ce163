"""Which fast-path options pay, measured on the GPU before any becomes a default (one part per device call).

    python bench/probe.py vit   # InternViT-6B @ 64 tiles: floor parts, fc1+GELU epilogue, SDPA backends,
                                # compiled-encoder variants, and a kernel table of the best variant
    python bench/probe.py llm   # 38B LLM (64 layers), 16 x 2000 tokens: prefill and 3 decode steps, eager vs
                                # CUDA-graphed decode vs compiled layers

Random bf16 weights at real shapes (normal, std 0.02). Times are do_bench medians or CUDA-event stage times.
"""

from __future__ import annotations

import sys
import time
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


def vit_ops(v, tiles: int) -> None:
    """Per-layer pieces at the encoder's shapes (the tensors die when this returns)."""
    T, C, ff, H, D = v.num_patches + 1, v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim
    M = tiles * T
    print(f"## InternViT-6B, {tiles} tiles (M = {M} tokens), per layer\n")
    row("op", "ms", "TFLOP/s")
    row("---", "---", "---")
    x = torch.randn(M, C, device=DEV, dtype=DT)
    w1, b1 = torch.randn(ff, C, device=DEV, dtype=DT) * 0.02, torch.randn(ff, device=DEV, dtype=DT) * 0.02
    f1 = 2 * M * C * ff
    ops = {
        "fc1 GEMM, no bias (floor part)": lambda: F.linear(x, w1),
        "fc1 GEMM + bias": lambda: F.linear(x, w1, b1),
        "fc1 GEMM + bias, then GELU (2 kernels)": lambda: F.gelu(F.linear(x, w1, b1)),
        "fc1 + bias + GELU epilogue (_addmm_activation)": lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True),
    }  # fmt: skip
    for name, fn in ops.items():
        ms = bench_ms(fn, DEV)
        row(name, f"{ms:.3f}", f"{f1 / ms / 1e9:.0f}")
    y = torch.randn(M, ff, device=DEV, dtype=DT)
    row("GELU alone on [M, ff]", f"{bench_ms(lambda: F.gelu(y), DEV):.3f}", "")
    qkv = torch.randn(tiles, T, 3 * C, device=DEV, dtype=DT)
    q, k, val = (t.reshape(tiles, T, H, D).transpose(1, 2) for t in qkv.chunk(3, -1))  # our strided layout
    qc, kc, vc = (t.contiguous() for t in (q, k, val))
    fa = 4 * tiles * T * T * C
    for backend in ("flash", "cudnn", "efficient"):
        for layout, (a, b, c) in (("contiguous", (qc, kc, vc)), ("strided (ours)", (q, k, val))):
            try:
                with sdpa_context(backend, DEV):
                    ms = bench_ms(lambda a=a, b=b, c=c: F.scaled_dot_product_attention(a, b, c), DEV)
                row(f"SDPA {backend}, {layout}", f"{ms:.3f}", f"{fa / ms / 1e9:.0f}")
            except RuntimeError as e:
                row(f"SDPA {backend}, {layout}", "unavailable", str(e).splitlines()[0][:60])
    o = F.scaled_dot_product_attention(q, k, val)
    print(f"\nSDPA output strides {tuple(o.stride())} for shape {tuple(o.shape)}")


def vit(tiles: int = 64) -> None:
    cfg = from_preset("internvl2_5-38b")
    v = cfg.vision
    vit_ops(v, tiles)
    torch.cuda.empty_cache()

    print(f"\n## compiled encoder (default mode), {tiles} tiles, 45 layers\n")
    row("variant", "compile s", "ms / forward", "tiles/s", "rel err vs eager")
    row("---", "---", "---", "---", "---")
    enc = random_encoder(cfg, DEV, DT)
    px = torch.randn(tiles, 3, v.image_size, v.image_size, device=DEV, dtype=DT)
    with torch.no_grad():
        ref = enc(px).float()
    best = None
    for backend, epi in (("flash", False), ("cudnn", False), ("cudnn", True)):
        ce = compile_encoder(enc, buckets=[tiles], attn_backend=backend, gelu_epilogue=epi)
        t0 = time.perf_counter()
        out = ce(px)
        torch.cuda.synchronize()
        comp = time.perf_counter() - t0
        err = float((out.float() - ref).norm() / ref.norm())
        ms = bench_ms(lambda ce=ce: ce(px), DEV, warmup=3, rep=30)
        row(
            f"attn {backend}, gelu epilogue {epi}",
            f"{comp:.0f}",
            f"{ms:.1f}",
            f"{tiles / ms * 1e3:.2f}",
            f"{err:.2e}",
        )
        if best is None or ms < best[0]:
            best = (ms, ce, f"{backend}/{epi}")
    ms, ce, name = best
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        ce(px)
        torch.cuda.synchronize()
    print(f"\nkernels of one forward, variant {name}:\n")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70))


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


if __name__ == "__main__":
    torch.manual_seed(0)
    {"vit": vit, "llm": llm}[sys.argv[1]]()
