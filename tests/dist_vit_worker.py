"""Worker for the multi-process ViT tests: TP (1, 2, 3 micro-batches; hooks; compiled stages) and DP on gloo,
results to files."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from batchvl.config import InternVLConfig, LLMConfig, VisionConfig
from batchvl.encoder.internvit import VisionEncoder
from batchvl.encoder.split_overlap import DPVisionEncoder, TPVisionEncoder

KINDS = {
    "6b": dict(norm_type="rms_norm", qk_normalization=True, qkv_bias=False),
    "300m": dict(norm_type="layer_norm", qk_normalization=False, qkv_bias=True),
}


def tp_cfg(kind: str) -> InternVLConfig:
    """5 heads (uneven over 2 and 4 ranks, like 25 heads), MLP width 150 (uneven over 4), 8x8 patch grid."""
    vision = VisionConfig(hidden_size=80, num_layers=2, num_heads=5, intermediate_size=150, image_size=112,
                          **KINDS[kind])  # fmt: skip
    llm = LLMConfig(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=128
    )
    return InternVLConfig(vision=vision, llm=llm)


def make_inputs(d: Path, seed: int = 0) -> None:
    """Random non-trivial weights per kind and pixel batches, saved for the workers."""
    g = torch.Generator().manual_seed(seed)
    for kind in KINDS:
        enc = VisionEncoder(tp_cfg(kind))
        with torch.no_grad():
            for name, p in enc.named_parameters():
                r = torch.randn(p.shape, generator=g)
                one = name.endswith(("ls1", "ls2")) or (
                    p.ndim == 1 and "norm" in name and name.endswith("weight")
                )
                p.copy_(1.0 + 0.2 * r if one else r / max(p.shape[-1], 1) ** 0.5 if p.ndim > 1 else 0.1 * r)
        torch.save(enc.state_dict(), d / f"{kind}.pt")
    for n in (7, 3):
        torch.save(torch.randn(n, 3, 112, 112, generator=g), d / f"px{n}.pt")


def run_group(d: Path, group: dist.ProcessGroup | None, compiled: bool) -> dict[str, torch.Tensor]:
    """Every check for one process group (this rank is a member); the compiled TP stages too if `compiled`."""
    res: dict[str, torch.Tensor] = {}
    for kind in KINDS:
        sd = torch.load(d / f"{kind}.pt")
        enc = VisionEncoder(tp_cfg(kind)).eval()
        enc.load_state_dict(sd)
        for n in (7, 3):
            res[f"{kind}/dp{n}"] = DPVisionEncoder(enc, group)(torch.load(d / f"px{n}.pt"))
        px = torch.load(d / "px7.pt")
        tp = TPVisionEncoder(enc, group, micro_batches=1)
        for mb in (1, 2, 3):
            tp.micro_batches = mb
            res[f"{kind}/tp_mb{mb}"] = tp(px)
        # the stages compiled, as the builder runs TP unless eager; 6 tiles: two micro-batches of 3
        if compiled:
            res[f"{kind}/tp_compiled"] = TPVisionEncoder(enc, group, micro_batches=2, compile=True)(px[:6])
        with torch.no_grad():
            res[f"{kind}/tp_hooks"] = enc(px)  # sharded modules, plain forward: all-reduce in hooks
        res[f"{kind}/qkv_rows"] = torch.tensor(enc.vit.layers[0].attn.qkv.weight.shape[0])
    return res


def worker(rank: int, world: int, port: int, d: str) -> None:
    """Runs on every rank; for each group size g in (2, world), ranks < g write out_<g>_<rank>.pt. The compiled TP
    stages run in the 2-rank group only (a compile per rank and shard shape is the slow part on CPU)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for g in sorted({min(2, world), world}):
            group = dist.new_group(list(range(g))) if g < world else None  # every rank must create it
            if rank < g:
                torch.save(run_group(Path(d), group, compiled=g == 2), Path(d) / f"out_{g}_{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    """python tests/dist_vit_worker.py DIR [WORLD] [PORT]: make inputs and run the workers by hand."""
    import torch.multiprocessing as mp

    out = Path(sys.argv[1])
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    out.mkdir(parents=True, exist_ok=True)
    make_inputs(out)
    mp.spawn(worker, args=(world, int(sys.argv[3]) if len(sys.argv) > 3 else 29511, str(out)), nprocs=world)


if __name__ == "__main__":
    main()
