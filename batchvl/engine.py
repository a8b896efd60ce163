"""The engine: sequences in flight over a paged KV pool, admitted a batch at a time and decoded together.

`admit(requests)` runs a batch's ViT (with an optional image-embedding cache) and packed prefill (with an optional
shared-prefix cache whose pool blocks the sequences share) and samples each sequence's first token; `step()` decodes
one token for every sequence in flight. A sequence retires on a stop token or its own `max_new_tokens` and comes back
as `Finished` at once; its blocks go back to the pool. The scheduler (`batchvl/scheduler.py`) decides when to admit and
when to step. The engine takes a model ready to serve (`model.build.build_model`) and never changes it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from batchvl.config import InternVLConfig
from batchvl.job import EngineSpec
from batchvl.llm.decode_step import DecodeStep, row_bucket
from batchvl.llm.kv_cache import KVPool, blocks_for
from batchvl.llm.sampling import row_seed, sample_rows
from batchvl.model.internvl import InternVL
from batchvl.model.memory import MIN_PREFILL_TOKENS, activation_bytes
from batchvl.ops.decode_attention import BLOCK
from batchvl.ops.fp8 import Fp8Linear
from batchvl.ops.prefill_attention import PER_SEQ_MIN_MEAN, AttnMeta, CascadePrefix, prefill_backend
from batchvl.preprocess import pixel_input

log = logging.getLogger(__name__)
IMAGE_CACHE_ENTRIES = 64  # images' features kept by the image cache
PREFIX_CACHE_ENTRIES = 64  # prefixes whose pool blocks the prefix cache keeps
MAX_ROWS = 512  # sequences in flight at most (the largest decode graph)
CPU_POOL_BYTES = 1 << 30  # the KV pool off CUDA
WARM_PARTS = ("vit", "prefill", "decode_graphs")  # what `Engine.warm_up` compiles or captures, in order


@dataclass
class Sampling:
    max_new_tokens: int = 4
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Request:
    """One prepared row: token ids with <IMG_CONTEXT> placeholders, its tiles and its own generation settings."""

    input_ids: torch.Tensor  # [L] int64, CPU
    # CPU: raw uint8 tiles [tiles, S, S, 3] (normalized on the device) or normalized float tiles [tiles, 3, S, S]
    pixel_values: torch.Tensor | None = None
    image_key: str | None = None  # content hash of the image(s) + tiling, for the caches
    sampling: Sampling = field(default_factory=Sampling)
    handle: Any = None  # the caller's, given back in `Finished`
    # (content key, tiles) of each image, in order, when pixel_values holds several or was not sent (every image in
    # the image cache); empty: one image, image_key
    images: tuple[tuple[str | None, int], ...] = ()
    seed: int | None = None  # its own random stream (`sampling.row_seed`); None: one derived from its prompt
    # (prefix cache key or None, tokens a hit reuses): hashed once, by the engine that first asks (Engine._prefix)
    prefix: tuple[str | None, int] | None = field(default=None, init=False, repr=False, compare=False)

    def image_units(self) -> list[tuple[str | None, int, int]]:
        """(content key, first tile, tiles) of each image in pixel_values (or of `images` alone, when their tiles were
        not sent: the image cache holds them): what the image cache holds."""
        if self.pixel_values is None and not self.images:
            return []
        if not self.images:
            return [(self.image_key, 0, int(self.pixel_values.shape[0]))]
        starts = [0]
        for _, n in self.images:
            starts.append(starts[-1] + n)
        return [(key, start, n) for (key, n), start in zip(self.images, starts, strict=False)]


@dataclass
class Finished:
    handle: Any
    output_ids: list[int]
    vit_ms: float  # its batch's ViT + projector (CUDA events on GPU)
    prefill_ms: float  # its batch's prefill and first tokens
    decode_ms: float  # the decode steps it took part in
    first_token_s: float  # time.perf_counter() when its first token was on the host
    done_s: float  # ... and its last
    cache_hit_image: bool
    cached_prefix_tokens: int
    finish_reason: str = "length"  # or "stop": it ended on EOS or a stop token (the last of output_ids)


@dataclass
class _Seq:
    """A sequence in flight: its blocks, the tokens in the pool and the ones it generated."""

    req: Request
    row: int  # its row of the block table
    blocks: list[int]
    length: int  # tokens whose k / v are in the pool
    out: list[int]
    stops: set[int]
    timing: dict
    seed: int = 0  # its random stream
    decode_ms: float = 0.0


class _Timer:
    """Elapsed ms of a region: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3

    def elapsed(self) -> float:
        if self.cuda:
            self.b.synchronize()
            return self.a.elapsed_time(self.b)
        return self.ms


