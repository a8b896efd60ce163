"""Which fast-path options pay, measured on the GPU before any becomes a default (one part per device call).

    python bench/probe.py vit   # both encoders @ 64 tiles, 8 layers, compiled (cuDNN, GELU epilogue): ms per
                                # layer by kernel kind against the floor parts, and the top kernels
    python bench/probe.py parts # the pieces above the ViT floor: attention layouts, patch embed conv vs GEMM,
                                # Inductor coordinate descent, launch gaps (8-layer forward, both encoders)
    python bench/probe.py attn  # LLM prefill attention: flash varlen vs per-sequence SDPA backends
    python bench/probe.py attn-job  # the same on the 8B seed job's real batch lengths: per-sequence cuDNN on its
                                # first visit of each window (plan building) and after, alone and inside the
                                # compiled 8-layer LLM prefill
    python bench/probe.py decode  # 8B LLM (32 layers), 33 x ~1990 tokens as in the seed job's batches: graphed
                                # decode ms/step, the kernels of one step, lm_head padded vs not
    python bench/probe.py ragged  # LLM prefill attention: one ragged cuDNN call per batch vs per sequence
    python bench/probe.py resid   # the residual add as the GEMM's C (layer scale folded) vs the compiled way
    python bench/probe.py swiglu  # the MLP's gate/up GEMM with SiLU * up in a Triton epilogue vs cuBLAS + a pass
    python bench/probe.py padded  # LLM prefill attention: one batched cuDNN call over right-padded sequences vs
                                  # per sequence; fp32 logits from the bf16 GEMM (mm out_dtype)
    python bench/probe.py cls     # ViT attention at T = 1025 vs 1024, and the CLS token out of the fused call
    python bench/probe.py vitattn # the Triton ViT attention (CLS-aware, qk-norm folded) vs Inductor + cuDNN
    python bench/probe.py llm-layer  # one compiled 8B decoder layer over the seed job's first batch: its kernels
    python bench/probe.py perseq  # per-sequence cuDNN prefill attention: a copy per sequence vs one cat (8B batch)
    python bench/probe.py tma     # a persistent TMA Triton GEMM vs cuBLAS, plain and with the residual epilogue
    python bench/probe.py inplace # the residual as cuBLAS's C written in place (x.addmm_) vs mm and addmm
    python bench/probe.py blas    # the ViT GEMMs: default BLAS path vs cuBLASLt preferred vs TunableOp
    python bench/probe.py passes  # the ViT's row passes by (rows per program, warps); the 300M's fc1 / qkv epilogues
    python bench/probe.py shiftab # the compiled 300M with the old vs new shift-mode norm launch, interleaved
    python bench/probe.py tunab   # TunableOp: its solutions on CUDA, the ViT GEMMs and compiled encoders off vs on
    python bench/probe.py inplaceab  # the compiled 6B with residual_norm vs residuals in place, interleaved
    python bench/probe.py qknormab   # the 6B's q/k RMSNorm: Inductor vs one Triton pass per part, alone and in
                                     # the compiled encoder, interleaved
    python bench/probe.py howtimed   # one compiled encoder timed under no_grad / inference_mode / do_bench, by kind
    python bench/probe.py vitgraph  # the compiled encoders called as is vs replayed as a CUDA graph per bucket
    python bench/probe.py vithost   # host enqueue time of a compiled encoder forward vs its GPU time (16 / 64 tiles)
    python bench/probe.py vit300  # `vit` for the 300M encoder only, without the coordinate-descent pass
    python bench/probe.py vit6b   # the same for the 6B encoder
    python bench/probe.py llm   # 38B LLM (64 layers), 16 x 2000 tokens: prefill and 3 decode steps, eager vs
                                # CUDA-graphed decode vs compiled layers

Random bf16 weights at real shapes (normal, std 0.02). Times are do_bench medians or CUDA-event stage times.
"""

from __future__ import annotations

import functools
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
    if any(
        k in n for k in ("fmha", "flash", "cudnn", "attn", "attention")
    ):  # before GEMM: cutlass fmha kernels
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "GEMM"
    if n.startswith("triton"):
        return "triton (fused elementwise / norms)"
    return "other"


def vit(tiles: int = 64, layers: int = 8, presets=("internvl2_5-38b", "internvl2_5-8b"), tuned=True) -> None:
    """Both encoders, `layers` layers, compiled with cuDNN attention and the GELU epilogue: ms per layer by kernel
    kind against the floor parts, and the top kernels (where the time above the floor goes)."""
    for preset in presets:
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
        if not tuned:
            continue
        torch._dynamo.reset()  # Inductor options are not guarded: recompile from scratch with coordinate descent
        with torch._inductor.config.patch(coordinate_descent_tuning=True):
            ce = compile_encoder(enc, buckets=[tiles], gelu_epilogue=True)
            ce(px)
        ms_cd = bench_ms(lambda ce=ce, px=px: ce(px), DEV, warmup=3, rep=20)
        print(f"with coordinate_descent_tuning: {ms_cd:.1f} ms / forward (vs {ms:.1f})")
        torch._dynamo.reset()
        del enc, ce, px
        torch.cuda.empty_cache()


def parts(tiles: int = 64, layers: int = 8) -> None:
    """The ViT pieces above the floor, each alone: SDPA by q/k/v layout, the patch embedding as cuDNN's conv vs
    one GEMM over unfolded patches, and the compiled 8-layer forward by do_bench vs back-to-back CUDA events
    (launch gaps), with and without Inductor's coordinate descent (compile time included)."""
    for preset in ("internvl2_5-38b", "internvl2_5-8b"):
        _vit_parts(preset, tiles, layers)
        torch.cuda.empty_cache()


def _vit_parts(preset: str, tiles: int, layers: int) -> None:
    import time

    from batchvl.encoder.internvit_compiled import CompiledEncoder

    cfg = from_preset(preset)
    v = cfg.vision
    B, T, C, H, D = tiles, v.num_patches + 1, v.hidden_size, v.num_heads, v.head_dim
    print(f"\n## {preset} vision, {tiles} tiles\n")
    row("SDPA q/k/v layout", "cudnn ms", "flash ms", "out strides (cudnn)")
    row(*["---"] * 4)
    qkv = torch.randn(B, T, 3 * C, device=DEV, dtype=DT)
    heads = lambda t: t.reshape(B, T, H, D).transpose(1, 2)  # noqa: E731  [B, H, T, D] view
    q0 = torch.randn(B, H, T, D, device=DEV, dtype=DT)
    k0, v0 = torch.randn_like(q0), torch.randn_like(q0)
    qc, kc = (torch.randn(B, T, C, device=DEV, dtype=DT) for _ in range(2))
    for name, (q, k, vv) in {
        "q=k=v, [B,H,T,D] contiguous (the floor)": (q0, q0, q0),
        "q, k, v [B,H,T,D] contiguous": (q0, k0, v0),
        "views of one [B,T,3C] (300M as is)": tuple(heads(t) for t in qkv.chunk(3, -1)),
        "q, k [B,T,C] contiguous, v view of [B,T,3C] (6B as is)": (
            heads(qc),
            heads(kc),
            heads(qkv[..., 2 * C :]),
        ),
    }.items():
        cells, strides = [], ""
        for backend in ("cudnn", "flash"):
            with sdpa_context(backend, DEV):
                f = lambda q=q, k=k, vv=vv: F.scaled_dot_product_attention(q, k, vv)  # noqa: E731
                cells.append(f"{bench_ms(f, DEV):.3f}")
                strides = strides or str(f().stride())
        row(name, *cells, strides)
    enc = random_encoder(replace(cfg, vision=replace(v, num_layers=layers)), DEV, DT)
    conv = enc.vit.embeddings.patch_embedding
    px = torch.randn(B, 3, v.image_size, v.image_size, device=DEV, dtype=DT)
    p, g = v.patch_size, v.image_size // v.patch_size

    def gemm(px, pad):
        x = px.reshape(B, 3, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(B * g * g, 3 * p * p)
        w = conv.weight.reshape(C, -1)
        if pad:
            x, w = F.pad(x, (0, pad)), F.pad(w, (0, pad))
        return F.linear(x, w, conv.bias)

    ref = conv(px).flatten(2).transpose(1, 2).reshape(B * g * g, C)
    print()
    row("patch embedding", "ms", "rel diff vs conv")
    row("---", "---", "---")
    row("cuDNN conv (eager)", f"{bench_ms(lambda: conv(px), DEV):.3f}", "0")
    for pad in (0, -3 * p * p % 8, -3 * p * p % 64):
        fn = torch.compile(lambda px, pad=pad: gemm(px, pad))
        err = float((fn(px).float() - ref.float()).norm() / ref.float().norm())
        row(f"compiled unfold + GEMM, K {3 * p * p} + {pad}", f"{bench_ms(lambda fn=fn: fn(px), DEV):.3f}",
            f"{err:.1e}")  # fmt: skip
    print()
    row(f"{layers}-layer compiled forward", "compile s", "do_bench ms", "10 back-to-back ms / call")
    row(*["---"] * 4)
    for name, opts in (("default", None), ("coordinate descent", {"coordinate_descent_tuning": True})):
        torch._dynamo.reset()
        with torch._inductor.config.patch(**(opts or {})):
            ce = CompiledEncoder(enc, buckets=[tiles])
            t0 = time.perf_counter()
            ce(px)
            torch.cuda.synchronize()
            comp = time.perf_counter() - t0
        ms = bench_ms(lambda ce=ce: ce(px), DEV, warmup=3, rep=20)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            ce(px)
        b.record()
        torch.cuda.synchronize()
        row(name, f"{comp:.1f}", f"{ms:.1f}", f"{a.elapsed_time(b) / 10:.1f}")
    torch._dynamo.reset()


def fp8() -> None:
    """Does torch._scaled_mm take row-wise scales (and a bias) on this GPU and torch, eager and compiled with the
    per-token quantization in front; and how fast are the 6B/300M ViT GEMMs in FP8 against bf16 (64 tiles)."""
    from batchvl.encoder.fp8 import Fp8Linear

    M = 64 * 1025
    row("GEMM (M = 64 tiles x 1025)", "bf16 ms", "fp8 linear ms (quantize + scaled_mm), compiled", "fp8 TFLOP/s",
        "scaled_mm alone ms", "rel err vs bf16")  # fmt: skip
    row(*["---"] * 6)
    for k, n in (
        (3200, 9600),
        (3200, 3200),
        (3200, 12800),
        (12800, 3200),
        (1024, 3072),
        (1024, 4096),
        (4096, 1024),
    ):
        lin = torch.nn.Linear(k, n, device=DEV, dtype=DT)
        torch.nn.init.normal_(lin.weight, std=0.02)
        x = torch.randn(M, k, device=DEV, dtype=DT)
        f8 = Fp8Linear(lin)
        comp = torch.compile(f8)
        ref = lin(x)
        err = float((comp(x).float() - ref.float()).norm() / ref.float().norm())
        xq, xs = torch.randn(M, k, device=DEV).to(torch.float8_e4m3fn), torch.rand(M, 1, device=DEV)
        mm = lambda xq=xq, xs=xs, f8=f8: torch._scaled_mm(  # noqa: E731
            xq, f8.weight_fp8.t(), scale_a=xs, scale_b=f8.weight_scale, out_dtype=DT
        )
        ms_mm = bench_ms(mm, DEV)
        ms = bench_ms(lambda comp=comp, x=x: comp(x), DEV)
        row(f"{k} -> {n}", f"{bench_ms(lambda lin=lin, x=x: lin(x), DEV):.3f}", f"{ms:.3f}",
            f"{2 * M * k * n / ms / 1e9:.0f}", f"{ms_mm:.3f}", f"{err:.2e}")  # fmt: skip


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


def attn_job(preset: str = "internvl2_5-8b", layers: int = 8) -> None:
    """Why per-sequence cuDNN (1.6x flash varlen alone) did not speed up the seed job: one layer's attention over
    each of the job's batches (wall time with a sync: plan building is host work), first visit vs again, then
    the compiled 8-layer prefill of the same batches with each backend."""
    import itertools
    import time

    from e2e import batches, prepare

    from batchvl.engine import Engine, EngineConfig, Request, Sampling
    from batchvl.llm.attention import AttnMeta, causal_attn_per_seq, prefill_varlen
    from batchvl.model.loader import random_model

    prepared = prepare(500, 8192)
    lens = [[len(prepared[i].input_ids) for i in idx] for idx in batches(prepared, 65536)]
    cfg = from_preset(preset)
    c = cfg.llm

    def wall(fn, *args) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    tot = {"varlen first call": 0.0, "varlen again": 0.0, "cudnn first visit": 0.0, "cudnn again": 0.0}
    for ls in lens:
        cu = torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32)
        T = int(cu[-1])
        qkv = torch.randn(T, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, device=DEV, dtype=DT)
        kv_sz = c.num_kv_heads * c.head_dim
        q, k, v = qkv.split([c.num_heads * c.head_dim, kv_sz, kv_sz], -1)
        q = q.reshape(T, c.num_heads, c.head_dim).contiguous()  # as after RoPE: fresh tensors
        k = k.reshape(T, c.num_kv_heads, c.head_dim).contiguous()
        v = v.view(T, c.num_kv_heads, c.head_dim)  # a view of the qkv output, as in the layer
        meta = AttnMeta(
            cu.to(DEV), max(ls), torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long)
        )
        tot["varlen first call"] += wall(prefill_varlen, q, k, v, meta)
        tot["varlen again"] += wall(prefill_varlen, q, k, v, meta)
        tot["cudnn first visit"] += wall(causal_attn_per_seq, q, k, v, cu, "cudnn")
        tot["cudnn again"] += wall(causal_attn_per_seq, q, k, v, cu, "cudnn")
    row("one layer's attention over the job's batches", "wall ms (sync per call)")
    row("---", "---")
    for name, ms in tot.items():
        row(name, f"{ms:.1f}")
    cfg = replace(cfg, vision=replace(cfg.vision, num_layers=1), llm=replace(cfg.llm, num_layers=layers))
    model, cfg = random_model(cfg, DEV, DT, seed=0)
    g = torch.Generator().manual_seed(0)
    top = min(150000, cfg.image_token_id)
    s = Sampling(max_new_tokens=1, ignore_eos=True)
    row(
        f"compiled {layers}-layer prefill of the job's {len(lens)} batches", "first pass ms", "second pass ms"
    )
    row("---", "---", "---")
    for backend in ("varlen", "cudnn"):
        eng = Engine(model, cfg, EngineConfig(compile_llm=True, attn_backend=backend), DEV, DT)
        passes = []
        for _ in range(2):
            ms = 0.0
            for ls in lens:
                reqs = [Request(torch.randint(0, top, (n,), generator=g)) for n in ls]
                ms += eng.run_batch(reqs, s).prefill_ms
            passes.append(ms)
        row(backend, f"{passes[0]:.0f}", f"{passes[1]:.0f}")


