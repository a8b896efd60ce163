"""End-to-end prefill benchmark: the seed job (ShareGPT prompts + tiger.jpeg, 4 new tokens, ignore EOS) through
batchvl's engine without and with caches, and through transformers' generate, on the same random weights.

    python bench/e2e.py --preset internvl2_5-38b --n 500            # on one H200
    python bench/e2e.py --smoke                                     # tiny, CPU, checks the script

Requests are preprocessed before the clock starts (tiling + tokenization is CPU work the runner overlaps with the
GPU); every request counts as submitted at t=0. MFU is against an 8192^3 bf16 matmul measured in this run.
One-time costs stay outside the clock: the ViT buckets are compiled and (since 2026-12-02, session 4) the decode
graphs for the run's batch shapes captured first (session 5: and, where the prefill goes per sequence through
cuDNN, i.e. +cudnn or the default on Hopper, each of the run's attention windows is visited once, building its
plan); transformers gets a warm-up batch.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    hf_sharing_weights,
    llm_linear_params,
    llm_prefill_flops,
    matmul_ceiling,
    request_flops,
    same_tokens,
    sync_time,
    vit_flops_per_tile,
)

from batchvl.engine import Engine, EngineConfig, Request, Sampling  # noqa: E402
from batchvl.model.loader import random_model  # noqa: E402
from batchvl.output import format_summary, summarize  # noqa: E402
from batchvl.preprocess import PreprocessConfig, Preprocessor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN_IMG_CONTEXT = 151667  # <IMG_CONTEXT> of the bundled Qwen tokenizer


def data_dir() -> Path:
    for d in (ROOT / ".data", ROOT.parent / "shared" / "data"):
        if (d / "tiger.jpeg").is_file():
            return d
    raise SystemExit("tiger.jpeg not found in .data/ or ../shared/data/")


def sharegpt_prompts(n: int) -> list[str]:
    rows = json.loads((data_dir() / "ShareGPT_V3_filtered_1000.json").read_text())
    out = []
    for r in rows:
        turns = r.get("conversations") or []
        human = next(
            (t["value"] for t in turns if t.get("from") == "human" and t.get("value", "").strip()), None
        )
        if human:
            out.append(human)
        if len(out) == n:
            break
    return out


def prepare(n: int, max_input_tokens: int, pin: bool = False) -> list:
    """Preprocessed seed rows; `pin`: page-locked tiles, as the runner's Preparer hands them to a CUDA engine."""
    pre = Preprocessor(PreprocessConfig(max_input_tokens=max_input_tokens, overlong="truncate"))
    image = (data_dir() / "tiger.jpeg").read_bytes()
    out = [pre(p, image) for p in sharegpt_prompts(n)]
    if pin:
        for p in out:
            p.pixel_values = p.pixel_values.pin_memory()
    return out


def batches(prepared: list, budget: int) -> list[list[int]]:
    out, cur, tok = [], [], 0
    for i, p in enumerate(prepared):
        n = len(p.input_ids)
        if cur and tok + n > budget:
            out.append(cur)
            cur, tok = [], 0
        cur.append(i)
        tok += n
    return out + ([cur] if cur else [])


def run_engine(
    engine: Engine, prepared: list, budget: int, new_tokens: int, prefetch: bool = False
) -> tuple[float, list[dict]]:
    """The runner's loop (`pipeline.Runner._step`): whole batches; with `overlap_vit`, start batch n's ViT, finish
    batch n-1's decode, then prefill batch n. prefetch (needs `overlap_vit`): start batch n+1's ViT on the side
    stream before batch n's prefill, so the two run concurrently (an experiment, not the runner's loop)."""
    reqs = [Request(torch.tensor(p.input_ids), p.pixel_values, p.image_key) for p in prepared]
    s = Sampling(max_new_tokens=new_tokens, ignore_eos=True)
    rows: list[dict] = []
    t0 = sync_time()

    def finish(bid: int, idx: list[int], tb: float, prefilled) -> None:
        res = engine.decode(prefilled)
        for j, i in enumerate(idx):
            p = prepared[i]
            n = len(res.output_ids[j])
            rows.append(dict(id=str(i), batch_id=bid, num_tiles=p.num_tiles, num_image_tokens=p.num_image_tokens,
                             num_text_tokens=p.num_text_tokens, output_token_ids=res.output_ids[j],
                             vit_ms=res.vit_ms, prefill_ms=res.prefill_ms, decode_ms=res.decode_ms,
                             t_batch_start_s=tb - t0, t_first_token_s=res.first_token_s - t0, t_done_s=res.end_s - t0,
                             ttft_ms=(res.first_token_s - t0) * 1e3, e2e_ms=(res.end_s - t0) * 1e3,
                             tpot_ms=(res.end_s - res.first_token_s) * 1e3 / max(n - 1, 1),
                             cache_hit_image=res.stats["cache_hit_image"][j],
                             cached_prefix_tokens=res.stats["cached_prefix_tokens"][j]))  # fmt: skip

    pending = None
    plan = batches(prepared, budget)
    if prefetch:  # the ViT one batch ahead on the side stream, so it runs under this batch's prefill
        ahead = engine.encode_async([reqs[i] for i in plan[0]]) if plan else None
        for bid, idx in enumerate(plan):
            encoded = ahead
            ahead = engine.encode_async([reqs[i] for i in plan[bid + 1]]) if bid + 1 < len(plan) else None
            tb = time.perf_counter()
            finish(bid, idx, tb, engine.prefill([reqs[i] for i in idx], s, encoded))
        return sync_time() - t0, rows
    for bid, idx in enumerate(plan):
        batch = [reqs[i] for i in idx]
        if not engine.ecfg.overlap_vit:
            tb = time.perf_counter()
            finish(bid, idx, tb, engine.prefill(batch, s))
            continue
        encoded = engine.encode_async(batch)
        if pending is not None:
            finish(*pending)
        tb = time.perf_counter()
        pending = (bid, idx, tb, engine.prefill(batch, s, encoded))
    if pending is not None:
        finish(*pending)
    return sync_time() - t0, rows


