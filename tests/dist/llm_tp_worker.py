"""torchrun worker: the tiny model with the LLM tensor-parallel over gloo; rank 0 saves logits and tokens."""

import sys

import torch
import torch.distributed as dist

from batchvl.config import from_preset
from batchvl.engine import Engine, Request, Sampling, packed_meta
from batchvl.llm.kv_cache import KVPool, blocks_for
from batchvl.llm.tp import shard_llm
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
    lengths = [len(s) for s in seqs]
    c = cfg.llm
    pool = KVPool(c.num_layers, 8, c.num_kv_heads // world, c.head_dim, "cpu", torch.float32)
    table = torch.tensor([pool.allocate(blocks_for(n)) for n in lengths], dtype=torch.int32)  # one block each
    with torch.no_grad():
        h = model.llm.embed_tokens(torch.cat(seqs))
        pos, meta = packed_meta(lengths, [0, 0, 0], table)
        logits = model.llm.logits(model.llm(h, pos, meta, None))
        # the last layer for the last tokens only (the engine's prefill), into the pool
        last = meta.cu_seqlens[1:].long() - 1
        last_logits = model.llm.logits(model.llm(h, pos, meta, pool, last=last))
    pv = torch.randn(1, 3, 448, 448, generator=g)
    ids = torch.tensor([1, 2, 3] + [cfg.image_token_id] * 256 + [4, 5])
    greedy = Sampling(5, ignore_eos=True)
    done = Engine(model, cfg, pool_blocks=32).generate(
        [Request(ids, pv, sampling=greedy), Request(seqs[1], sampling=greedy)]
    )
    if rank == 0:
        torch.save(
            {"logits": logits, "last_logits": last_logits, "tokens": [f.output_ids for f in done]}, out
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