def decode(preset: str = "internvl2_5-8b", rows: int = 33, length: int = 1990) -> None:
    """The seed job's decode at 8B shapes: prefill + 3 graphed decode steps of one batch, the kernels of one
    (eager, compiled-layer) decode step, and lm_head alone with the vocabulary padded or not."""
    from triton.testing import do_bench

    from batchvl.engine import Engine, EngineConfig, Request, Sampling
    from batchvl.model.loader import random_model

    cfg = from_preset(preset)
    cfg = replace(cfg, vision=replace(cfg.vision, num_layers=1))
    model, cfg = random_model(cfg, DEV, DT, seed=0)
    g = torch.Generator().manual_seed(0)
    top = min(150000, cfg.image_token_id)
    reqs = [Request(torch.randint(0, top, (length - 3 * i,), generator=g)) for i in range(rows)]
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    eng = Engine(model, cfg, EngineConfig(), DEV, DT)
    runs = [eng.run_batch(reqs, s) for _ in range(3)]
    dec = min(r.decode_ms for r in runs[1:])
    c = cfg.llm
    params = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
              + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size) * c.num_layers  # fmt: skip
    kv = 2 * eng.arena.k.numel() * eng.arena.k.element_size()  # the arena as allocated (padded rows/lengths)
    print(f"## {preset} LLM, {rows} x ~{length} tokens: prefill {min(r.prefill_ms for r in runs[1:]):.0f} ms, "
          f"decode {dec:.1f} ms for 3 steps = {dec / 3:.2f} ms / step (graphed; captures {eng.decode_step.captures}); "
          f"weights {params * 2 / 1e9:.1f} GB + lm_head {c.hidden_size * c.vocab_size * 2 / 1e9:.2f} GB; "
          f"KV arena {kv / 1e9:.1f} GB; "
          f"weight-read floor at 4 TB/s {(params + c.hidden_size * c.vocab_size) * 2 / 4e12 * 1e3:.2f} ms / step\n")  # fmt: skip
    eng = Engine(model, cfg, EngineConfig(cuda_graphs=False), DEV, DT)
    eng.run_batch(reqs, s)
    p_ = eng.prefill(reqs, s)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.decode(p_)
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot = lambda e: (getattr(e, "device_time_total", None) or e.cuda_time_total) / 1e3 / 3  # noqa: E731
    print(f"kernels of one decode step (eager, compiled layers): {sum(tot(e) for e in evs):.2f} ms / step\n")
    row("kernel", "kind", "calls / step", "ms / step")
    row("---", "---", "---", "---")
    for e in sorted(evs, key=lambda e: -tot(e))[:16]:
        row(e.key[:90], kernel_kind(e.key), e.count // 3, f"{tot(e):.3f}")
    h = torch.randn(rows, c.hidden_size, device=DEV, dtype=DT)
    w = torch.randn(c.vocab_size, c.hidden_size, device=DEV, dtype=DT) * 0.02
    vp = -(-c.vocab_size // 128) * 128
    wp = torch.zeros(vp, c.hidden_size, device=DEV, dtype=DT)
    wp[: c.vocab_size] = w
    print()
    row(f"lm_head, {rows} rows", "ms (do_bench)")
    row("---", "---")
    row(f"vocabulary {c.vocab_size}", f"{do_bench(lambda: F.linear(h, w).float()):.3f}")
    row(f"padded to {vp}, sliced", f"{do_bench(lambda: F.linear(h, wp)[:, : c.vocab_size].float()):.3f}")


def decattn() -> None:
    """Decode attention alone at the seed jobs' decode shapes (a graph's cache: 40 rows x 2048 slots, 33 rows of
    ~1990 valid keys, 7 padding rows of 1): the masked-SDPA reference vs the split-key Triton kernel, per layer."""
    row("model", "variant", "us / layer", "GB/s (valid keys)", "rel err vs fp32")
    row(*["---"] * 5)
    for preset in ("internvl2_5-8b", "internvl2_5-38b"):
        _decattn_preset(preset)


def _decattn_preset(preset: str) -> None:
    from triton.testing import do_bench

    from batchvl.llm.decode_attention import _decode_attention_triton, decode_attention_reference, num_chunks

    c = from_preset(preset).llm
    rows, S = 40, 2048
    kc, vc = (torch.randn(rows, c.num_kv_heads, S, c.head_dim, device=DEV, dtype=DT) for _ in range(2))
    q = torch.randn(rows, c.num_heads, c.head_dim, device=DEV, dtype=DT)
    lens = torch.tensor([1990 - 3 * i for i in range(33)] + [1] * 7, device=DEV)
    ref = decode_attention_reference(q.float(), kc.float(), vc.float(), lens)
    valid = int(lens.sum()) * c.num_kv_heads * c.head_dim * 2 * 2  # k and v bytes actually needed
    cands = [("reference (masked SDPA)", lambda: decode_attention_reference(q, kc, vc, lens))]
    base = num_chunks(rows, c.num_kv_heads, S)
    for ns in sorted({base, 2 * base, max(1, base // 2), 16}):
        for bn in (64, 128):
            name = f"triton, {ns} chunks, BLOCK_N {bn}" + (" (default)" if (ns, bn) == (base, 64) else "")
            cands.append((name, lambda ns=ns, bn=bn: _decode_attention_triton(q, kc, vc, lens, bn, ns)))
    for name, fn in cands:
        try:
            err = float((fn().float() - ref).norm() / ref.norm())
            us = do_bench(fn, return_mode="median") * 1e3
            row(preset, name, f"{us:.1f}", f"{valid / us / 1e3:.0f}", f"{err:.2e}")
        except Exception as ex:  # noqa: BLE001
            row(preset, name, f"{type(ex).__name__}: {str(ex)[:200]}", "-", "-")


def resid(tiles: int = 64) -> None:
    """Can the residual add ride in the GEMM? Per ViT "row-parallel linear + layer scale + residual + next norm" at
    64 tiles: (A) the compiled encoder's way, F.linear then one Inductor kernel (reads GEMM out + residual, writes
    residual + normed); (B) layer scale folded into the weight, the residual as cuBLAS's C (addmm, beta 1) inside an
    opaque op so Inductor keeps it, then a kernel that adds the bias and normalizes (reads 1, writes 2)."""
    from triton.testing import do_bench

    from batchvl.encoder.internvit import make_norm

    @torch.library.custom_op("probe::resid_mm", mutates_args=())
    def resid_mm(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.addmm(x, a, w.t())

    @resid_mm.register_fake
    def _(x, a, w):
        return torch.empty_like(x)

    row("encoder", "linear", "A: linear + kernel ms", "B: addmm + kernel ms", "B / A", "mm alone", "addmm alone",
        "rel diff B vs A")  # fmt: skip
    row(*["---"] * 8)
    for preset in ("internvl2_5-8b", "internvl2_5-38b"):
        v = from_preset(preset).vision
        C, ff, M = v.hidden_size, v.intermediate_size, tiles * (v.num_patches + 1)
        norm = make_norm(v).to(DEV, DT)
        with torch.no_grad():
            for p_ in norm.parameters():
                p_.copy_(1 + 0.1 * torch.randn_like(p_))
        ls = 0.1 * torch.randn(C, device=DEV, dtype=DT)

        def plain(x, a, w, b, ls, norm):
            x = x + ls * F.linear(a, w, b)
            return x, norm(x)

        def folded(x, a, w2, b2, norm):
            x = resid_mm(x, a, w2) + b2
            return x, norm(x)

        fa, fb = torch.compile(plain, dynamic=False), torch.compile(folded, dynamic=False)
        for name, k in (("proj", C), ("fc2", ff)):
            x = torch.randn(M, C, device=DEV, dtype=DT)
            a = torch.randn(M, k, device=DEV, dtype=DT)
            w = 0.02 * torch.randn(C, k, device=DEV, dtype=DT)
            b = 0.02 * torch.randn(C, device=DEV, dtype=DT)
            w2, b2 = ls[:, None] * w, ls * b
            args_a, args_b = (x, a, w, b, ls, norm), (x, a, w2, b2, norm)
            with torch.inference_mode():
                ra, rb = fa(*args_a), fb(*args_b)
                ta = do_bench(functools.partial(fa, *args_a))
                tb = do_bench(functools.partial(fb, *args_b))
                tm = do_bench(functools.partial(F.linear, a, w))
                tam = do_bench(functools.partial(torch.addmm, x, a, w.t()))
            err = ((rb[1].float() - ra[1].float()).norm() / ra[1].float().norm()).item()
            row(preset.split("_")[-1], name, f"{ta:.3f}", f"{tb:.3f}", f"{tb / ta:.3f}", f"{tm:.3f}", f"{tam:.3f}",
                f"{err:.1e}")  # fmt: skip
        torch._dynamo.reset()


def ragged(preset: str = "internvl2_5-8b") -> None:
    """One cuDNN call over the whole packed batch (ragged THD layout: `aten._cudnn_attention_forward` with
    cumulative lengths, the op nested-tensor SDPA uses) against one cuDNN SDPA call per sequence and flash varlen:
    one layer's attention over the seed job's real batches, plans built (each shape run once before timing)."""
    import itertools

    from e2e import batches, prepare
    from triton.testing import do_bench

    from batchvl.llm.attention import AttnMeta, causal_attn_per_seq, prefill_varlen

    c = from_preset(preset).llm
    prepared = prepare(500, 8192)
    lens = [[len(prepared[i].input_ids) for i in idx] for idx in batches(prepared, 65536)]
    op = torch.ops.aten._cudnn_attention_forward
    print(f"## {preset}: {len(lens)} batches, {c.num_heads} heads / {c.num_kv_heads} kv heads\n")
    print(f"schema: {op.default._schema}\n")

    def rag(q, k, v, cu, mx, gqa_expand):
        if gqa_expand and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return op(q, k, v, None, cu, cu, mx, mx, False, 0.0, True, False, scale=c.head_dim**-0.5)[0]

    tot = {"per-seq cudnn": 0.0, "flash varlen": 0.0, "ragged cudnn (GQA native)": 0.0,
           "ragged cudnn (k/v expanded)": 0.0, "ragged cudnn, max rounded to 128": 0.0}  # fmt: skip
    errs: dict[str, float] = {}
    for ls in lens:
        cu = torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32)
        T = int(cu[-1])
        q = torch.randn(T, c.num_heads, c.head_dim, device=DEV, dtype=DT)
        k, v = (torch.randn(T, c.num_kv_heads, c.head_dim, device=DEV, dtype=DT) for _ in range(2))
        cud, mx = cu.to(DEV), max(ls)
        meta = AttnMeta(cud, mx, torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long))
        ref = causal_attn_per_seq(q, k, v, cu, "cudnn")
        P = functools.partial
        r128 = -(-mx // 128) * 128
        cases = {
            "per-seq cudnn": P(causal_attn_per_seq, q, k, v, cu, "cudnn"),
            "flash varlen": P(prefill_varlen, q, k, v, meta),
            "ragged cudnn (GQA native)": P(rag, q, k, v, cud, mx, False),
            "ragged cudnn (k/v expanded)": P(rag, q, k, v, cud, mx, True),
            "ragged cudnn, max rounded to 128": P(rag, q, k, v, cud, r128, True),
        }
        for name, fn in cases.items():
            if errs.get(name) == float("inf"):
                continue
            try:
                out = fn()
                e = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                errs[name] = max(errs.get(name, 0.0), e)
                tot[name] += do_bench(fn, warmup=5, rep=20)
            except Exception as ex:  # noqa: BLE001 - a probe: report and go on
                print(f"{name}: {type(ex).__name__}: {str(ex)[:300]}")
                errs[name] = float("inf")
    row("one layer's attention, the job's batches", "ms (sum of do_bench medians)", "max rel err vs per-seq")
    row("---", "---", "---")
    for name, ms in tot.items():
        row(name, f"{ms:.1f}" if errs.get(name) != float("inf") else "failed", f"{errs.get(name, 0):.1e}")


# --- the MLP's gate/up GEMM with SiLU * up in a Triton epilogue (`swiglu`): measured slower than cuBLAS + a pass
# (bench/RESULTS.md, session 7), so it lives here, not in batchvl/. One program computes a tile of gate and the
# same tile of up from one A tile and writes only silu(g) * u, rounded once.


def swiglu_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, H], w [2I, H] ([gate; up]) -> silu(gate) * up [M, I], as the eager MLP computes it."""
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# (BLOCK_M, BLOCK_N per half, BLOCK_K, GROUP_M, num_stages, num_warps): what `probe.py swiglu` times on the GPU
CONFIGS = [
    (128, 128, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 64, 64, 8, 4, 4),
    (128, 64, 64, 8, 5, 8),
    (256, 64, 64, 8, 3, 8),
    (64, 128, 64, 8, 4, 4),
    (128, 128, 32, 8, 4, 8),
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
    def _swiglu_mm_kernel(
        X, W, OUT, M, N, K, stride_xm, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrapped: loads need no mask, stores do
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        rk = tl.arange(0, BLOCK_K)
        xp = X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
        gp = (
            W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
        )  # [BLOCK_K, BLOCK_N]: gate rows, transposed
        up = gp + N * stride_wn  # the same rows of up
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the caller)
            a = tl.load(xp)
            acc_g = tl.dot(a, tl.load(gp), acc_g)
            acc_u = tl.dot(a, tl.load(up), acc_u)
            xp += BLOCK_K
            gp += BLOCK_K
            up += BLOCK_K
        out = acc_g * tl.sigmoid(acc_g) * acc_u  # fp32, rounded once below
        om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        op = OUT + om[:, None].to(tl.int64) * stride_om + on[None, :]
        tl.store(op, out.to(OUT.dtype.element_ty), mask=(om[:, None] < M) & (on[None, :] < N))


def swiglu_triton(x: torch.Tensor, w: torch.Tensor, cfg) -> torch.Tensor:
    """The kernel itself (no fallback): x [M, H], w [2I, H] -> [M, I]."""
    bm, bn, bk, gm, stages, warps = cfg
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0] // 2
    assert K % bk == 0, (K, bk)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _swiglu_mm_kernel[grid](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out


def swiglu() -> None:
    """The MLP's gate/up GEMM with SiLU * up in its epilogue (Triton, `swiglu_triton` above) against cuBLAS + the
    elementwise pass (eager, and compiled as the compiled decoder layer runs it), at 8B and 38B widths, 64k and 32k
    rows: every kernel config, rel. error vs fp32."""
    from triton.testing import do_bench

    compiled = torch.compile(swiglu_reference)
    row("preset", "rows", "variant", "ms", "TFLOP/s", "rel err vs fp32")
    row(*["---"] * 6)
    for preset in ("internvl2_5-8b", "internvl2_5-38b"):
        c = from_preset(preset).llm
        for m in (65536, 32768):
            x = torch.randn(m, c.hidden_size, device=DEV, dtype=DT)
            w = torch.randn(2 * c.intermediate_size, c.hidden_size, device=DEV, dtype=DT) * 0.02
            flop = 2 * m * c.hidden_size * 2 * c.intermediate_size
            r = swiglu_reference(x[:4096].float(), w.float())  # fp32 reference on the first 4096 rows
            P = functools.partial
            cases = {"cuBLAS GEMM alone": P(F.linear, x, w), "cuBLAS + eager SiLU*up": P(swiglu_reference, x, w),
                     "cuBLAS + compiled SiLU*up": P(compiled, x, w)}  # fmt: skip
            for cfg in CONFIGS:
                cases[f"triton {cfg}"] = P(swiglu_triton, x, w, cfg)
            for name, fn in cases.items():
                try:
                    o = fn()
                    ms = do_bench(fn, warmup=10, rep=50)
                    e = "-"
                    if o.shape[-1] == c.intermediate_size:
                        e = f"{float((o[:4096].float() - r).norm() / r.norm()):.1e}"
                    row(preset, m, name, f"{ms:.3f}", f"{flop / ms / 1e9:.0f}", e)
                except Exception as ex:  # noqa: BLE001 - a probe: report and go on
                    row(preset, m, name, f"failed: {type(ex).__name__}: {str(ex)[:200]}", "", "")
            del x, w, r
            torch.cuda.empty_cache()


def padded() -> None:
    """LLM prefill attention over the 8B seed job's batches: one cuDNN SDPA call per sequence (the default on
    Hopper) against one batched causal call over the sequences right-padded to one window (exact: causal queries
    never see the padding after them), scatter and gather included; and flash varlen. Then fp32 logits straight
    from the bf16 GEMM (`torch.mm(..., out_dtype=float32)`) vs the bf16 product cast, eager and in a CUDA graph."""
    import itertools

    from e2e import batches, prepare
    from triton.testing import do_bench

    from batchvl.llm.attention import AttnMeta, causal_attn_per_seq, per_seq_window, prefill_varlen

    c = from_preset("internvl2_5-8b").llm
    prepared = prepare(500, 8192)
    lens = [[len(prepared[i].input_ids) for i in idx] for idx in batches(prepared, 65536)]

    def batched(q, k, v, idx, b, L):
        h, hk, d = q.shape[1], k.shape[1], q.shape[2]
        qp = q.new_zeros(b * L, h, d).index_copy_(0, idx, q).view(b, L, h, d)
        kp = k.new_zeros(b * L, hk, d).index_copy_(0, idx, k).view(b, L, hk, d)
        vp = v.new_zeros(b * L, hk, d).index_copy_(0, idx, v).view(b, L, hk, d)
        with sdpa_context("cudnn", q.device):
            o = F.scaled_dot_product_attention(
                qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), is_causal=True, enable_gqa=True
            )  # [B, H, L, D]
        return o.transpose(1, 2).reshape(b * L, h, d).index_select(0, idx)

    tot = {"per-seq cudnn": 0.0, "batched padded cudnn (scatter + gather incl.)": 0.0, "flash varlen": 0.0}
    err = 0.0
    for ls in lens:
        cu = torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32)
        T, b, L = int(cu[-1]), len(ls), per_seq_window(max(ls))
        q = torch.randn(T, c.num_heads, c.head_dim, device=DEV, dtype=DT)
        k, v = (torch.randn(T, c.num_kv_heads, c.head_dim, device=DEV, dtype=DT) for _ in range(2))
        idx = torch.cat([torch.arange(n) + i * L for i, n in enumerate(ls)]).to(DEV)
        meta = AttnMeta(
            cu.to(DEV), max(ls), torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long)
        )
        ref = causal_attn_per_seq(q, k, v, cu, "cudnn")
        out = batched(q, k, v, idx, b, L)
        err = max(err, float((out.float() - ref.float()).norm() / ref.float().norm()))
        P = functools.partial
        fns = (P(causal_attn_per_seq, q, k, v, cu, "cudnn"), P(batched, q, k, v, idx, b, L),
               P(prefill_varlen, q, k, v, meta))  # fmt: skip
        for name, fn in zip(tot, fns, strict=True):
            tot[name] += do_bench(fn, warmup=5, rep=20)
    row(f"one layer's attention, the job's {len(lens)} batches", "ms (sum of do_bench medians)")
    row("---", "---")
    for name, ms in tot.items():
        row(name, f"{ms:.1f}")
    print(f"batched vs per-seq max rel err: {err:.1e}")

    for rows_ in (33, 65536 // 2000):
        h = torch.randn(rows_, c.hidden_size, device=DEV, dtype=DT)
        w = torch.randn(-(-c.vocab_size // 128) * 128, c.hidden_size, device=DEV, dtype=DT) * 0.02 * 30
        ref = h.float() @ w.float().t()
        try:
            f32 = functools.partial(torch.mm, h, w.t(), out_dtype=torch.float32)
            a = f32()
            g = torch.cuda.CUDAGraph()
            out = torch.empty_like(a)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                torch.mm(h, w.t(), out_dtype=torch.float32)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                out.copy_(torch.mm(h, w.t(), out_dtype=torch.float32))
            g.replay()
            torch.cuda.synchronize()
            print(
                f"rows {rows_}: mm out_dtype=float32 works; max abs err vs fp32 {float((a - ref).abs().max()):.3g} "
                f"(bf16 product cast: {float((F.linear(h, w).float() - ref).abs().max()):.3g}); graph replay "
                f"equal: {bool(torch.equal(out, a))}; ms {do_bench(f32):.3f}"
                f" vs {do_bench(functools.partial(F.linear, h, w)):.3f} (bf16 out)"
            )
        except Exception as ex:  # noqa: BLE001
            print(f"mm out_dtype: {type(ex).__name__}: {str(ex)[:300]}")


def attn_lse(q, k, v, scale: float, backend: str):
    """SDPA [B, H, T, D] with its log-sum-exp [B, H, T] (natural log of the scaled scores' exp-sum)."""
    if not q.is_cuda:  # CPU (the test): the same merge over the CPU flash kernel's log-sum-exp
        cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o, lse = cpu_flash(q, k, v, 0.0, False, scale=scale)[:2]
    elif backend == "cudnn":
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                                    scale=scale)[:2]  # fmt: skip
    else:
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        o, lse = flash(q, k, v, 0.0, False, False, scale=scale)[:2]
    return o, lse.reshape(q.shape[:3])


def mix_plain(q, k, v, scale: float):
    """q, k, v [B, T, H, D] -> [B, T, H*D]: SDPA over all T = 1 + N tokens (what the encoder does now)."""
    B, T, H, D = q.shape
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return o.transpose(1, 2).reshape(B, T, H * D)


def mix_cls_split(q, k, v, scale: float, backend: str):
    """The same as mix_plain with the N = 1024 patch tokens through the fused kernel alone (no 1-token tail
    tile): the CLS key enters their softmax by the log-sum-exp merge, and the CLS query runs as a small product."""
    B, T, H, D = q.shape
    qp, kp, vp = (t[:, 1:].transpose(1, 2) for t in (q, k, v))  # [B, H, N, D]
    o, lse = attn_lse(qp, kp, vp, scale, backend)  # [B, H, N, D], [B, H, N]
    k0, v0 = k[:, :1].transpose(1, 2).float(), v[:, :1].transpose(1, 2).float()  # [B, H, 1, D]
    s0 = (qp.float() * k0).sum(-1) * scale  # [B, H, N]: the CLS key's score for each patch query
    a = torch.sigmoid(lse - s0)[..., None]  # share of the patches' softmax mass
    op = o.float() * a + v0 * (1 - a)  # [B, H, N, D]
    qc = q[:, :1].transpose(1, 2).float()  # [B, H, 1, D]
    pc = torch.softmax((qc @ k.transpose(1, 2).float().transpose(-1, -2)) * scale, -1)  # [B, H, 1, T]
    oc = pc @ v.transpose(1, 2).float()  # [B, H, 1, D]
    out = torch.cat([oc, op], dim=2).to(q.dtype)  # [B, H, T, D]
    return out.transpose(1, 2).reshape(B, T, H * D)


def cls(tiles: int = 64) -> None:
    """ViT attention at T = 1 + 1024: how much the one-token tail costs the fused kernels (T = 1025 vs 1024), and
    whether taking the CLS token out of the fused call (log-sum-exp merge, `mix_cls_split`) pays end to end."""
    from triton.testing import do_bench

    for preset in ("internvl2_5-38b", "internvl2_5-8b"):
        v_ = from_preset(preset).vision
        B, H, D = tiles, v_.num_heads, v_.head_dim
        scale = D**-0.5
        print(f"\n## {preset} vision attention, {tiles} tiles, {H} heads x {D}\n")
        row("SDPA alone (q, k, v views of [B, T, 3, H, D])", "cudnn ms", "flash ms", "cudnn TFLOP/s")
        row(*["---"] * 4)
        for tq, tk in ((1025, 1025), (1024, 1024), (1024, 1025), (1025, 1024)):
            qkv = torch.randn(B, max(tq, tk), 3, H, D, device=DEV, dtype=DT)
            q, k, v = (qkv[:, :t, i].transpose(1, 2) for i, t in ((0, tq), (1, tk), (2, tk)))
            ms = {}
            for be in ("cudnn", "flash"):
                with sdpa_context(be, DEV):
                    ms[be] = do_bench(lambda q=q, k=k, v=v, s=scale: F.scaled_dot_product_attention(q, k, v, scale=s),
                                      return_mode="median")  # fmt: skip
            row(f"Tq {tq}, Tk {tk}", f"{ms['cudnn']:.3f}", f"{ms['flash']:.3f}",
                f"{4 * B * H * tq * tk * D / ms['cudnn'] / 1e9:.0f}")  # fmt: skip
        T = 1025
        qkv = torch.randn(B, T, 3, H, D, device=DEV, dtype=DT)
        q, k, v = qkv.unbind(2)  # [B, T, H, D] views
        ref = mix_plain(q.float(), k.float(), v.float(), scale)  # fp32 math
        print()
        row("attention mix [B, T, 3, H, D] -> [B, T, C], compiled", "ms", "rel err vs fp32")
        row(*["---"] * 3)
        for name, fn in (
            ("plain, cudnn", functools.partial(mix_plain, scale=scale)),
            ("CLS split, cudnn", functools.partial(mix_cls_split, scale=scale, backend="cudnn")),
            ("CLS split, flash", functools.partial(mix_cls_split, scale=scale, backend="flash")),
        ):
            try:
                cf = torch.compile(fn, fullgraph=True)
                with sdpa_context("cudnn", DEV), torch.inference_mode():
                    out = cf(q, k, v)
                    err = float((out.float() - ref).norm() / ref.norm())
                    ms = do_bench(lambda cf=cf, q=q, k=k, v=v: cf(q, k, v), return_mode="median")
                row(name, f"{ms:.3f}", f"{err:.2e}")
            except Exception as ex:  # noqa: BLE001
                row(name, f"{type(ex).__name__}: {str(ex)[:200]}", "-")
        torch._dynamo.reset()


def llm_layer(preset: str = "internvl2_5-8b") -> None:
    """One compiled decoder layer over the seed job's first 64k-token batch, as the engine runs prefill (per-sequence
    cuDNN attention, KV cache written): ms per call and its kernels (where the time beside the GEMMs goes)."""
    from e2e import batches, prepare

    from batchvl.engine import packed_meta
    from batchvl.llm.attention import warm_per_seq
    from batchvl.llm.decoder import DecoderLayer, Rotary
    from batchvl.llm.kv_cache import KVCache

    c = from_preset(preset).llm
    prepared = prepare(500, 8192)
    lens = [len(prepared[i].input_ids) for i in batches(prepared, 65536)[0]]
    torch.manual_seed(0)
    with torch.device(DEV):
        layer = DecoderLayer(c).to(DT).eval().requires_grad_(False)
        rot = Rotary(c)
    rot.reset(DEV)
    for p in layer.parameters():
        p.data.normal_(0.0, 0.02) if p.ndim > 1 else p.data.normal_(1.0, 0.02)
    pos, meta = packed_meta(lens, [0] * len(lens), DEV)
    meta.per_seq = True
    layer.attn.backend = "auto"
    cache = KVCache(1, 40, -(-(max(lens) + 4) // 128) * 128, c.num_kv_heads, c.head_dim, DEV, DT)
    x = torch.randn(sum(lens), c.hidden_size, device=DEV, dtype=DT)
    cos, sin = rot(pos)
    warm_per_seq(lens, c.num_heads, c.num_kv_heads, c.head_dim, DEV, DT)
    layer.compile(dynamic=True)
    f = lambda: layer(x, cos, sin, meta, cache.layer(0))  # noqa: E731
    with torch.inference_mode():
        from torch._inductor.utils import run_and_get_code

        _, codes = run_and_get_code(f)
        for line in "\n".join(codes).splitlines():  # the compiled graph's copies and extern calls
            if (
                any(k in line for k in ("copy_", "clone", "extern_kernels", "torch.ops."))
                and "import" not in line
            ):
                print("  code:", line.strip()[:160])
        ms = bench_ms(f, DEV, warmup=3, rep=20)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            f()
            torch.cuda.synchronize()
    T = sum(lens)
    print(f"## {preset} decoder layer, {len(lens)} sequences, {T} tokens: {ms:.3f} ms per layer (do_bench)\n")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=100))
    # which host ops launch the device-to-device copies (shapes of their inputs)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.inference_mode(), torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        f()
        torch.cuda.synchronize()
    for e in prof.key_averages(group_by_input_shape=True):
        if any(k in e.key for k in ("copy", "clone", "pad", "cat", "contiguous", "index_put", "Memcpy")):
            print(f"{e.key[:60]:60s} calls {e.count:4d} shapes {str(e.input_shapes)[:150]}")


def per_seq_variant(q, k, v, cu: list[int], how: str):
    """`causal_attn_per_seq` rewritten three ways (how: "cat" gathers the window outputs with one cat instead of
    a copy per sequence; "cat-view" also leaves v as the strided view of qkv; "calls" only makes the SDPA calls)."""
    T = q.shape[0]
    if how == "cat":
        v = v.contiguous()
    outs = []
    with sdpa_context("cudnn", q.device):
        for s, e in zip(cu[:-1], cu[1:], strict=True):
            n, w = e - s, -(-(e - s) // 64) * 64
            rows = [t[s : s + w] for t in (q, k, v)]
            if s + w > T:
                rows = [F.pad(r, (0, 0, 0, 0, 0, s + w - T)) for r in rows]
            qs, ks, vs = (r.transpose(0, 1)[None] for r in rows)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            outs.append(o[0, :, :n].transpose(0, 1))
    return outs if how == "calls" else torch.cat(outs)


def perseq(preset: str = "internvl2_5-8b") -> None:
    """Per-sequence cuDNN prefill attention over the seed job's first batch: the op as is (a copy per sequence into
    the output, v made contiguous) vs one cat of the window outputs, vs that with v left a view of qkv, vs the SDPA
    calls alone (no gathering); wall-clock per call (do_bench), outputs compared with the op's."""
    from e2e import batches, prepare

    from batchvl.llm.attention import causal_attn_per_seq

    c = from_preset(preset).llm
    prepared = prepare(500, 8192)
    lens = [len(prepared[i].input_ids) for i in batches(prepared, 65536)[0]]
    T, H, Hkv, D = sum(lens), c.num_heads, c.num_kv_heads, c.head_dim
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=DEV, dtype=DT)
    q = torch.randn(T, H, D, device=DEV, dtype=DT)
    k = torch.randn(T, Hkv, D, device=DEV, dtype=DT)
    v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    with torch.inference_mode():
        ref = causal_attn_per_seq(q, k, v, cu_t, "cudnn")
        print(f"## {preset}: {len(lens)} sequences, {T} tokens, {H}/{Hkv} heads x {D}\n")
        row("per-sequence cuDNN prefill attention", "ms (do_bench)", "max abs diff vs the op")
        row(*["---"] * 3)
        row("the op (copy per sequence, v contiguous)",
            f"{bench_ms(lambda: causal_attn_per_seq(q, k, v, cu_t, 'cudnn'), DEV):.3f}", "0")  # fmt: skip
        for how in ("cat", "cat-view", "calls"):
            out = per_seq_variant(q, k, v, cu, how)
            diff = "-" if how == "calls" else f"{float((out - ref).abs().max()):.1e}"
            row(how, f"{bench_ms(lambda how=how: per_seq_variant(q, k, v, cu, how), DEV):.3f}", diff)


# --------------------------------------------------------------------------- a persistent TMA GEMM (probe.py tma)
# The open question behind both remaining targets: can a Triton GEMM run at cuBLAS speed at these shapes, so that
# the residual / layer-scale / activation passes could live in its epilogue, and the norm in the next GEMM's
# prologue? Session 7's plain-pointer kernel ran at ~81% of cuBLAS. This one is persistent (one program per SM
# walking the output tiles in grouped order) and loads its tiles with TMA (device-side tensor descriptors), as
# Triton's persistent-matmul tutorial does on Hopper.
# EPI: 0 writes the product; 1 writes R + LS * (product + BIAS) (the ViT's residual with its layer scale).
# PRO: 1 normalizes each A tile on its way in, a * RSTD[row] * NW[col] rounded to A's dtype (an RMSNorm whose row
# statistics came from the previous epilogue), so the norm's output is never written.

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps)
TMA_CONFIGS = [
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 5, 4),
    (256, 128, 64, 8, 3, 8),
    (128, 128, 128, 8, 3, 8),
]

if triton is not None:

    @triton.jit
    def _mm_tma_kernel(
        A, B, C, R, LS, BIAS, RSTD, NW, MU, CS, SUM, SSQ, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        NUM_SMS: tl.constexpr, EPI: tl.constexpr, PRO: tl.constexpr, STATS: tl.constexpr, GELU: tl.constexpr,
    ):  # fmt: skip
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
        c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        r_desc = tl.make_tensor_descriptor(R, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        n_m, n_n, k_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_SMS, flatten=True):
            pid_m, pid_n = _grouped_tile(tile, n_m, n_n, GROUP_M)
            om, on = pid_m * BLOCK_M, pid_n * BLOCK_N
            rows, cols = om + tl.arange(0, BLOCK_M), on + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if PRO == 1:
                rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
            for kk in range(k_tiles):
                a = a_desc.load([om, kk * BLOCK_K])  # [BLOCK_M, BLOCK_K]
                if PRO == 1:
                    ks = kk * BLOCK_K + tl.arange(0, BLOCK_K)
                    nw = tl.load(NW + ks, mask=ks < K, other=0.0).to(tl.float32)
                    a = (a.to(tl.float32) * rstd[:, None] * nw[None, :]).to(A.dtype.element_ty)
                b = b_desc.load([on, kk * BLOCK_K])  # [BLOCK_N, BLOCK_K]: rows of the [N, K] weight
                acc = tl.dot(a, b.T, acc)
            if EPI == 1:
                ls = tl.load(LS + cols, mask=cols < N, other=0.0).to(tl.float32)
                bias = tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)
                acc = r_desc.load([om, on]).to(tl.float32) + ls[None, :] * (acc + bias[None, :])
                if STATS == 1:  # the next norm's row statistics, summed over this row's N tiles
                    tl.atomic_add(SUM + rows, tl.sum(acc, axis=1), mask=rows < M, sem="relaxed")
                    tl.atomic_add(SSQ + rows, tl.sum(acc * acc, axis=1), mask=rows < M, sem="relaxed")
            if EPI == 2:  # the input's norm folded in: rstd * (a @ (w * nw)^T - mean * colsum) + bias'
                rs = tl.load(RSTD + rows, mask=rows < M, other=0.0)
                mu = tl.load(MU + rows, mask=rows < M, other=0.0)
                cs = tl.load(CS + cols, mask=cols < N, other=0.0)
                bias = tl.load(BIAS + cols, mask=cols < N, other=0.0)
                acc = rs[:, None] * (acc - mu[:, None] * cs[None, :]) + bias[None, :]
                if GELU == 1:  # tanh form, as cuBLASLt's epilogue
                    u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                    acc = 0.5 * acc * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0))
            c_desc.store([om, on], acc.to(C.dtype.element_ty))


