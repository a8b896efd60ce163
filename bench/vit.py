"""InternViT(+projector) throughput: ours eager/compiled vs transformers sdpa (eager/compiled), against the floor.

    python bench/vit.py --batches 64 --rounds 3     # the figure in bench/RESULTS.md (one H200)
    python bench/vit.py --smoke                     # CPU, tiny configs, 1-2 iterations

Floor: the encoder's GEMMs (qkv, proj, fc1, fc2 per layer, times layers, plus the projector's two) at the
exact shapes and SDPA alone (fastest of flash/cuDNN/efficient), each timed with triton.testing.do_bench
(median). Matmul ceiling: one 8192^3 bf16 GEMM, do_bench median. Weights are random bf16 drawn on the GPU
(normal std 0.02, norm weights ~1, layer scales ~0.1). Full JSON goes to $OUT/vit_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import tile_flops  # noqa: E402

from batchvl.config import InternVLConfig, from_preset  # noqa: E402
from batchvl.encoder.fp8 import fp8_vit  # noqa: E402
from batchvl.encoder.internvit import VisionEncoder  # noqa: E402
from batchvl.encoder.internvit_compiled import CompiledEncoder  # noqa: E402
from batchvl.ops.fp8 import quantize_rows  # noqa: E402
from batchvl.ops.sdpa import sdpa_context  # noqa: E402

# model name -> preset giving the vision tower and the projector's output width (the largest LLM it feeds)
PRESET = {
    "6b": "internvl2_5-26b",
    "300m": "internvl2_5-8b",
    "tiny-6b": "tiny-6b-style",
    "tiny-300m": "tiny-qwen2",
}

# --------------------------------------------------------------------------- timing


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench_ms(fn, dev: torch.device, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of fn: triton.testing.do_bench on GPU, a perf_counter loop on CPU."""
    if dev.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def time_calls(fn, px: torch.Tensor, target_s: float, max_iters: int) -> tuple[float, int]:
    """Seconds per call (the caller has warmed fn up): at least 2 calls, more while under target_s. Starts on an idle
    GPU: a warm-up call still queued would otherwise be timed too."""
    dev = px.device
    sync(dev)
    n, t0 = 0, time.perf_counter()
    while n < 2 or (n < max_iters and time.perf_counter() - t0 < target_s):
        fn(px)
        n += 1
        if n == 1 or n % 4 == 0:
            sync(dev)
    sync(dev)
    return (time.perf_counter() - t0) / n, n