class Engine:
    def __init__(
        self,
        model: InternVL,
        cfg: InternVLConfig,
        settings: EngineSpec | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        eos_token_ids: tuple[int, ...] = (),
        encode_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        max_seq_len: int = 32768,
        pool_blocks: int | None = None,
        seed: int = 0,
    ):
        self.model, self.cfg, self.settings = model, cfg, settings or EngineSpec()
        self.device, self.dtype = torch.device(device), dtype
        self.eos = tuple(eos_token_ids)
        self.encode_fn = encode_fn or model.vision  # [tiles,3,S,S] -> [tiles, 256, hidden]
        self.image_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        # prefix key -> (its full blocks, the image features of its image tokens past them)
        self.prefix_cache: OrderedDict[str, tuple[list[int], torch.Tensor | None]] = OrderedDict()
        self.counters = {"image_cache_hits": 0, "prefix_cache_hits": 0, "prefix_tokens_reused": 0,
                         "decode_steps": 0, "decode_rows": 0}  # fmt: skip
        attn = model.llm.layers[0].attn  # this rank's heads, under tensor parallelism
        self.all_heads = attn.n_heads == cfg.llm.num_heads
        self.width = blocks_for(max_seq_len)  # block-table columns: the longest sequence
        self.max_prefill_tokens = self.settings.max_prefill_tokens or self._auto_prefill_tokens()
        c = cfg.llm
        per_block = KVPool.bytes_per_block(c.num_layers, attn.n_kv, c.head_dim, dtype)
        if pool_blocks is None:
            pool_blocks = self._auto_pool_bytes() // per_block
        self.pool = KVPool(c.num_layers, pool_blocks, attn.n_kv, c.head_dim, self.device, dtype)
        log.info("KV pool %d blocks (%d tokens, %.1f GiB); prefill budget %d tokens", pool_blocks,
                 pool_blocks * BLOCK, pool_blocks * per_block / 2**30, self.max_prefill_tokens)  # fmt: skip
        self.max_rows = MAX_ROWS
        self.tables = torch.zeros(self.max_rows, self.width, dtype=torch.int32, device=self.device)
        self.rows: list[_Seq | None] = [None] * self.max_rows
        self.decode_step = DecodeStep(
            model.llm, graphs=not self.settings.eager and self.device.type == "cuda"
        )
        self.seed = seed  # the random streams of requests without their own

    # ---- memory ------------------------------------------------------------------------------------------------
    def activation_bytes(self, prefill_tokens: int | None = None) -> int:
        """Rough peak of one prefill batch of `prefill_tokens` (default: the engine's budget) or one ViT call."""
        fp8 = isinstance(self.model.llm.layers[0].mlp.down, Fp8Linear)
        return activation_bytes(self.cfg, self.dtype, prefill_tokens or self.max_prefill_tokens,
                                self.settings.max_vit_tiles, "fp8" if fp8 else "none")  # fmt: skip

    def _auto_prefill_tokens(self) -> int:
        """The prefill budget when the job leaves it to batchvl: 32768 tokens, less where their activations would take
        more than a quarter of the free memory (16384 off CUDA)."""
        if self.device.type != "cuda":
            return 16384
        free, _ = torch.cuda.mem_get_info(self.device)
        return next(
            (n for n in (32768, 16384, 8192) if self.activation_bytes(n) <= free // 4), MIN_PREFILL_TOKENS
        )

    def _auto_pool_bytes(self) -> int:
        """What the pool may take: off CUDA a fixed size; on CUDA 90% of the free memory less the activations."""
        if self.device.type != "cuda":
            return CPU_POOL_BYTES
        free, _ = torch.cuda.mem_get_info(self.device)
        room = int(0.9 * free) - self.activation_bytes()
        if room <= 0:
            raise MemoryError(
                f"a batch of engine.max_prefill_tokens={self.max_prefill_tokens} needs about "
                f"{self.activation_bytes() / 2**30:.1f} GiB of activations but {free / 2**30:.1f} GiB is free after "
                f"loading the model; lower engine.max_prefill_tokens"
            )
        return room

    # ---- what admitting a request costs ---------------------------------------------------------------------
    def _prefix(self, r: Request) -> tuple[str | None, int]:
        """(prefix cache key or None, tokens a hit would reuse: the prefix's full blocks); hashed once per request,
        though each scheduling pass asks several times."""
        if not self.settings.prefix_cache:
            return None, 0
        if r.prefix is None:
            r.prefix = self._prefix_key(r)
        return r.prefix

    def _prefix_key(self, r: Request) -> tuple[str | None, int]:
        if r.image_units() and r.image_key is None:
            return None, 0  # (an image without a content key cannot be told apart from another)
        where = (r.input_ids == self.cfg.image_token_id).nonzero()
        p = int(where[-1]) + 1 if len(where) else 0  # system prompt + user header + image
        full = p // BLOCK * BLOCK
        if full == 0 or p >= r.input_ids.shape[0]:
            return None, 0
        digest = r.input_ids[:p].numpy().tobytes() + (r.image_key or "").encode()
        return hashlib.blake2b(digest, digest_size=16).hexdigest(), full

    def prefix_hit(self, r: Request) -> str | None:
        """The key of the cached prefix r would read, or None."""
        key, _ = self._prefix(r)
        return key if key in self.prefix_cache else None

    def cached_tokens(self, r: Request) -> int:
        """Prompt tokens a prefix-cache hit would spare."""
        return self._prefix(r)[1] if self.prefix_hit(r) else 0

    def spare_prefix_blocks(self) -> dict[str, int]:
        """Blocks of each cached prefix that no sequence reads now: admission takes them back when the pool is
        short (oldest first), so they count as free."""
        refs = self.pool.refs
        return {k: len(b) for k, (b, _) in self.prefix_cache.items() if all(refs[x] == 1 for x in b)}

    def _make_room(self, need: int, keep: set[str]) -> None:
        """Give back the blocks of the least recently used prefixes that only the cache holds, none in `keep`,
        until `need` blocks are free."""
        for key in self.spare_prefix_blocks():
            if self.pool.free >= need:
                return
            if key not in keep:
                self.pool.release(self.prefix_cache.pop(key)[0])

    def needs_vit(self, r: Request) -> bool:
        """Whether admitting r runs its tiles through the ViT (not when either cache has what it needs)."""
        units = r.image_units()
        if not units:
            return False
        if self.settings.image_cache and all(k in self.image_cache for k, _, _ in units):
            return False
        return self.cached_tokens(r) == 0

    def cached_images(self) -> frozenset[str]:
        """Keys of the images whose features the image cache holds: rows with only these need not send tiles."""
        return frozenset(self.image_cache) if self.settings.image_cache else frozenset()

    def check_positions(self, r: Request) -> None:
        """ValueError when r would reach a position the LLM's RoPE does not serve (see `check_position`): that row
        alone fails, at admission, not every row in flight at the step that reaches it."""
        n, m = r.input_ids.shape[0], r.sampling.max_new_tokens
        top = self.model.llm.rotary.max_pos
        if top is not None and n + m - 2 >= top:  # the last new token is never fed back
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({m}) pass max_position_embeddings={top}")

    def blocks_needed(self, r: Request) -> int:
        """Pool blocks r takes for its prompt and all its new tokens, less the prefix blocks it would share."""
        total = blocks_for(r.input_ids.shape[0] + r.sampling.max_new_tokens)
        return total - self.cached_tokens(r) // BLOCK

    def free_rows(self) -> int:
        return sum(s is None for s in self.rows)

    @property
    def active(self) -> int:
        return self.max_rows - self.free_rows()

    # ---- ViT ---------------------------------------------------------------------------------------------------
    def _encode_tiles(self, tiles: list[torch.Tensor]) -> torch.Tensor:
        """Tiles of several requests (CPU) -> [N, 256, hidden] on device, in chunks of max_vit_tiles. Raw uint8 tiles
        cross to the device as they are (a quarter of float32's bytes) and are normalized there."""
        px = torch.cat([pixel_input(t.to(self.device, non_blocking=True), self.dtype) for t in tiles])
        step = self.settings.max_vit_tiles
        return torch.cat([self.encode_fn(px[i : i + step]) for i in range(0, px.shape[0], step)])

    def encode(
        self, requests: list[Request], skip: list[bool]
    ) -> tuple[list[torch.Tensor | None], list[bool]]:
        """Image features per request, [tiles*256, hidden] or None (none, or `skip`); and whether all its images came
        from the image cache (or an earlier image of this batch with the same key). Each image is cached on its own."""
        use_cache = self.settings.image_cache
        hits = [False] * len(requests)
        keys: list[list[str]] = [[] for _ in requests]  # each request's images
        found: dict[str, torch.Tensor] = {}  # features of this batch's images, cached or encoded
        todo: dict[str, torch.Tensor] = {}  # key -> the tiles to encode
        for i, r in enumerate(requests):
            units = [] if skip[i] else r.image_units()
            if not units:
                continue
            hits[i] = True
            for j, (key, start, n) in enumerate(units):
                k = key if (use_cache and key) else f"#{i}.{j}"
                keys[i].append(k)
                if k in found or k in todo:  # the same image earlier in this batch: encoded once
                    self.counters["image_cache_hits"] += 1
                elif use_cache and k in self.image_cache:
                    self.image_cache.move_to_end(k)
                    found[k] = self.image_cache[k]
                    self.counters["image_cache_hits"] += 1
                elif r.pixel_values is None:
                    raise ValueError(f"image {key} is not in the image cache and its tiles were not sent")
                else:
                    todo[k] = r.pixel_values[start : start + n]
                    hits[i] = False
        if todo:
            enc = self._encode_tiles(list(todo.values()))
            start = 0
            for k, t in todo.items():
                f = enc[start : start + t.shape[0]].reshape(-1, enc.shape[-1])
                start += t.shape[0]
                found[k] = f
                if use_cache and not k.startswith("#"):
                    self.image_cache[k] = f.clone()  # not a view: it would keep the batch's features alive
                    while len(self.image_cache) > IMAGE_CACHE_ENTRIES:
                        self.image_cache.popitem(last=False)
        feats = [None if not ks else found[ks[0]] if len(ks) == 1 else torch.cat([found[k] for k in ks])
                 for ks in keys]  # fmt: skip
        return feats, hits

    # ---- admission: ViT, packed prefill into the pool, first tokens ------------------------------------------
    @torch.inference_mode()
    def admit(self, requests: list[Request], logits_out: list | None = None) -> list[Finished]:
        """Prefill `requests` into the pool and sample their first tokens; returns those already finished. Raises
        (taking nothing from the pool) when they do not fit or the model fails. logits_out: gets the last-token logits
        [B, V] (for parity checks)."""
        for r in requests:
            self.check_positions(r)
        need = sum(map(self.blocks_needed, requests))
        self._make_room(need, keep={k for k in map(self.prefix_hit, requests) if k})
        if len(requests) > self.free_rows() or need > self.pool.free:
            raise MemoryError(f"{len(requests)} requests do not fit in the engine's free rows and KV blocks")
        dev = self.device
        prefixes = [self._prefix(r) for r in requests]
        hit = [k is not None and k in self.prefix_cache for k, _ in prefixes]
        # rows that hit a cached prefix first, those sharing one side by side: their queries read it together
        group = {k: i for i, (k, _) in reversed(list(enumerate(prefixes)))}  # each prefix's first row
        order = sorted(
            range(len(requests)), key=lambda i: (not hit[i], group[prefixes[i][0]] if hit[i] else 0)
        )
        requests, prefixes, hit = ([x[i] for i in order] for x in (requests, prefixes, hit))
        seqs: list[_Seq] = []
        try:
            with _Timer(dev) as t_vit:
                feats, img_hits = self.encode(requests, skip=hit)
            with _Timer(dev) as t_pre:
                ids, new_feats, shared = [], [], []
                for r, (key, full), h, f in zip(requests, prefixes, hit, feats, strict=True):
                    reused, tail = self.prefix_cache[key] if h else ([], None)
                    if h:
                        self.prefix_cache.move_to_end(key)
                        self.pool.retain(reused)
                        self.counters["prefix_cache_hits"] += 1
                        self.counters["prefix_tokens_reused"] += full
                        f = tail
                    own = self.pool.allocate(blocks_for(r.input_ids.shape[0] + r.sampling.max_new_tokens)
                                             - len(reused))  # fmt: skip
                    row = self.rows.index(None)
                    s = _Seq(r, row, reused + own, r.input_ids.shape[0], [], self._stops(r.sampling), {},
                             self._seed(r))  # fmt: skip
                    self.rows[row] = s
                    seqs.append(s)
                    self.tables[row, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
                    p = full if h else 0
                    ids.append(r.input_ids[p:])
                    new_feats.append(f)
                    shared.append(p)
                groups = [group[k] if h else -1 for (k, _), h in zip(prefixes, hit, strict=True)]
                logits = self._prefill(ids, new_feats, shared, [s.row for s in seqs], groups)
                if logits_out is not None:  # in the order asked
                    logits_out.append(logits[torch.tensor(order).argsort().to(logits.device)])
                first = sample_rows(logits, [r.sampling for r in requests], [s.seed for s in seqs],
                                    [0] * len(seqs)).tolist()  # fmt: skip
            first_s = time.perf_counter()
            if self.settings.prefix_cache:
                self._remember_prefixes(requests, prefixes, hit, feats, seqs)
        except BaseException:
            for s in seqs:
                self._free(s)
            raise
        vit_ms, prefill_ms = t_vit.elapsed(), t_pre.elapsed()
        done = []
        for s, t, h, p in zip(seqs, first, img_hits, shared, strict=True):
            s.timing = dict(
                vit_ms=vit_ms, prefill_ms=prefill_ms, first_token_s=first_s, hit=h or p > 0, cached=p
            )
            if self._append(s, t):
                done.append(self._retire(s, first_s))
        return done

    def _prefill(
        self, ids: list[torch.Tensor], feats: list, prefix_lens: list[int], rows: list[int], groups: list[int]
    ) -> torch.Tensor:
        """Packed prefill of the new tokens `ids[i]` after `prefix_lens[i]` already in the pool, into table rows
        `rows` (`groups`: see `packed_meta`); returns each sequence's last-token logits [B, V]."""
        llm, dev = self.model.llm, self.device
        lengths = [int(t.shape[0]) for t in ids]
        flat = torch.cat(ids).to(dev, non_blocking=True)
        img = [f for f in feats if f is not None]
        h = self.model.embed(flat, torch.cat(img, 0) if img else None)
        backend = prefill_backend(dev, self.dtype)
        rows_t = torch.tensor(rows, device=dev)
        top = max(p + n for p, n in zip(prefix_lens, lengths, strict=True)) - 1
        table = self.tables[rows_t, : blocks_for(top + 1)]
        pos, meta = packed_meta(lengths, prefix_lens, table, backend, self.all_heads, groups)
        # each sequence's last token alone through the last layer's attention output and MLP, and lm_head
        last = meta.cu_seqlens[1:].long() - 1
        return llm.logits(llm(h, pos, meta, self.pool, max_position=top, last=last))

    def _remember_prefixes(self, requests, prefixes, hit, feats, seqs) -> None:
        """Keep the full prefix blocks of each new prefix (and the features of its image tokens past them)."""
        for r, (key, full), h, f, s in zip(requests, prefixes, hit, feats, seqs, strict=True):
            if key is None or h or key in self.prefix_cache:
                continue
            before = int((r.input_ids[:full] == self.cfg.image_token_id).sum())
            tail = f[before:].clone() if f is not None and before < f.shape[0] else None
            blocks = s.blocks[: full // BLOCK]
            self.pool.retain(blocks)
            self.prefix_cache[key] = (blocks, tail)
            while len(self.prefix_cache) > PREFIX_CACHE_ENTRIES:
                self.pool.release(self.prefix_cache.popitem(last=False)[1][0])

    # ---- decode ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """One token for every sequence in flight; returns those that finished."""
        live = [s for s in self.rows if s is not None]
        if not live:
            return []
        t0 = time.perf_counter()
        top = max(s.row for s in live) + 1
        if row_bucket(top) > row_bucket(len(live)):
            top = self._compact(live)
        R = min(row_bucket(top), self.max_rows) if self.decode_step.graphs else top
        tok, pos = [0] * R, [0] * R  # rows without a sequence write block 0 (scratch)
        for s in live:
            tok[s.row], pos[s.row] = s.out[-1], s.length
        self.model.llm.check_position(max(pos))
        dev = self.device
        # a graph keeps the table's full width; eager steps read only the columns in use
        table = self.tables[:R] if self.decode_step.graphs else self.tables[:R, : blocks_for(max(pos) + 1)]
        logits = self.decode_step(
            torch.tensor(tok, device=dev), torch.tensor(pos, device=dev), table, self.pool
        )
        rows = torch.tensor([s.row for s in live], device=dev)
        new = sample_rows(logits[rows], [s.req.sampling for s in live], [s.seed for s in live],
                          [len(s.out) for s in live]).tolist()  # fmt: skip
        now = time.perf_counter()
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(live)
        done = []
        for s, t in zip(live, new, strict=True):
            s.length += 1
            s.decode_ms += (now - t0) * 1e3
            if self._append(s, t):
                done.append(self._retire(s, now))
        return done

    def _compact(self, live: list[_Seq]) -> int:
        """Move the sequences above row len(live) into the free rows below it, each with its block-table row (its KV
        stays where it is), so that a step decodes as many rows as are live, not as the highest one's index; returns
        len(live)."""
        n = len(live)
        free = [i for i in range(n) if self.rows[i] is None]
        moved = [s for s in live if s.row >= n]  # as many as `free`
        old = torch.tensor([s.row for s in moved], device=self.device)
        new = torch.tensor(free, device=self.device)
        self.tables[new] = self.tables[old]
        self.tables[old] = 0  # a free row writes block 0 (scratch)
        for s, row in zip(moved, free, strict=True):
            self.rows[row], self.rows[s.row] = s, None
            s.row = row
        return n

    def abort(self) -> list[Any]:
        """Drop every sequence in flight (after a failed step); returns their handles."""
        handles = [s.req.handle for s in self.rows if s is not None]
        for s in self.rows:
            if s is not None:
                self._free(s)
        return handles

    def _seed(self, r: Request) -> int:
        if r.seed is not None:
            return r.seed
        return row_seed(self.seed, hashlib.blake2b(r.input_ids.numpy().tobytes(), digest_size=16).hexdigest())

    def _stops(self, s: Sampling) -> set[int]:
        return set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.eos))

    @staticmethod
    def _append(s: _Seq, t: int) -> bool:
        """Add token t; whether the sequence is done."""
        s.out.append(t)
        return t in s.stops or len(s.out) >= s.req.sampling.max_new_tokens

    def _retire(self, s: _Seq, now: float) -> Finished:
        self._free(s)
        t = s.timing
        why = "stop" if s.out[-1] in s.stops else "length"
        return Finished(s.req.handle, s.out, t["vit_ms"], t["prefill_ms"], s.decode_ms, t["first_token_s"], now,
                        t["hit"], t["cached"], why)  # fmt: skip

    def _free(self, s: _Seq) -> None:
        self.pool.release(s.blocks)
        self.tables[s.row].zero_()
        self.rows[s.row] = None

    def generate(self, requests: list[Request]) -> list[Finished]:
        """Admit `requests` together and decode until all are done; their results in request order (the
        synchronous use, for tests and benchmarks; a job goes through the scheduler)."""
        order = {id(r): i for i, r in enumerate(requests)}
        handles = [r.handle for r in requests]
        for r in requests:
            r.handle = id(r)
        try:
            done = self.admit(requests)
            while self.active:
                done += self.step()
        finally:
            for r, h in zip(requests, handles, strict=True):
                r.handle = h
        done.sort(key=lambda f: order[f.handle])
        for f, h in zip(done, handles, strict=True):
            f.handle = h
        return done

    def prefill_logits(self, requests: list[Request]) -> torch.Tensor:
        """The last-token logits [B, V] that admitting `requests` computes, the sequences then dropped (an engine with
        nothing in flight; for parity checks)."""
        if self.active:
            raise RuntimeError("prefill_logits needs an engine with no sequence in flight")
        out: list = []
        self.admit(requests, logits_out=out)
        self.abort()
        return out[0]

    def drop_caches(self) -> None:
        """Forget cached images and prefixes; the prefixes' blocks go back to the pool."""
        self.image_cache.clear()
        while self.prefix_cache:
            self.pool.release(self.prefix_cache.popitem()[1][0])

    # ---- start-up --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self) -> dict[str, float]:
        """Compile and capture now, before rows flow (and before preprocessing threads run), what a job would
        otherwise compile on its clock: the ViT's one set of graphs, each prefill variant of the compiled decoder
        layers and the decode graph of the largest row bucket. Seconds per part (nothing to do when eager). CUDA only: on a
        CPU, compiling all this up front costs more than a job's rows (the compiles happen as rows need them)."""
        if self.device.type != "cuda":
            return {}
        secs = {part: self.warm_part(part) for part in WARM_PARTS}
        return {part: s for part, s in secs.items() if s is not None}

    @torch.inference_mode()
    def warm_part(self, part: str) -> float | None:
        """One part of `warm_up` (`WARM_PARTS`), on any device: its seconds, or None where it has nothing to do."""
        t = time.perf_counter()
        if part == "vit" and hasattr(self.encode_fn, "warmup"):  # a CompiledEncoder
            self.encode_fn.warmup()
        elif part == "prefill" and (self.model.llm.compiled_layer or self.model.llm.compiled_last):
            self._warm_prefill()
        elif part == "decode_graphs" and self.decode_step.graphs:
            # the largest bucket only: its memory pool then serves the smaller ones, captured when a job first needs
            # them (most jobs decode in one bucket); token 0 at position 0 into block 0 (scratch)
            z = torch.zeros(self.max_rows, dtype=torch.long, device=self.device)
            self.decode_step(z, z.clone(), self.tables[: self.max_rows], self.pool)
        else:
            return None
        return self._synced_since(t)

    def _synced_since(self, t: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t

    def _warm_prefill(self) -> None:
        """Admit dummy rows down each path a job takes: packed prefill, a long row (cuDNN per sequence) and short
        rows (flash varlen) through one graph, the last layer for one row and for several (with FP8 linears, a graph
        each), and prefix-cache hits (the cascade); as few tokens as that takes. Caches and counters are left as they
        were."""
        counters = dict(self.counters)
        quick = Sampling(max_new_tokens=1, ignore_eos=True)  # finished at admission: nothing stays in flight
        for n, rows in ((PER_SEQ_MIN_MEAN + 1, 1), (25, 2)):
            self.admit([Request(torch.ones(n + i, dtype=torch.long), sampling=quick) for i in range(rows)])
        if self.settings.prefix_cache:
            c = self.cfg
            img = torch.full((c.num_image_token,), c.image_token_id)  # one tile's
            ids = torch.cat([torch.ones(8, dtype=torch.long), img, torch.ones(40, dtype=torch.long)])
            text = ids != c.image_token_id
            s = c.vision.image_size
            px = torch.zeros(1, s, s, 3, dtype=torch.uint8)  # raw tiles, as a job's rows bring them
            rows = [Request(ids + i * text, px, f"warm-up {i}", quick) for i in (1, 2, 3)]
            for batch in (rows, rows):  # stored, then hits
                self.admit(batch)
            self.drop_caches()
        self.counters = counters


def packed_meta(
    lengths: list[int],
    prefix_lens: list[int],
    table: torch.Tensor,
    backend: str = "sdpa",
    all_heads: bool = True,
    groups: list[int] | None = None,
):
    """Positions [T] and attention metadata for sequences of `lengths` new tokens after `prefix_lens` tokens already
    in the pool, sequence i's blocks in table[i] ([B, W] int32 on the device); `backend`: the prefill attention;
    all_heads: every head on this GPU (not under tensor parallelism); groups: equal ids on consecutive sequences
    whose cached prefix is the same blocks (default: each its own), which the "packed" backend reads once for all."""
    dev = table.device
    new = torch.tensor(lengths, dtype=torch.int64)
    total = [p + n for p, n in zip(prefix_lens, lengths, strict=True)]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = new.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), new).to(dev)
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, lengths, strict=True)]).to(dev)
    meta = AttnMeta(
        cu_seqlens=cu.to(dev),
        cu_seqlens_host=cu,
        max_seqlen=max(lengths),
        slot_b=table[seq, pos // BLOCK].long(),
        slot_pos=pos % BLOCK,
        prefix_lens=prefix_lens if any(prefix_lens) else None,
        backend=backend,
        all_heads=all_heads,
        kv_lens=torch.tensor(total, device=dev),
        block_table=table,
    )
    if backend == "packed":
        groups = list(range(len(lengths))) if groups is None else groups
        meta.prefix = CascadePrefix.build(lengths, prefix_lens, groups, table)
    return pos, meta
