"""torchrun worker: the tiny model with the LLM tensor-parallel over gloo; rank 0 saves logits and tokens."""

import sys

import torch
import torch.distributed as dist

from batchvl.engine import Engine, Request, Sampling, packed_meta
from batchvl.llm.kv_cache import KVCache
from batchvl.llm.tp import shard_llm
from batchvl.config import from_preset
from batchvl.model.loader import random_model


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = from_preset("tiny-qwen2")
    cfg.llm.num_heads, cfg.llm.num_kv_heads, cfg.llm.head_dim = 8, 4, 8  # divisible by 2 and 4
    fns = {}
    model, cfg = random_model(cfg, seed=1, prepare=lambda m: fns.update(s=shard_llm(m.llm, rank, world)),
                              shard=lambda n, t: fns["s"](n, t))  # fmt: skip
    assert model.llm.layers[0].attn.n_heads == 8 // world
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 150000, (n,), generator=g) for n in (5, 11, 3)]
    with torch.no_grad():
        pos, meta = packed_meta([len(s) for s in seqs], [0, 0, 0], "cpu")
        logits = model.llm.logits(model.llm(model.llm.embed_tokens(torch.cat(seqs)), pos, meta, None))
        # the last layer for the last tokens only (the engine's default prefill), into a cache
        cache = KVCache(cfg.llm.num_layers, 3, 11, cfg.llm.num_kv_heads // world, cfg.llm.head_dim, "cpu",
                        torch.float32)  # fmt: skip
        last = meta.cu_seqlens[1:].long() - 1
        last_logits = model.llm.logits(model.llm(model.llm.embed_tokens(torch.cat(seqs)), pos, meta, cache, last=last))
    pv = torch.randn(1, 3, 448, 448, generator=g)
    ids = torch.tensor([1, 2, 3] + [cfg.image_token_id] * 256 + [4, 5])
    toks = Engine(model, cfg).run_batch([Request(ids, pv), Request(seqs[1])], Sampling(5, ignore_eos=True))
    if rank == 0:
        torch.save({"logits": logits, "last_logits": last_logits, "tokens": toks.output_ids}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