def run_hf(hf, prepared: list, batch: int, new_tokens: int, device) -> tuple[float, list[list[int]]]:
    """Seconds for transformers' generate over `prepared` in left-padded batches, and its tokens."""
    outs = []
    t0 = sync_time()
    for i in range(0, len(prepared), batch):
        part = prepared[i : i + batch]
        width = max(len(p.input_ids) for p in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for j, p in enumerate(part):
            ids[j, width - len(p.input_ids) :] = torch.tensor(p.input_ids)
            mask[j, width - len(p.input_ids) :] = 1
        pv = torch.cat([p.pixel_values for p in part]).to(
            device, torch.bfloat16 if device.type == "cuda" else None
        )
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), pixel_values=pv,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        outs += gen[:, width:].tolist()
    return sync_time() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="internvl2_5-38b")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--budget", type=int, default=32768, help="max prefill tokens per batch")
    ap.add_argument(
        "--cache-budget", type=int, default=131072, help="max prompt tokens per batch with caches"
    )
    ap.add_argument("--max-vit-tiles", type=int, default=64)
    ap.add_argument("--hf-n", type=int, default=32)
    ap.add_argument("--hf-batches", default="4,16")
    ap.add_argument(
        "--modes",
        default="nocache,cache,hf",
        help="nocache, cache, hf; -cllm leaves the LLM layers eager; +overlap runs the ViT under the previous decode; "
        "+prefetch runs the next batch's ViT under this batch's prefill; "
        "+cudnn: LLM prefill attention per sequence through cuDNN instead of flash varlen; "
        "-fulllast: the last LLM layer for every token (not only each prompt's last)",
    )
    ap.add_argument("--compile-vit", type=int, default=None, help="1 (default; 0 with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few requests")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if a.smoke:
        a.preset, a.n, a.hf_n, a.hf_batches, a.budget = "tiny-qwen2", 6, 4, "2", 8192
    if a.compile_vit is None:
        a.compile_vit = 0 if a.smoke else 1
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "preset": a.preset, "n": a.n, "budget": a.budget}  # fmt: skip
    print(json.dumps(info), flush=True)
    ceiling = (
        matmul_ceiling()
        if dev.type == "cuda"
        else {"events_b2b": float("nan"), "do_bench_median": float("nan")}
    )
    print("matmul ceiling TFLOP/s", ceiling, flush=True)

    t = time.perf_counter()
    prepared = prepare(a.n, 8192, pin=dev.type == "cuda")
    print(f"preprocessed {len(prepared)} requests in {time.perf_counter() - t:.1f}s; "
          f"tiles {prepared[0].num_tiles}, mean input tokens "
          f"{sum(len(p.input_ids) for p in prepared) / len(prepared):.0f}", flush=True)  # fmt: skip
    t = time.perf_counter()
    model, cfg = random_model(a.preset, dev, dtype, seed=0)
    print(f"random {a.preset} weights drawn on {dev} in {time.perf_counter() - t:.1f}s", flush=True)
    if cfg.image_token_id != QWEN_IMG_CONTEXT:  # InternLM2 vocabulary: same shapes, ids moved into its range
        for p in prepared:
            p.input_ids = [cfg.image_token_id if i == QWEN_IMG_CONTEXT else i % 92000 for i in p.input_ids]
    flops = sum(request_flops(cfg, p.num_tiles, len(p.input_ids), a.new_tokens) for p in prepared)

    def compiled_vit(fp8: bool = False):
        """The runner's ViT: compiled (unless --compile-vit 0), with the engine's defaults (cuDNN attention first);
        fp8: on a copy of the weights with FP8 layer linears. Every tile bucket the timed runs use is compiled
        before the clock."""
        from batchvl.encoder.internvit_compiled import bucket_plan
        from batchvl.runner import vision_encoder

        owner = types.SimpleNamespace(vision=copy.deepcopy(model.vision)) if fp8 else model
        ecfg = EngineConfig(max_vit_tiles=a.max_vit_tiles, vit_fp8=fp8, compile_vit=bool(a.compile_vit))
        fn = vision_encoder(owner, cfg, ecfg, None)
        if not a.compile_vit:
            return fn
        sizes = set()
        for budget in (a.budget, a.cache_budget):
            for idx in batches(prepared, budget):
                t = sum(prepared[i].num_tiles for i in idx)
                for s in range(0, t, a.max_vit_tiles):  # the engine's chunks, each split as the encoder does
                    sizes |= set(bucket_plan(min(a.max_vit_tiles, t - s), fn.buckets))
        # the image cache encodes one image at a time
        sizes |= set(bucket_plan(prepared[0].num_tiles, fn.buckets))
        t = time.perf_counter()
        fn.warmup(sorted(sizes))
        print(f"compiled ViT{' (fp8)' if fp8 else ''} buckets {fn.stats.compile_s} in {time.perf_counter() - t:.0f}s",
              flush=True)  # fmt: skip
        return fn

    encode_fn = compiled_vit() if a.compile_vit else None
    encode_fp8 = compiled_vit(fp8=True) if "+fp8" in a.modes else None
    table, tokens, eng = [], {}, None
    for mode in a.modes.split(","):
        if mode.split("+")[0].split("-")[0] in ("nocache", "cache"):
            cached = mode.startswith("cache")
            ecfg = EngineConfig(max_prefill_tokens=a.budget, max_vit_tiles=a.max_vit_tiles, image_cache=cached,
                                prefix_cache=cached, compile_llm="-cllm" not in mode,
                                overlap_vit="+overlap" in mode or "+prefetch" in mode,
                                attn_backend="cudnn" if "+cudnn" in mode else "varlen" if "+varlen" in mode
                                else "auto", last_layer_last_tokens="-fulllast" not in mode)  # fmt: skip
            budget = a.cache_budget if cached else a.budget
            enc_fn = encode_fp8 if "+fp8" in mode else encode_fn
            eng = Engine(model, cfg, ecfg, dev, dtype, encode_fn=enc_fn)
            warm = prepared[: max(2, len(prepared) // 50)]
            prefetch = "+prefetch" in mode
            run_engine(eng, warm, budget, a.new_tokens, prefetch)  # warm-up / compile
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            eng = Engine(model, cfg, ecfg, dev, dtype, encode_fn=enc_fn)  # fresh caches
            # decode graphs for the run's batch shapes, captured before the clock as the ViT buckets are compiled
            shapes = [
                (len(idx), max(len(prepared[i].input_ids) for i in idx)) for idx in batches(prepared, budget)
            ]
            warm_graphs = eng.warm_decode(shapes, a.new_tokens)
            # per-sequence cuDNN prefill (+cudnn; auto on Hopper): its plans for every window of the run, likewise
            windows = eng.warm_prefill_attention([len(p.input_ids) for p in prepared])
            if windows:
                print(f"cuDNN prefill windows visited before the clock: {windows}", flush=True)
            arena0 = eng.arena.generation
            secs, rows = run_engine(eng, prepared, budget, a.new_tokens, prefetch)
            tokens[mode] = [r["output_token_ids"] for r in rows]
            bf16 = mode.replace("+fp8", "")
            if "+fp8" in mode and bf16 in tokens:  # downstream effect of FP8 ViT features: greedy tokens
                same = same_tokens(tokens[mode], tokens[bf16])
                print(f"greedy tokens batchvl {mode} == batchvl {bf16}: {same}/{sum(map(len, tokens[bf16]))}")
            per_batch = {r["batch_id"]: r for r in rows}.values()
            st = {k: sum(r[k] for r in per_batch) / 1e3 for k in ("vit_ms", "prefill_ms", "decode_ms")}
            tiles = sum(p.num_tiles for p in prepared)
            vit_tf = tiles * vit_flops_per_tile(cfg.vision, cfg.llm.hidden_size) / st["vit_ms"] / 1e12
            llm_tf = (
                sum(llm_prefill_flops(cfg.llm, len(p.input_ids)) for p in prepared) / st["prefill_ms"] / 1e12
            )
            print(f"stages ({len(per_batch)} batches): ViT {st['vit_ms']:.2f}s ({tiles / st['vit_ms']:.1f} tiles/s, "
                  f"{vit_tf:.0f} TFLOP/s uncached-equivalent), prefill {st['prefill_ms']:.2f}s "
                  f"({llm_tf:.0f} TFLOP/s uncached-equivalent), decode {st['decode_ms']:.2f}s, "
                  f"other {secs - sum(st.values()):.2f}s", flush=True)  # fmt: skip
            # one-time costs inside the timed run: decode graphs captured (one per new (rows, length) shape or
            # KV-arena address) and KV-arena growths
            print(f"decode graphs captured before the clock: {warm_graphs}, in the timed run: "
                  f"{eng.decode_step.captures - warm_graphs}; KV arena grown in the timed run: "
                  f"{eng.arena.generation - arena0} times", flush=True)  # fmt: skip
            import pyarrow as pa

            from batchvl.output import ROW_SCHEMA

            summ = summarize(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), duration_s=secs)
            print(f"\n--- batchvl {mode}\n" + format_summary(summ), flush=True)
            table.append(dict(run=f"batchvl {mode}", req_s=len(prepared) / secs,
                              in_tok_s=summ["input_token_throughput"],
                              tflops=flops / secs / 1e12, peak_gib=_peak(dev), secs=secs))  # fmt: skip
            _result_line(table[-1], ceiling)
        elif mode == "hf":
            eng = None  # the last batchvl engine's KV arena, caches and decode graphs go before transformers runs
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            hf = hf_sharing_weights(model, cfg)
            sub = prepared[: a.hf_n]
            sub_flops = sum(request_flops(cfg, p.num_tiles, len(p.input_ids), a.new_tokens) for p in sub)
            for b in (int(x) for x in a.hf_batches.split(",")):
                run_hf(hf, sub[:b], b, a.new_tokens, dev)  # warm-up
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                secs, hf_tokens = run_hf(hf, sub, b, a.new_tokens, dev)
                for mine, toks in tokens.items():
                    same = same_tokens(toks, hf_tokens)
                    print(
                        f"greedy tokens batchvl {mine} == transformers b={b}: {same}/{len(hf_tokens) * a.new_tokens}"
                    )
                in_tok = sum(len(p.input_ids) for p in sub)
                table.append(dict(run=f"transformers generate b={b}", req_s=len(sub) / secs, in_tok_s=in_tok / secs,
                                  tflops=sub_flops / secs / 1e12, peak_gib=_peak(dev), secs=secs))  # fmt: skip
                _result_line(table[-1], ceiling)
            del hf
    best_hf = max((r["req_s"] for r in table if r["run"].startswith("transformers")), default=float("nan"))
    ceil = ceiling["events_b2b"]
    print(f"\nMFU vs {ceil:.0f} TFLOP/s (8192^3 bf16, CUDA events back-to-back); "
          f"do_bench median ceiling {ceiling['do_bench_median']:.0f}")  # fmt: skip
    c = cfg.llm
    skipped = (c.num_heads * c.head_dim * c.hidden_size * 2 + 3 * c.hidden_size * c.intermediate_size) / (
        llm_linear_params(c)
    )  # the last layer's q, o_proj and MLP, per non-last token
    print(f"TFLOP/s and MFU count every run's full model FLOPs; batchvl's default last_layer_last_tokens skips "
          f"{skipped:.1%} of the LLM's linear FLOPs (the last layer's q, o_proj and MLP for all but the last tokens)")  # fmt: skip
    print("| run | req/s | input tok/s | TFLOP/s | MFU | x transformers best | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['run']} | {r['req_s']:.3f} | {r['in_tok_s']:.0f} | {r['tflops']:.0f} | "
              f"{r['tflops'] / ceil:.3f} | {r['req_s'] / best_hf:.3f} | {r['peak_gib']:.1f} |")  # fmt: skip
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "e2e.json").write_text(
            json.dumps({"info": info, "ceiling": ceiling, "rows": table})
        )


def _result_line(r: dict, ceiling: dict) -> None:
    """One line per run as soon as it ends (the final table needs every run; a timeout would lose it)."""
    print(f"RESULT {r['run']}: {r['req_s']:.3f} req/s, {r['in_tok_s']:.0f} input tok/s, {r['tflops']:.0f} TFLOP/s, "
          f"MFU {r['tflops'] / ceiling['events_b2b']:.3f}, peak {r['peak_gib']:.1f} GiB, {r['secs']:.1f} s", flush=True)  # fmt: skip


def _peak(dev) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")


if __name__ == "__main__":
    main()