def matmul_ceiling(dev: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of one 8192^3 GEMM (do_bench median); small on CPU."""
    n = 8192 if dev.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n**3 / (bench_ms(lambda: a @ b, dev, warmup=100, rep=500) * 1e-3)  # as bench/common.py


# --------------------------------------------------------------------------- models


def random_encoder(
    cfg: InternVLConfig, dev: torch.device, dtype: torch.dtype, seed: int = 0
) -> VisionEncoder:
    """Random weights drawn on the device: normal std 0.02, norm weights ~1, layer scales ~0.1."""
    torch.manual_seed(seed)
    with torch.device(dev):
        enc = VisionEncoder(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if name.endswith(("ls1", "ls2")):
                p.normal_(0.1, 0.01)
            elif p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.02)
            else:
                p.normal_(0.0, 0.02)
    enc.requires_grad_(False)
    return enc


def hf_model(enc: VisionEncoder, dev: torch.device, dtype: torch.dtype):
    """transformers InternVLModel (sdpa; one tiny LLM layer) with the vision tower and projector copied from ours."""
    import transformers

    cfg, v = enc.cfg, enc.cfg.vision
    vision = dict(hidden_size=v.hidden_size, num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
                  intermediate_size=v.intermediate_size, norm_type=v.norm_type, use_qk_norm=v.qk_normalization,
                  attention_bias=v.qkv_bias, layer_norm_eps=v.layer_norm_eps, image_size=v.image_size,
                  patch_size=v.patch_size, use_mean_pooling=True, model_type="internvl_vision")  # fmt: skip
    text = dict(model_type="qwen2", hidden_size=cfg.llm.hidden_size, num_hidden_layers=1, vocab_size=256,
                num_attention_heads=cfg.llm.num_heads, num_key_value_heads=cfg.llm.num_kv_heads,
                intermediate_size=256)  # fmt: skip
    hc = transformers.InternVLConfig(
        vision_config=vision, text_config=text, downsample_ratio=cfg.downsample_ratio
    )
    for c in (hc, hc.vision_config, hc.text_config):
        c._attn_implementation = "sdpa"
    with torch.device(dev):
        hf = transformers.InternVLModel(hc).to(dtype).eval()
    hf.requires_grad_(False)
    missing = set(hf.state_dict()) - set(ours_to_hf(enc.state_dict()))
    assert all(k.startswith("language_model.") for k in missing), sorted(missing)[:5]
    hf.load_state_dict(ours_to_hf(enc.state_dict()), strict=False)
    if hf.vision_tower.config._attn_implementation != "sdpa":
        print(
            f"warning: transformers vision attention is {hf.vision_tower.config._attn_implementation!r}, not sdpa"
        )
    return hf


def ours_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """VisionEncoder names -> transformers InternVLModel names (qkv split into q/k/v)."""
    out = {}
    for k, t in sd.items():
        if k.startswith("projector."):
            k = k.replace("projector.", "multi_modal_projector.").replace(".norm.", ".layer_norm.")
            out[k.replace(".fc1.", ".linear_1.").replace(".fc2.", ".linear_2.")] = t
        elif k.startswith("vit.layers."):
            i, rest = k.removeprefix("vit.layers.").split(".", 1)
            pre = f"vision_tower.encoder.layer.{i}."
            if rest.startswith("attn.qkv."):
                for name, part in zip("qkv", t.chunk(3), strict=True):
                    out[pre + f"attention.{name}_proj." + rest.rsplit(".", 1)[1]] = part
                continue
            rest = (rest.replace("attn.proj", "attention.projection_layer").replace("attn.", "attention.")
                    .replace("norm1", "layernorm_before").replace("norm2", "layernorm_after")
                    .replace("ls1", "lambda_1").replace("ls2", "lambda_2"))  # fmt: skip
            out[pre + rest] = t
        else:
            k = (k.replace("vit.", "vision_tower.", 1).replace("class_embedding", "cls_token")
                 .replace("patch_embedding", "patch_embeddings.projection")
                 .replace("position_embedding", "position_embeddings"))  # fmt: skip
            out[k] = t
    return out


def hf_forward(hf):
    def run(px: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = hf.get_image_features(px, vision_feature_layer=-1, vision_feature_select_strategy="default")
        return out if isinstance(out, torch.Tensor) else out.pooler_output  # older transformers: a tensor

    return run


def compile_hf_regional(hf, mode: str | None) -> None:
    """torch.compile each vision layer and the projector in place (same code, compiled once per shape)."""
    for layer in hf.vision_tower.encoder.layer:
        layer.compile(mode=mode, dynamic=False)
    hf.multi_modal_projector.compile(mode=mode, dynamic=False)


# --------------------------------------------------------------------------- floor


def floor_ms(
    cfg: InternVLConfig, tiles: int, dev: torch.device, dtype: torch.dtype, fp8: bool = False
) -> dict:
    """GEMMs at the encoder's exact shapes and SDPA alone; returns per-part ms and the per-forward total.
    fp8: the layer GEMMs as `torch._scaled_mm` of e4m3 operands with row-wise scales (the projector stays bf16)."""
    v = cfg.vision
    T, C, ff, L = v.num_patches + 1, v.hidden_size, v.intermediate_size, v.num_layers
    M, P, H = tiles * T, tiles * cfg.num_image_token, cfg.llm.hidden_size
    gemms = {"qkv": (M, C, 3 * C), "proj": (M, C, C), "fc1": (M, C, ff), "fc2": (M, ff, C),
             "mlp1_fc1": (P, cfg.projector_in, H), "mlp1_fc2": (P, H, H)}  # fmt: skip
    out: dict = {}
    for name, (m, k, n) in gemms.items():
        a = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype)
        if fp8 and not name.startswith("mlp1"):
            (aq, sa), (wq, sw) = quantize_rows(a), quantize_rows(w)
            out[name] = bench_ms(lambda aq=aq, wq=wq, sa=sa, sw=sw.t().contiguous(): torch._scaled_mm(
                aq, wq.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16), dev)  # fmt: skip
            del aq, wq
        else:
            out[name] = bench_ms(lambda a=a, w=w: F.linear(a, w), dev)
        del a, w
    q, k_, val = (torch.randn(tiles, v.num_heads, T, v.head_dim, device=dev, dtype=dtype) for _ in range(3))
    attn = {}
    for backend in ("flash", "cudnn", "efficient") if dev.type == "cuda" else ("auto",):
        try:
            with sdpa_context(backend, dev):
                attn[backend] = bench_ms(lambda: F.scaled_dot_product_attention(q, k_, val), dev)
        except RuntimeError as e:  # backend unavailable for this shape/dtype
            attn[backend] = float("nan")
            out.setdefault("attn_errors", {})[backend] = str(e).splitlines()[0][:120]
    best = min((b for b in attn if not math.isnan(attn[b])), key=attn.get)
    out.update(attn_by_backend=attn, attn_backend=best, attn=attn[best])
    per_layer = sum(out[g] for g in ("qkv", "proj", "fc1", "fc2")) + out["attn"]
    out["vit_ms"] = L * per_layer
    out["total_ms"] = out["vit_ms"] + out["mlp1_fc1"] + out["mlp1_fc2"]
    return out


def floor_sequence(enc: VisionEncoder, tiles: int, dev: torch.device, dtype: torch.dtype, backend: str):
    """The floor's work as one forward, for `time_calls`: every layer's qkv / proj / fc1 / fc2 GEMM with the
    encoder's own weights and SDPA under `backend`, then the projector's two GEMMs, back to back on fixed random
    inputs (nothing elementwise, no data flowing between them). Timed exactly like the rows, so it sees the clocks a
    sustained forward runs at; `floor_ms` times each part alone (do_bench medians, L2 flushed between calls)."""
    v, cfg = enc.cfg.vision, enc.cfg
    T, C, ff, H, D = v.num_patches + 1, v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim
    M, P = tiles * T, tiles * cfg.num_image_token
    a_c, a_ff = torch.randn(M, C, device=dev, dtype=dtype), torch.randn(M, ff, device=dev, dtype=dtype)
    q, k, val = (torch.randn(tiles, H, T, D, device=dev, dtype=dtype) for _ in range(3))
    p_in = torch.randn(P, cfg.projector_in, device=dev, dtype=dtype)
    p_h = torch.randn(P, cfg.llm.hidden_size, device=dev, dtype=dtype)

    def run(px: torch.Tensor) -> None:
        with sdpa_context(backend, dev):
            for layer in enc.vit.layers:
                F.linear(a_c, layer.attn.qkv.weight)
                F.scaled_dot_product_attention(q, k, val)
                F.linear(a_c, layer.attn.proj.weight)
                F.linear(a_c, layer.mlp.fc1.weight)
                F.linear(a_ff, layer.mlp.fc2.weight)
            F.linear(p_in, enc.projector.fc1.weight)
            F.linear(p_h, enc.projector.fc2.weight)

    return run


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


# --------------------------------------------------------------------------- one model


class Report:
    """Rows plus metadata; rewritten to $OUT/vit_bench.json after every row, so a killed run keeps its rows."""

    def __init__(self, meta: dict) -> None:
        self.meta, self.rows = meta, []
        self.path = Path(os.environ["OUT"]) / "vit_bench.json" if os.environ.get("OUT") else None

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.dump()

    def dump(self, md: str = "") -> None:
        if self.path:
            self.path.write_text(
                json.dumps(dict(meta=self.meta, rows=self.rows, table=md), indent=1, default=str)
            )


def run_model(name: str, args, dev: torch.device, dtype: torch.dtype, ceiling: float, rep: Report) -> None:
    cfg = from_preset(PRESET[name])
    if args.smoke:
        cfg.vision.image_size = 112
    enc = random_encoder(cfg, dev, dtype)
    S, flops = cfg.vision.image_size, tile_flops(cfg)
    print(f"\n== {name}: {cfg.vision.num_layers} layers, C={cfg.vision.hidden_size}, heads={cfg.vision.num_heads}, "
          f"{flops / 1e12:.3f} TFLOP/tile, projector -> {cfg.llm.hidden_size}", flush=True)  # fmt: skip

    # correctness reference: fp32 eager on the same weights (TF32 off), at the smallest benchmarked size
    n_ref = args.batches[0]
    px_ref = torch.randn(n_ref, 3, S, S, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    enc32 = copy.deepcopy(enc).float()
    with torch.no_grad():
        ref = enc32(px_ref)
    del enc32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    free_memory(dev)

    floors = {b: floor_ms(cfg, b, dev, dtype) for b in args.batches}
    floors_fp8 = {b: floor_ms(cfg, b, dev, dtype, fp8=True) for b in args.batches} if args.fp8 else {}
    backend = floors[n_ref]["attn_backend"]  # the floor's SDPA: the fastest alone
    print(f"SDPA alone, ms: {floors[n_ref]['attn_by_backend']}", flush=True)

    t0 = time.perf_counter()
    # every size in one call (max_tiles: the largest). As the runner builds it: the layer scales folded into enc's
    # own weights (every variant below, transformers' included, then runs those weights; `ref` came from the
    # unfolded copy)
    ce = CompiledEncoder(enc, max_tiles=max(args.batches))
    variants: dict[str, object] = {"ours-eager": enc, "ours-compiled": ce}
    if args.fp8:  # the layer linears in FP8 e4m3 (engine.vit_fp8), on a copy of the same weights
        variants["ours-fp8"] = CompiledEncoder(fp8_vit(copy.deepcopy(enc)), max_tiles=max(args.batches))
    if not args.skip_hf:
        variants["hf-sdpa"] = hf_forward(hf_model(enc, dev, dtype))
        hf_c = hf_model(enc, dev, dtype)
        compile_hf_regional(hf_c, None if args.hf_mode == "default" else args.hf_mode)
        variants["hf-sdpa-compiled"] = hf_forward(hf_c)
    print(f"setup {time.perf_counter() - t0:.1f}s", flush=True)

    errs, first_call = {}, {}  # first_call[(variant, tiles)]: seconds of the first call at that shape
    with torch.no_grad():
        for vname, fn in variants.items():
            if vname == "hf-sdpa-compiled" and over_budget(args):
                continue
            t1 = time.perf_counter()
            out = fn(px_ref.to(dtype))
            sync(dev)
            first_call[vname, n_ref] = time.perf_counter() - t1
            errs[vname] = rel_err(out, ref)
            if vname == "ours-compiled":
                bf16_out = out
            elif vname == "ours-fp8":  # the issue's accuracy check: FP8 features against bf16 ones
                print(f"ours-fp8 vs ours-compiled (bf16) features: rel. error {rel_err(out, bf16_out):.2e}")
            del out
    print("rel. error vs fp32 eager: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()), flush=True)
    bf16_out = None

    for b in args.batches:
        px = torch.randn(b, 3, S, S, device=dev, dtype=dtype)
        base, rows = {}, []
        with torch.no_grad():  # the floor's work as one forward, timed like the rows (see floor_sequence)
            fs = floor_sequence(enc, b, dev, dtype, backend)
            fs(px)  # warm-up; time_calls waits for it
            seq_s, _ = time_calls(fs, px, args.target_s, args.max_iters)
        del fs
        free_memory(dev)
        print(f"{name:>6} {b:4d} floor as one forward, timed like the rows: {b / seq_s:8.2f} tiles/s "
              f"(parts alone, do_bench: {b / (floors[b]['total_ms'] * 1e-3):.2f})", flush=True)  # fmt: skip
        for vname, fn in variants.items():
            if (vname, b) not in first_call and vname == "hf-sdpa-compiled" and over_budget(args):
                print(
                    f"{name:>6} {b:4d} {vname:>17}: skipped (over --budget-s {args.budget_s:.0f})", flush=True
                )
                continue
            free_memory(dev)
            mem0 = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
            with torch.no_grad():
                t1 = time.perf_counter()
                fn(px)  # warm-up; compiles on first sight of this shape
                sync(dev)
                first_call.setdefault((vname, b), time.perf_counter() - t1)
                sec, iters = time_calls(fn, px, args.target_s, args.max_iters)
            peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
            tps = base[vname] = b / sec
            fl = floors_fp8[b] if vname == "ours-fp8" else floors[b]  # each against its own floor
            compiled = vname in ("ours-compiled", "ours-fp8", "hf-sdpa-compiled")
            row = dict(model=name, tiles=b, variant=vname, tiles_per_s=tps, ms=sec * 1e3, iters=iters,
                       floor_tiles_per_s=b / (fl["total_ms"] * 1e-3), floor_vit_tiles_per_s=b / (fl["vit_ms"] * 1e-3),
                       x_floor=tps * fl["total_ms"] * 1e-3 / b, mfu=tps * flops / ceiling,
                       floor_seq_tiles_per_s=b / seq_s, x_floor_seq=tps * seq_s / b if vname != "ours-fp8" else None,
                       peak_gib=peak / 2**30, act_peak_gib=(peak - mem0) / 2**30,
                       compile_s=first_call[vname, b] if compiled else None,  # first call at this shape, one run
                       rel_err=errs.get(vname), floor=fl)  # fmt: skip
            rows.append(row)
            print(f"{name:>6} {b:4d} {vname:>17}: {tps:8.2f} tiles/s  x{row['x_floor']:.3f} floor  "
                  f"MFU {row['mfu']:.1%}  peak {row['peak_gib']:.1f} GiB", flush=True)  # fmt: skip
        # --rounds: the do_bench floor and ours again, in turn (the floor drifts most); round 0 is the rows' reading
        if args.rounds > 1:
            first = next(r for r in rows if r["variant"] == "ours-compiled")
            floor_tps, ours_tps = [first["floor_tiles_per_s"]], [first["tiles_per_s"]]
            for _ in range(1, args.rounds):
                floor_tps.append(b / (floor_ms(cfg, b, dev, dtype)["total_ms"] * 1e-3))
                free_memory(dev)
                with torch.no_grad():
                    ce(px)  # warm-up; time_calls waits for it
                    ours_tps.append(b / time_calls(ce, px, args.target_s, args.max_iters)[0])
            rep.meta.setdefault("rounds", []).append(
                dict(model=name, tiles=b, floor_tiles_per_s=floor_tps, tiles_per_s=ours_tps)
            )
        for r in rows:
            r["x_hf"] = r["tiles_per_s"] / base["hf-sdpa"] if "hf-sdpa" in base else None
            r["x_hf_compiled"] = (
                r["tiles_per_s"] / base["hf-sdpa-compiled"] if "hf-sdpa-compiled" in base else None
            )
            r["ours_compile_stats"] = {"compile_s": ce.stats.compile_s, "graphs": ce.stats.graphs}
            rep.add(r)
        del px
    print(f"ours: {ce.stats.summary()}", flush=True)
    del variants, ce, enc
    torch._dynamo.reset()
    free_memory(dev)


def over_budget(args) -> bool:
    return time.perf_counter() - args.t_start > args.budget_s


def free_memory(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def table(rows: list[dict], ceiling: float) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    out = [f"MFU vs measured matmul ceiling (one 8192^3 bf16 GEMM, do_bench median): {ceiling / 1e12:.4g} TFLOP/s",
           "floor = do_bench medians of qkv/proj/fc1/fc2 GEMMs x layers + SDPA alone x layers + projector GEMMs",
           "(ours-fp8 rows: the same floor with the layer GEMMs as FP8 _scaled_mm, row-wise scales; MFU vs bf16)",
           "seq floor = the same GEMMs (the encoder's weights) and SDPA calls as one forward, timed like the rows",
           "", "| model | tiles | variant | tiles/s | floor tiles/s | x floor | seq floor tiles/s | x seq floor | x HF "
           "| x HF-comp | MFU | peak GiB | compile s | rel err |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['model']} | {r['tiles']} | {r['variant']} | {r['tiles_per_s']:.2f} | "
                   f"{r['floor_tiles_per_s']:.2f} | {r['x_floor']:.3f} | {f(r.get('floor_seq_tiles_per_s'), '.2f')} | "
                   f"{f(r.get('x_floor_seq'), '.3f')} | {f(r.get('x_hf'), '.2f')} | "
                   f"{f(r.get('x_hf_compiled'), '.2f')} | {r['mfu']:.1%} | {r['peak_gib']:.1f} | "
                   f"{f(r['compile_s'], '.1f')} | {f(r['rel_err'], '.1e')} |")  # fmt: skip
    return "\n".join(out)


def rounds_table(rounds: list[dict]) -> str:
    """`--rounds`: per model and tile count, the do_bench floor and ours compiled read in turn, and the median ratio."""
    out = ["ours-compiled against the do_bench floor, read in turn (round 0: the table above)", "",
           "| model | tiles | floor tiles/s by round | ours tiles/s by round | x floor by round | median x floor |",
           "|---|---:|---|---|---|---:|"]  # fmt: skip
    for r in rounds:
        x = [o / f for o, f in zip(r["tiles_per_s"], r["floor_tiles_per_s"])]
        cells = [" / ".join(format(v, spec) for v in vs)
                 for vs, spec in ((r["floor_tiles_per_s"], ".2f"), (r["tiles_per_s"], ".2f"), (x, ".3f"))]  # fmt: skip
        out.append(f"| {r['model']} | {r['tiles']} | {' | '.join(cells)} | {statistics.median(x):.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="6b,300m")
    ap.add_argument("--batches", default="16,64,128")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="also ours with FP8 layer linears (engine.vit_fp8)")
    ap.add_argument(
        "--smoke", action="store_true", help="CPU-friendly: tiny configs, batch 2, 1-2 iterations"
    )
    ap.add_argument("--hf-mode", default="default", help="transformers: torch.compile mode")
    ap.add_argument("--target-s", type=float, default=1.0, help="timed seconds per measurement (>= 2 calls)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="read the do_bench floor and ours compiled this many times in turn",
    )
    ap.add_argument(
        "--max-iters", type=int, default=400, help="at most this many timed calls (--target-s bounds them)"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=480,
        help="after this many seconds, skip transformers compiles of new shapes",
    )
    args = ap.parse_args()
    args.t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.models = ",".join(m if m.startswith("tiny") else f"tiny-{m}" for m in args.models.split(","))
        args.batches, args.target_s, args.max_iters = "2", 0.0, 2
    elif dev.type != "cuda":
        sys.exit("no GPU: run with --smoke on CPU")
    args.batches = sorted(int(b) for b in args.batches.split(","))
    dtype = torch.bfloat16
    ind = torch._inductor.config
    ind.max_autotune_pointwise = False  # autotune GEMMs only, with ATen convolutions: bounded compile time
    ind.coordinate_descent_tuning = False
    if hasattr(ind, "max_autotune_conv_backends"):
        ind.max_autotune_conv_backends = "ATEN"
    ceiling = matmul_ceiling(dev, dtype)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {gpu}; torch {torch.__version__}; matmul ceiling {ceiling / 1e12:.4g} TFLOP/s "
          "(one 8192^3 bf16 GEMM, do_bench median)", flush=True)  # fmt: skip
    rep = Report(dict(device=gpu, torch=torch.__version__, ceiling_flops=ceiling, args=vars(args)))
    for name in args.models.split(","):
        run_model(name, args, dev, dtype, ceiling, rep)
    md = table(rep.rows, ceiling)
    if rep.meta.get("rounds"):
        md += "\n\n" + rounds_table(rep.meta["rounds"])
    wall = time.perf_counter() - args.t_start
    print("\n" + md + f"\n\ntotal wall {wall:.0f}s")
    rep.meta["wall_s"] = wall
    rep.dump(md)
    if rep.path:
        print(f"wrote {rep.path}")


if __name__ == "__main__":
    main()