def mm_tma(a, w, cfg, resid=None, ls=None, bias=None, num_sms: int | None = None, rstd=None, nw=None, stats=None,
           folded=None, gelu=False):  # fmt: skip
    """a [M, K] @ w[N, K]^T through `_mm_tma_kernel`; with resid/ls/bias: resid + ls * (a @ w^T + bias) (with
    stats = (sum [M], ssq [M]) fp32: the result's row sums and sums of squares added into them); with rstd [M] (fp32)
    and nw [K]: a is first normalized, a * rstd[:, None] * nw (rounded to a's dtype); with folded = (rstd, mean [M],
    colsum [N], bias [N]) fp32: rstd * (a @ w^T - mean * colsum) + bias (a norm of a folded into w and the
    epilogue), then GELU (tanh form) if gelu."""
    bm, bn, bk, gm, stages, warps = cfg
    M, K = a.shape
    N = w.shape[0]
    out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    if a.is_cuda:  # device-side descriptors need scratch memory
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=a.device))
    sms = num_sms or (torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4)
    epi = 1 if resid is not None else 2 if folded is not None else 0
    rs, mu, cs, fb = folded if folded is not None else (rstd, out, out, out)
    s_sum, s_ssq = stats if stats is not None else (out, out)
    n_tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    _mm_tma_kernel[(min(sms, n_tiles),)](
        a, w, out, resid if epi == 1 else out, ls if epi == 1 else out, bias if epi == 1 else fb,
        rs if rs is not None else out, nw if nw is not None else out, mu, cs, s_sum, s_ssq, M, N, K,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_SMS=min(sms, n_tiles), EPI=epi,
        PRO=int(rstd is not None and folded is None), STATS=int(stats is not None), GELU=int(gelu),
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out


def tma(shapes: dict[str, tuple[int, int, int]] | None = None) -> None:
    """The persistent TMA GEMM against cuBLAS at the ViT's and the 8B LLM's shapes: plain; with the residual +
    layer-scale epilogue (against cuBLAS + the compiled residual kernel), also summing the next norm's row
    statistics; with the input's LayerNorm folded into the weight and the epilogue (against the compiled norm pass +
    cuBLAS), also with GELU; with the RMSNorm prologue. Per shape, the fastest plain-GEMM config that also fits the
    variants."""
    from triton.testing import do_bench

    shapes = shapes or {  # name: (M, K, N)
        "6B proj": (64 * 1025, 3200, 3200),
        "6B qkv": (64 * 1025, 3200, 9600),
        "6B fc1": (64 * 1025, 3200, 12800),
        "6B fc2": (64 * 1025, 12800, 3200),
        "300M qkv": (64 * 1025, 1024, 3072),
        "300M fc1": (64 * 1025, 1024, 4096),
        "300M fc2": (64 * 1025, 4096, 1024),
        "8B down": (65210, 14336, 4096),
    }
    bench = functools.partial(do_bench, return_mode="median")
    resid_add = torch.compile(lambda r, ls, y, b: r + ls * (y + b))
    ln = torch.compile(lambda a, nw, nb: F.layer_norm(a, (a.shape[-1],), nw, nb, 1e-6))
    row("shape (M, K -> N)", "cuBLAS ms (TFLOP/s)", "best TMA ms (TFLOP/s)", "x cuBLAS", "config",
        "residual: cuBLAS + pass ms", "TMA epilogue ms", "+ row stats ms", "x", "rel err",
        "norm: pass + cuBLAS ms", "TMA folded ms", "+ GELU ms", "x", "rel err", "TMA prologue ms", "rel err")  # fmt: skip
    row(*["---"] * 17)
    rel = lambda got, ref: float((got.float() - ref.float()).norm() / ref.float().norm())  # noqa: E731
    for name, (M, K, N) in shapes.items():
        a = torch.randn(M, K, device=DEV, dtype=DT)
        w = torch.randn(N, K, device=DEV, dtype=DT) * 0.02
        r = torch.randn(M, N, device=DEV, dtype=DT)
        ls, b = torch.rand(N, device=DEV, dtype=DT) * 0.1, torch.randn(N, device=DEV, dtype=DT) * 0.02
        fl = 2 * M * K * N / 1e9
        ms_cublas = bench(lambda a=a, w=w: F.linear(a, w))
        timed = []  # (ms, config) of the plain GEMM
        for cfg in TMA_CONFIGS:
            try:
                mm_tma(a, w, cfg)
                timed.append((bench(lambda a=a, w=w, cfg=cfg: mm_tma(a, w, cfg)), cfg))
            except Exception as ex:  # noqa: BLE001
                print(f"  {name} {cfg}: {type(ex).__name__}: {str(ex)[:200]}")
        best = (float("inf"), None)
        # the fastest config whose epilogue / prologue variants fit too (the extra tiles need shared memory)
        for ms, cfg in sorted(timed):
            try:
                st0 = torch.zeros(2, M, device=DEV)
                mm_tma(a, w, cfg, r, ls, b, stats=st0)
                mm_tma(a, w, cfg, rstd=st0[0], nw=b.new_ones(K))
                best = (ms, cfg)
                break
            except Exception as ex:  # noqa: BLE001
                print(f"  {name} {cfg} with its epilogue: {type(ex).__name__}: {str(ex)[:200]}")
        if best[1] is None:
            continue
        c = best[1]
        # residual epilogue (and the next norm's row statistics)
        ref = resid_add(r, ls, F.linear(a, w), b)
        ms_ref = bench(lambda a=a, w=w, r=r, ls=ls, b=b: resid_add(r, ls, F.linear(a, w), b))
        err = rel(mm_tma(a, w, c, r, ls, b), ref)
        ms_epi = bench(lambda c=c, a=a, w=w, r=r, ls=ls, b=b: mm_tma(a, w, c, r, ls, b))
        st = torch.zeros(2, M, device=DEV)
        ms_st = bench(
            lambda c=c, a=a, w=w, r=r, ls=ls, b=b, st=st: (st.zero_(), mm_tma(a, w, c, r, ls, b, stats=st))
        )
        # the input's LayerNorm folded: (a - mu) * rstd * nw + nb, then @ w^T + b
        nw = 1 + 0.1 * torch.randn(K, device=DEV, dtype=DT)
        nb = 0.1 * torch.randn(K, device=DEV, dtype=DT)
        ref_ln = F.linear(ln(a, nw, nb), w, b)
        ms_ln = bench(lambda a=a, w=w, nw=nw, nb=nb, b=b: F.linear(ln(a, nw, nb), w, b))
        af = a.float()
        mu, rstd = af.mean(-1), torch.rsqrt(af.var(-1, unbiased=False) + 1e-6)
        wf = (w.float() * nw.float()).to(DT)  # [N, K]: the norm weight folded into the GEMM's
        folded = (rstd, mu, wf.float().sum(-1), b.float() + w.float() @ nb.float())
        err_ln = rel(mm_tma(a, wf, c, folded=folded), ref_ln)
        ms_fold = bench(lambda c=c, a=a, wf=wf, f=folded: mm_tma(a, wf, c, folded=f))
        ms_gelu = bench(lambda c=c, a=a, wf=wf, f=folded: mm_tma(a, wf, c, folded=f, gelu=True))
        # the RMSNorm prologue (A tiles normalized on load)
        rs2 = torch.rsqrt(af.pow(2).mean(-1) + 1e-6)  # [M]
        ref_n = F.linear((af * rs2[:, None] * nw.float()).to(DT), w)
        err_n = rel(mm_tma(a, w, c, rstd=rs2, nw=nw), ref_n)
        ms_pro = bench(lambda c=c, a=a, w=w, r=rs2, n=nw: mm_tma(a, w, c, rstd=r, nw=n))
        row(f"{name} ({M}, {K} -> {N})", f"{ms_cublas:.3f} ({fl / ms_cublas:.0f})", f"{best[0]:.3f} "
            f"({fl / best[0]:.0f})", f"{ms_cublas / best[0]:.3f}", c, f"{ms_ref:.3f}", f"{ms_epi:.3f}",
            f"{ms_st:.3f}", f"{ms_ref / ms_st:.3f}", f"{err:.1e}", f"{ms_ln:.3f}", f"{ms_fold:.3f}",
            f"{ms_gelu:.3f}", f"{ms_ln / ms_fold:.3f}", f"{err_ln:.1e}", f"{ms_pro:.3f}", f"{err_n:.1e}")  # fmt: skip
        del a, w, r, af, wf, ref, ref_ln, ref_n


def inplace() -> None:
    """The residual add as cuBLAS's C with C = D (x.addmm_(a, w^T): no copy of x first, unlike addmm out of place,
    which copies x into its result and which Inductor emits for `x + linear(a, w)`), against mm alone, at the ViT's
    and the 8B LLM's row-parallel shapes; also the in-place add compiled (does Inductor keep it in place?)."""
    from triton.testing import do_bench

    shapes = {  # name: (M, K, N)
        "300M proj": (64 * 1025, 1024, 1024),
        "300M fc2": (64 * 1025, 4096, 1024),
        "6B proj": (64 * 1025, 3200, 3200),
        "6B fc2": (64 * 1025, 12800, 3200),
        "8B o_proj": (65210, 4096, 4096),
        "8B down": (65210, 14336, 4096),
    }
    compiled = torch.compile(lambda x, a, w: x.addmm_(a, w.t()), dynamic=False)
    row("shape (M, K -> N)", "mm ms", "addmm (copies x) ms", "x.addmm_ ms", "x.addmm_ compiled ms",
        "addmm_ - mm (ms)", "bytes of x at 3.5 TB/s (ms)", "rel err addmm_ vs x + mm")  # fmt: skip
    row(*["---"] * 8)
    for name, (M, K, N) in shapes.items():
        a = torch.randn(M, K, device=DEV, dtype=DT)
        w = torch.randn(N, K, device=DEV, dtype=DT) * 0.02
        x = torch.randn(M, N, device=DEV, dtype=DT)
        ref = x.float() + a.float() @ w.float().t()
        got = x.clone().addmm_(a, w.t())
        err = float((got.float() - ref).norm() / ref.norm())
        with torch.inference_mode():
            t_mm = do_bench(lambda a=a, w=w: torch.mm(a, w.t()), return_mode="median")
            t_add = do_bench(lambda x=x, a=a, w=w: torch.addmm(x, a, w.t()), return_mode="median")
            xs = x.clone()
            t_ip = do_bench(lambda x=xs, a=a, w=w: x.addmm_(a, w.t()), return_mode="median")
            compiled(xs, a, w)
            t_c = do_bench(lambda x=xs, a=a, w=w: compiled(x, a, w), return_mode="median")
        row(f"{name} ({M}, {K} -> {N})", f"{t_mm:.3f}", f"{t_add:.3f}", f"{t_ip:.3f}", f"{t_c:.3f}",
            f"{t_ip - t_mm:.3f}", f"{M * N * 2 / 3.5e9:.3f}", f"{err:.1e}")  # fmt: skip


def blas(tiles: int = 64) -> None:
    """The ViT layers' GEMMs (F.linear at 64 tiles) three ways: torch's default BLAS path, cuBLASLt preferred
    (`torch.backends.cuda.preferred_blas_library`), and TunableOp (`torch.cuda.tunable`: each registered
    implementation timed on the first call, the fastest kept). Does any beat the default, which the floor times?"""
    from triton.testing import do_bench

    tun = torch.cuda.tunable
    shapes = {}
    for preset, tag in (("internvl2_5-38b", "6B"), ("internvl2_5-8b", "300M")):
        v_ = from_preset(preset).vision
        M, C, ff = tiles * (v_.num_patches + 1), v_.hidden_size, v_.intermediate_size
        shapes.update({f"{tag} qkv": (M, C, 3 * C), f"{tag} proj": (M, C, C), f"{tag} fc1": (M, C, ff),
                       f"{tag} fc2": (M, ff, C)})  # fmt: skip
    default_lib = torch.backends.cuda.preferred_blas_library()
    print(f"default BLAS library: {default_lib}")
    row(
        "shape (M, K -> N)", "default ms", "cuBLASLt ms", "TunableOp ms", "TunableOp's pick", "best / default"
    )
    row(*["---"] * 6)
    for name, (M, K, N) in shapes.items():
        a = torch.randn(M, K, device=DEV, dtype=DT)
        w = torch.randn(N, K, device=DEV, dtype=DT) * 0.02
        t = {}
        with torch.inference_mode():
            t["default"] = do_bench(lambda a=a, w=w: F.linear(a, w), return_mode="median")
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
                t["lt"] = do_bench(lambda a=a, w=w: F.linear(a, w), return_mode="median")
            finally:
                torch.backends.cuda.preferred_blas_library(default_lib)
            pick = "-"
            try:
                tun.enable(True)
                tun.tuning_enable(True)
                tun.set_max_tuning_iterations(20)
                F.linear(a, w)  # tunes this shape
                torch.cuda.synchronize()
                tun.tuning_enable(False)
                t["tuned"] = do_bench(lambda a=a, w=w: F.linear(a, w), return_mode="median")
                res = tun.get_results()
                pick = f"{len(res)} results; last: {str(res[-1])[:120]}" if res else "no results"
            except Exception as ex:  # noqa: BLE001
                t["tuned"], pick = float("nan"), f"{type(ex).__name__}: {str(ex)[:150]}"
            finally:
                tun.enable(False)
        best = min(v for v in t.values() if v == v)
        row(f"{name} ({M}, {K} -> {N})", f"{t['default']:.3f}", f"{t['lt']:.3f}", f"{t['tuned']:.3f}", pick,
            f"{best / t['default']:.3f}")  # fmt: skip


def passes(tiles: int = 64) -> None:
    """The ViT's row passes (`fused_norm`: residual + layer scale + norm, and norm of x + shift) at each encoder's
    width over 64 tiles of rows, for (rows per program, warps) configs, as GB/s; then the 300M's fc1 with and
    without cuBLASLt's GELU epilogue and its qkv with and without the bias."""
    from triton.testing import do_bench

    from batchvl.encoder.fused_norm import _launch, launch_config

    row("width", "pass", "(rows, warps)", "ms", "GB/s", "vs first row")
    row(*["---"] * 6)
    M = tiles * 1025
    for C, rms in ((1024, False), (3200, True)):
        x, y = (torch.randn(M, C, device=DEV, dtype=DT) for _ in range(2))
        xo, ho = torch.empty_like(x), torch.empty_like(x)
        b, ls, w, nb = (torch.randn(C, device=DEV, dtype=DT) for _ in range(4))
        nb = None if rms else nb
        shift = torch.randn(C, device=DEV)
        # first row: the residual mode's launch (the shift mode's too before session 13); "vs first row" against it
        cfgs = [launch_config(C), (1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8), (16, 16)]
        for name, sh, nbytes in (
            ("residual_norm", False, 4 * M * C * 2),
            ("shifted_norm", True, 2 * M * C * 2),
        ):
            args = (x, shift, None, None, w, nb, x, ho) if sh else (x, y, b, ls, w, nb, xo, ho)
            base = None
            for cfg in dict.fromkeys(cfgs):
                try:
                    ms = do_bench(lambda cfg=cfg, sh=sh, args=args, rms=rms: _launch(
                        *args, 1e-6, rms, shift=sh, cfg=cfg), return_mode="median")  # fmt: skip
                except Exception as ex:  # noqa: BLE001
                    row(C, name, cfg, f"{type(ex).__name__}: {str(ex)[:100]}", "-", "-")
                    continue
                base = base or ms
                row(C, name, cfg, f"{ms:.4f}", f"{nbytes / ms / 1e6:.0f}", f"{ms / base:.3f}")
    v_ = from_preset("internvl2_5-8b").vision
    C, ff = v_.hidden_size, v_.intermediate_size
    a = torch.randn(M, C, device=DEV, dtype=DT)
    w1, b1 = 0.02 * torch.randn(ff, C, device=DEV, dtype=DT), 0.02 * torch.randn(ff, device=DEV, dtype=DT)
    wq, bq = (
        0.02 * torch.randn(3 * C, C, device=DEV, dtype=DT),
        0.02 * torch.randn(3 * C, device=DEV, dtype=DT),
    )
    print()
    row("300M GEMM", "ms")
    row("---", "---")
    for name, fn in (
        ("fc1 plain, no bias (the floor's)", lambda: F.linear(a, w1)),
        ("fc1 with bias (addmm)", lambda: F.linear(a, w1, b1)),
        (
            "fc1 + bias + GELU epilogue (cuBLASLt)",
            lambda: torch._addmm_activation(b1, a, w1.t(), use_gelu=True),
        ),
        ("qkv no bias (the floor's)", lambda: F.linear(a, wq)),
        ("qkv with bias (addmm)", lambda: F.linear(a, wq, bq)),
    ):
        row(name, f"{do_bench(fn, return_mode='median'):.4f}")


def shiftab() -> None:
    """The compiled 300M encoder (engine defaults) with the shift-mode norm launched one row per program (the old
    `launch_config`) and with 2048 columns per program (the new), interleaved three times at 16 and 64 tiles,
    ~1 s per timing; the launch config is read at run time, so one compiled encoder serves both."""
    import statistics

    import triton
    from vit import time_calls

    from batchvl.encoder import fused_norm
    from batchvl.encoder.internvit_compiled import CompiledEncoder

    new = fused_norm.launch_config

    def old(C, shift=False):
        return 1, min(16, max(4, triton.next_power_of_2(C) // 256))

    cfg = from_preset("internvl2_5-8b")
    enc = random_encoder(cfg, DEV, DT)
    row("tiles", "old: 1 row / program, tiles/s (3 runs)", "new: 2048 columns / program, tiles/s (3 runs)",
        "new / old (medians)")  # fmt: skip
    row(*["---"] * 4)
    try:
        for tiles in (16, 64):
            ce = CompiledEncoder(enc, buckets=[tiles])
            px = torch.randn(tiles, 3, cfg.vision.image_size, cfg.vision.image_size, device=DEV, dtype=DT)
            with torch.inference_mode():
                ce(px)
                got: dict[str, list[float]] = {"old": [], "new": []}
                for _ in range(3):
                    for name, fn in (("old", old), ("new", new)):
                        fused_norm.launch_config = fn
                        ce(px)
                        sec, _ = time_calls(ce, px, 1.0, 400)
                        got[name].append(tiles / sec)
            mo, mn = statistics.median(got["old"]), statistics.median(got["new"])
            row(tiles, " / ".join(f"{v:.1f}" for v in got["old"]), " / ".join(f"{v:.1f}" for v in got["new"]),
                f"{mn / mo:.4f}")  # fmt: skip
    finally:
        fused_norm.launch_config = new


def vitattn(tiles: int = 64) -> None:
    """`encoder/vit_attention.py`'s Triton kernel (CLS key as a rank-one step, the CLS query split into partials,
    6B: q/k RMSNorm folded in) against the compiled layer's way (Inductor's q/k RMSNorm + cuDNN SDPA) and cuDNN
    alone, over the same qkv rows, for each candidate (BLOCK_M, BLOCK_N, warps, stages)."""
    # (BLOCK_M, BLOCK_N, warps, stages[, TMA]). Session 10 (bench/RESULTS.md): at head_dim 64 TMA (128, 128, 4, 3)
    # 0.786 ms vs cuDNN 0.864, the CLS token's handling 0.085 of it; at 128 TMA (64, 64, 4, 3) 2.713 vs 2.459 for
    # Inductor's q/k RMSNorm + cuDNN. Measured and dropped since: warp-specialized key loops (no faster; one config
    # failed to compile), the CLS partial before the key loop (0.793 vs 0.786). TMA with BLOCK_N = 128 at head_dim
    # 128 gave WRONG output on Triton 3.6 (rel err 0.79): not a candidate.
    cands = {64: [(128, 128, 4, 3, True), (128, 64, 4, 3, True), (128, 128, 4, 3), (64, 64, 4, 3, True)],
             128: [(64, 64, 4, 3, True), (128, 64, 8, 3, True), (64, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2),
                   (128, 64, 8, 3), (128, 64, 8, 4, True), (64, 128, 4, 3), (128, 64, 4, 3, True)]}  # fmt: skip
    presets = sys.argv[2].split(",") if len(sys.argv) > 2 else ["internvl2_5-38b", "internvl2_5-8b"]
    for preset in presets:
        _vitattn_preset(preset, tiles, cands)
        torch._dynamo.reset()


def _vitattn_preset(preset: str, tiles: int, cands: dict) -> None:
    from triton.testing import do_bench

    from batchvl.encoder.vit_attention import _vit_attention_triton, vit_attention_reference

    v_ = from_preset(preset).vision
    B, H, D, T = tiles, v_.num_heads, v_.head_dim, v_.num_patches + 1
    C, scale, eps = H * D, v_.head_dim**-0.5, v_.layer_norm_eps
    qkv = torch.randn(B * T, 3 * C, device=DEV, dtype=DT)
    wq = wk = None
    if v_.qk_normalization:
        wq, wk = ((1 + 0.2 * torch.randn(C, device=DEV)).to(DT) for _ in range(2))
    wf = (wq.float(), wk.float()) if wq is not None else (None, None)
    ref = vit_attention_reference(qkv.float(), T, H, scale, *wf, eps)
    flop = 4 * B * H * T * T * D
    print(f"\n## {preset} vision attention, {tiles} tiles, {H} heads x {D}, qk-norm {wq is not None}\n")
    row("variant", "ms", "TFLOP/s (T^2)", "rel err vs fp32")
    row(*["---"] * 4)

    def report(name, fn):
        try:
            with torch.inference_mode():
                out = fn()
                err = float((out.float() - ref).norm() / ref.norm())
                ms = do_bench(fn, return_mode="median")
            row(name, f"{ms:.3f}", f"{flop / ms / 1e9:.0f}", f"{err:.2e}")
        except Exception as ex:  # noqa: BLE001
            row(name, f"{type(ex).__name__}: {str(ex)[:300]}", "-", "-")

    cf = torch.compile(vit_attention_reference, fullgraph=True)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    with sdpa_context("cudnn", DEV):
        report("compiled layer's way (Inductor qk-norm + cuDNN)", lambda: cf(qkv, T, H, scale, wq, wk, eps))
        report("cuDNN SDPA alone (views, no qk-norm)",
               lambda: F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(B * T, C))  # fmt: skip
        qp, kp, vp = (t[:, :, 1:] for t in (q, k, v))
        ms = do_bench(lambda: F.scaled_dot_product_attention(qp, kp, vp, scale=scale), return_mode="median")
        row(
            "cuDNN SDPA over the 1024 patch tokens alone (timing only)",
            f"{ms:.3f}",
            f"{flop / ms / 1e9:.0f}",
            "-",
        )
    if wq is not None:
        qs, ks = qkv[:, :C], qkv[:, C : 2 * C]
        ms = do_bench(lambda: [torch.linalg.vector_norm(t, dim=-1, dtype=torch.float32) for t in (qs, ks)],
                      return_mode="median")  # fmt: skip
        row("  of which: the two rstd reductions (Triton path)", f"{ms:.3f}", "-", "-")
    for cfg in cands[D]:
        report(f"triton {cfg}", lambda cfg=cfg: _vit_attention_triton(qkv, T, H, scale, wq, wk, eps, cfg))
    for cfg in cands[D][:2]:
        with torch.inference_mode():
            ms = do_bench(lambda cfg=cfg: _vit_attention_triton(qkv, T, H, scale, wq, wk, eps, cfg, cls=False),
                          return_mode="median")  # fmt: skip
        row(f"triton {cfg}, CLS token left out (timing only)", f"{ms:.3f}", f"{flop / ms / 1e9:.0f}", "-")


def vit300() -> None:
    vit(presets=("internvl2_5-8b",), tuned=False)


def vit6b() -> None:
    vit(presets=("internvl2_5-38b",), tuned=False)


def vitgraph() -> None:
    """The compiled encoder (engine defaults) called as is vs replayed as one CUDA graph per bucket: do_bench
    medians at each encoder's real depth, the GPU-busy share of a plain call (kernel time summed by the profiler /
    wall time; rough: the profiler slows the host too), and the graph's output against the plain call's (should be
    bit-equal)."""
    import time

    from batchvl.encoder.internvit_compiled import CompiledEncoder

    sizes = {"internvl2_5-8b": (16, 64, 128), "internvl2_5-38b": (16, 64)}
    row("preset", "tiles", "compiled ms", "graph ms", "graph / compiled", "GPU busy (plain)", "max |diff|",
        "capture s")  # fmt: skip
    row(*["---"] * 8)
    for preset, tiles_list in sizes.items():
        cfg = from_preset(preset)
        v = cfg.vision
        enc = random_encoder(cfg, DEV, DT)
        for tiles in tiles_list:
            ce = CompiledEncoder(enc, buckets=[tiles])
            with torch.inference_mode():
                px = torch.randn(tiles, 3, v.image_size, v.image_size, device=DEV, dtype=DT)
                ref = ce(px)
            ms = bench_ms(lambda ce=ce, px=px: ce(px), DEV, warmup=3, rep=30)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                ce(px)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3
            busy = sum(getattr(e, "device_time_total", 0) for e in prof.key_averages()
                       if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3  # fmt: skip
            t0 = time.perf_counter()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    ce._run(px)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = ce._run(px)
            g.replay()
            torch.cuda.synchronize()
            cap = time.perf_counter() - t0
            diff = float((out.float() - ref.float()).abs().max())
            gms = bench_ms(g.replay, DEV, warmup=3, rep=30)
            row(preset, tiles, f"{ms:.2f}", f"{gms:.2f}", f"{gms / ms:.3f}", f"{busy / wall:.3f}", f"{diff:.1e}",
                f"{cap:.1f}")  # fmt: skip
            del g, out, ref, px, ce
            torch.cuda.empty_cache()
        del enc
        torch._dynamo.reset()


def vithost() -> None:
    """Is the compiled 300M encoder's small-batch time set by the host? Per tile count: the host time to enqueue one
    forward (the queue empty before it; median of 20), its do_bench median, and ms per call over 50 back-to-back calls
    (one sync at the end)."""
    import statistics
    import time

    from batchvl.encoder.internvit_compiled import CompiledEncoder

    row("preset", "tiles", "host enqueue ms", "do_bench ms", "back-to-back ms / call")
    row(*["---"] * 5)
    preset = "internvl2_5-8b"
    cfg = from_preset(preset)
    enc = random_encoder(cfg, DEV, DT)
    for tiles in (16, 64):
        ce = CompiledEncoder(enc, buckets=[tiles])
        with torch.inference_mode():
            px = torch.randn(tiles, 3, cfg.vision.image_size, cfg.vision.image_size, device=DEV, dtype=DT)
        ce(px)
        host = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ce(px)
            host.append((time.perf_counter() - t0) * 1e3)
        gpu = bench_ms(lambda ce=ce, px=px: ce(px), DEV, warmup=3, rep=200)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            ce(px)
        torch.cuda.synchronize()
        b2b = (time.perf_counter() - t0) * 1e3 / 50
        row(preset, tiles, f"{statistics.median(host):.2f}", f"{gpu:.2f}", f"{b2b:.2f}")
        del ce, px
    torch._dynamo.reset()


def tunab(tiles: int = 64) -> None:
    """TunableOp (`torch.cuda.tunable`) on this build: which solutions it registers for a bf16 GEMM on CUDA (its
    results name the one it keeps), each ViT GEMM (fc1 also with the GELU epilogue) with TunableOp off vs on after
    tuning, interleaved do_bench medians; then the compiled encoders (engine defaults) with TunableOp off vs on,
    interleaved three times, ~1.5 s per timing. Tuned results go to a temporary file, not the working directory."""
    import os
    import statistics
    import tempfile

    from vit import time_calls

    from batchvl.encoder.internvit_compiled import CompiledEncoder

    tun = torch.cuda.tunable
    tun.set_filename(os.path.join(tempfile.mkdtemp(), "tunableop.csv"))
    tun.set_max_tuning_iterations(30)

    def tuned(fn):
        tun.enable(True)
        tun.tuning_enable(True)
        fn()
        torch.cuda.synchronize()
        tun.tuning_enable(False)

    def ab(fn, rounds=3):
        got = {"off": [], "on": []}
        for _ in range(rounds):
            for name in ("off", "on"):
                tun.enable(name == "on")
                got[name].append(fn())
        tun.enable(False)
        return statistics.median(got["off"]), statistics.median(got["on"])

    row("GEMM (M, K -> N)", "off ms", "on ms", "on / off", "solution kept")
    row(*["---"] * 5)
    seen = 0
    for preset, tag in (("internvl2_5-38b", "6B"), ("internvl2_5-8b", "300M")):
        v_ = from_preset(preset).vision
        M, C, ff = tiles * (v_.num_patches + 1), v_.hidden_size, v_.intermediate_size
        for name, (K, N) in {"qkv": (C, 3 * C), "proj": (C, C), "fc1": (C, ff), "fc1+gelu": (C, ff),
                             "fc2": (ff, C)}.items():  # fmt: skip
            a = torch.randn(M, K, device=DEV, dtype=DT)
            w = torch.randn(N, K, device=DEV, dtype=DT) * 0.02
            b = torch.randn(N, device=DEV, dtype=DT) * 0.02
            if name == "fc1+gelu":
                fn = functools.partial(torch._addmm_activation, b, a, w.t(), use_gelu=True)
            else:
                fn = functools.partial(F.linear, a, w)
            with torch.inference_mode():
                tuned(fn)
                off, on = ab(lambda fn=fn: bench_ms(fn, DEV))
            res = tun.get_results()
            pick = "; ".join(str(r[2]) for r in res[seen:]) or "(no new result)"
            seen = len(res)
            row(f"{tag} {name} ({M}, {K} -> {N})", f"{off:.3f}", f"{on:.3f}", f"{on / off:.3f}", pick[:80])
            del a, w, b
    print(f"results: {len(tun.get_results())}; validators: {tun.get_validators()}", flush=True)

    row("preset", "tiles", "off tiles/s (3 runs)", "on tiles/s (3 runs)", "on / off (medians)")
    row(*["---"] * 5)
    for preset in ("internvl2_5-38b", "internvl2_5-8b"):
        cfg = from_preset(preset)
        enc = random_encoder(cfg, DEV, DT)
        ce = CompiledEncoder(enc, buckets=[tiles])
        px = torch.randn(tiles, 3, cfg.vision.image_size, cfg.vision.image_size, device=DEV, dtype=DT)
        with torch.inference_mode():
            ce(px)
            tuned(functools.partial(ce, px))
            runs = {"off": [], "on": []}
            for _ in range(3):
                for name in ("off", "on"):
                    tun.enable(name == "on")
                    ce(px)
                    sec, _ = time_calls(ce, px, 1.5, 400)
                    runs[name].append(tiles / sec)
            tun.enable(False)
        mo, mn = statistics.median(runs["off"]), statistics.median(runs["on"])
        row(preset, tiles, " / ".join(f"{v:.1f}" for v in runs["off"]), " / ".join(f"{v:.1f}" for v in runs["on"]),
            f"{mn / mo:.4f}")  # fmt: skip
        del ce, enc, px
        torch.cuda.empty_cache()
        torch._dynamo.reset()


def _ab(names: tuple[str, str], kwargs: tuple[dict, dict], tiles: int = 64, rounds: int = 4) -> None:
    """Two compiled 6B encoders (`CompiledEncoder(enc, **kwargs)` on one set of weights, folded in place as the
    runner folds them) timed in turn, ~3 s per timing, order A B B A per pair of rounds so a steady drift of the
    clocks weighs on both alike; one row: each side's tiles/s per round, the ratio of medians, their outputs'
    relative difference."""
    import statistics

    from vit import time_calls

    from batchvl.encoder.internvit_compiled import CompiledEncoder

    cfg = from_preset("internvl2_5-38b")
    enc = random_encoder(cfg, DEV, DT)
    encs = {
        n: CompiledEncoder(enc, buckets=[tiles], fold_in_place=True, **kw) for n, kw in zip(names, kwargs)
    }
    px = torch.randn(tiles, 3, cfg.vision.image_size, cfg.vision.image_size, device=DEV, dtype=DT)
    runs: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        a, b = (encs[n](px).float() for n in names)
        err = float((b - a).norm() / a.norm())
        for r in range(rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                encs[n](px)
                sec, _ = time_calls(encs[n], px, 3.0, 400)
                runs[n].append(tiles / sec)
    row("tiles", f"{names[0]} tiles/s ({rounds} runs)", f"{names[1]} tiles/s ({rounds} runs)",
        f"{names[1]} / {names[0]}", "rel diff")  # fmt: skip
    row(*["---"] * 5)
    ma, mb = (statistics.median(runs[n]) for n in names)
    row(tiles, *(" / ".join(f"{v:.2f}" for v in runs[n]) for n in names), f"{mb / ma:.4f}", f"{err:.1e}")


def inplaceab(tiles: int = 64) -> None:
    """The compiled 6B encoder with `residual_norm` vs residuals added in place by the GEMMs (`inplace_residual`),
    interleaved (`_ab`; session 14, before the runner folded the layer scales in place: the weights are folded
    here now, as the runner does)."""
    _ab(("residual_norm", "in place"), ({"inplace_residual": False}, {"inplace_residual": True}), tiles)


def qknormab(tiles: int = 64) -> None:
    """The 6B's q/k RMSNorm as Inductor's reductions (`triton_attn=False`: the module's `mix`) vs `fused_norm.qk_norm`
    (one Triton pass per part, `vit_attention_sdpa`): first the op alone against the compiled reference at 64 tiles'
    qkv rows (do_bench medians, GB/s of its bytes, error vs fp32), then the compiled encoders interleaved (`_ab`)."""
    from batchvl.encoder.fused_norm import qk_norm, qk_norm_reference

    cfg = from_preset("internvl2_5-38b")
    M, C = tiles * (cfg.vision.num_patches + 1), cfg.vision.hidden_size
    qkv = torch.randn(M, 3 * C, device=DEV, dtype=DT)
    wq, wk = (1 + 0.1 * torch.randn(C, device=DEV, dtype=DT) for _ in range(2))
    ref = qk_norm_reference(qkv.float(), wq.float(), wk.float(), 1e-6)
    inductor = torch.compile(qk_norm_reference)
    gb = 4 * M * C * qkv.element_size() / 1e9  # q and k read once, written once
    row(f"q/k RMSNorm, 6B, rows of [{M}, {3 * C}]", "ms", "GB/s", "rel err vs fp32")
    row(*["---"] * 4)
    for name, fn in (("Inductor (compiled reference)", inductor), ("qk_norm (Triton)", qk_norm)):
        ms = bench_ms(lambda fn=fn, x=qkv: fn(x, wq, wk, 1e-6), DEV)
        out = fn(qkv, wq, wk, 1e-6).float()
        row(name, f"{ms:.3f}", f"{gb / ms * 1e3:.0f}", f"{float((out - ref).norm() / ref.norm()):.2e}")
    del qkv, ref
    torch.cuda.empty_cache()
    print()
    _ab(("Inductor qk-norm", "Triton qk-norm"), ({"triton_attn": False}, {"triton_attn": True}), tiles)


def howtimed() -> None:
    """The compiled 6B read 34 tiles/s under `probe.py tunab` / `inplaceab` (time_calls inside inference_mode) and
    51.3 under `vit.py` (time_calls inside no_grad) on the same machine type: the same CompiledEncoder timed each
    way in one process, in turn, with each way's kernel time by kind from one profiled call."""
    from vit import time_calls

    from batchvl.encoder.internvit_compiled import CompiledEncoder

    tiles = 64
    for preset in ("internvl2_5-38b", "internvl2_5-8b"):
        cfg = from_preset(preset)
        enc = random_encoder(cfg, DEV, DT)
        ce = CompiledEncoder(enc, buckets=[tiles])
        px = torch.randn(tiles, 3, cfg.vision.image_size, cfg.vision.image_size, device=DEV, dtype=DT)
        with torch.no_grad():
            ce(px)
        ways = [
            ("no_grad + time_calls", torch.no_grad, "calls"),
            ("inference_mode + time_calls", torch.inference_mode, "calls"),
            ("bench_ms (do_bench)", torch.no_grad, "do_bench"),
            ("no_grad + time_calls again", torch.no_grad, "calls"),
        ]
        row(preset, "tiles/s", "profiled ms by kind (one call)")
        row("---", "---", "---")
        for name, ctx, how in ways:
            with ctx():
                ce(px)
                if how == "calls":
                    tps = tiles / time_calls(ce, px, 1.5, 400)[0]
                else:
                    tps = tiles / bench_ms(functools.partial(ce, px), DEV, 3, 20) * 1e3
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                    ce(px)
                    torch.cuda.synchronize()
            kinds: dict[str, float] = {}
            for e in p.key_averages():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    k = kernel_kind(e.key)
                    kinds[k] = kinds.get(k, 0.0) + (getattr(e, "device_time_total", 0) or 0) / 1e3
            row(
                name,
                f"{tps:.2f}",
                ", ".join(f"{k} {v:.0f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])),
            )
        del ce, enc, px
        torch.cuda.empty_cache()
        torch._dynamo.reset()


if __name__ == "__main__":
    torch.manual_seed(0)
    {
        "cls": cls,
        "shiftab": shiftab,
        "tunab": tunab,
        "howtimed": howtimed,
        "inplaceab": inplaceab,
        "qknormab": qknormab,
        "passes": passes,
        "blas": blas,
        "vitattn": vitattn,
        "tma": tma,
        "inplace": inplace,
        "perseq": perseq,
        "llm-layer": llm_layer,
        "ragged": ragged,
        "swiglu": swiglu,
        "padded": padded,
        "resid": resid,
        "decode": decode,
        "decattn": decattn,
        "vit300": vit300,
        "vit6b": vit6b,
        "vitgraph": vitgraph,
        "vithost": vithost,
        "vit": vit,
        "parts": parts,
        "fp8": fp8,
        "llm": llm,
        "attn": attn,
        "attn-job": attn_job,
    }[sys.argv[1]]()
