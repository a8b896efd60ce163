"""Where does LLM time go? One packed prefill (16 seed-sized sequences) and 3 decode steps at real widths with
few layers, under torch.profiler; plus micro-timings of the KV-cache write and the decode attention.

    python bench/profile_llm.py --layers 8
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from batchvl.encoder.internvit_compiled import sdpa_context
from batchvl.engine import Engine, EngineConfig, Request, Sampling
from batchvl.llm.attention import AttnMeta, prefill_varlen
from batchvl.llm.decode_attention import decode_attention
from batchvl.model.config import from_preset
from batchvl.model.loader import random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="internvl2_5-38b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--compile-llm", type=int, default=0)
    a = ap.parse_args()
    cfg = from_preset(a.preset)
    cfg = replace(cfg, vision=replace(cfg.vision, num_layers=2), llm=replace(cfg.llm, num_layers=a.layers))
    dev, dt = torch.device("cuda"), torch.bfloat16
    model, cfg = random_model(cfg, dev, dt, seed=0)
    g = torch.Generator().manual_seed(0)
    top = min(150000, cfg.image_token_id)  # text tokens only, inside the vocabulary (8B: 92553)
    reqs = [Request(torch.randint(0, top, (2000,), generator=g)) for _ in range(a.batch)]
    eng = Engine(model, cfg, EngineConfig(compile_llm=bool(a.compile_llm)), dev, dt)
    s = Sampling(max_new_tokens=4, ignore_eos=True)
    for i in range(3):
        r = eng.run_batch(reqs[: a.batch - i], s)  # three shapes: compile for a dynamic token count
    print(f"prefill {r.prefill_ms:.1f} ms, decode (3 steps) {r.decode_ms:.1f} ms for {a.layers} layers")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as p:
        eng.run_batch(reqs, s)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
    r = eng.run_batch(reqs, s)
    print(f"again: prefill {r.prefill_ms:.1f} ms, decode (3 steps) {r.decode_ms:.1f} ms")
    # micro: cache write and decode attention, one layer
    c = cfg.llm
    kc = torch.randn(a.batch, c.num_kv_heads, 2004, c.head_dim, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    rows = torch.arange(a.batch, device=dev)
    pos = torch.full((a.batch,), 2000, device=dev)
    k = torch.randn(a.batch, c.num_kv_heads, c.head_dim, device=dev, dtype=dt)

    def write():
        kc[rows, :, pos] = k

    q = torch.randn(a.batch, c.num_heads, c.head_dim, device=dev, dtype=dt)
    lens = pos + 1
    print(f"decode cache write: {do_bench(write) * 1e3:.1f} us; "
          f"decode attention: {do_bench(lambda: decode_attention(q, kc, vc, lens)) * 1e3:.1f} us per layer")  # fmt: skip
    prefill_attention(a.batch, c, dev, dt)


def prefill_attention(batch: int, c, dev, dt) -> None:
    """One layer's causal prefill attention over `batch` sequences of 2000 - 17 i tokens: flash varlen (ours)
    against one SDPA call per sequence with each backend (GQA by SDPA's enable_gqa or by repeating kv heads)."""
    lens = [2000 - 17 * i for i in range(batch)]
    cu = torch.tensor([0, *itertools.accumulate(lens)], device=dev, dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, c.num_heads, c.head_dim, device=dev, dtype=dt)
    k, v = (torch.randn(T, c.num_kv_heads, c.head_dim, device=dev, dtype=dt) for _ in range(2))
    meta = AttnMeta(cu, max(lens), torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long))
    flops = sum(2 * n * n * c.num_heads * c.head_dim for n in lens)  # causal: half of 4 n^2 H D
    ref = prefill_varlen(q, k, v, meta)
    rep = c.num_heads // c.num_kv_heads
    bounds = list(itertools.pairwise(cu.tolist()))

    def per_seq(gqa: bool):
        outs = []
        for s_, e in bounds:
            qs, ks, vs = (t[s_:e].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, D]
            if not gqa:
                ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
            outs.append(
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)[0].transpose(0, 1)
            )
        return torch.cat(outs)

    print(f"\nprefill attention, {batch} sequences, {T} tokens, {c.num_heads}/{c.num_kv_heads} heads:")
    ms = do_bench(lambda: prefill_varlen(q, k, v, meta))
    print(f"  flash varlen (ours): {ms:.3f} ms = {flops / ms / 1e9:.0f} TFLOP/s")
    for backend in ("cudnn", "flash", "efficient"):
        for gqa in (True, False):
            try:
                with sdpa_context(backend, dev):
                    err = float((per_seq(gqa).float() - ref.float()).norm() / ref.float().norm())
                    ms = do_bench(lambda gqa=gqa: per_seq(gqa))
                print(f"  SDPA {backend} per sequence, gqa={'enable_gqa' if gqa else 'repeat'}: {ms:.3f} ms = "
                      f"{flops / ms / 1e9:.0f} TFLOP/s, rel diff vs varlen {err:.1e}")  # fmt: skip
            except RuntimeError as e:
                print(f"  SDPA {backend} gqa={gqa}: unavailable ({str(e).splitlines()[0][:80]})")


if __name__ == "__main__":
    main()
