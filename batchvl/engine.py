"""The engine: one batch of prepared requests in, generated tokens and stage times out.

The pipeline talks to the model only through `Engine.run_batch`: ViT (with an optional image-embedding cache) ->
packed varlen prefill (with an optional shared-prefix KV cache) -> batched decode against the batch's KV cache.
It takes a model ready to serve (`model.build.build_model`) and never changes it.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchvl.config import InternVLConfig
from batchvl.job import EngineSpec
from batchvl.llm.decode_step import DecodeStep, round_up
from batchvl.llm.kv_cache import KVArena, KVCache
from batchvl.llm.sampling import sample
from batchvl.model.internvl import InternVL
from batchvl.ops.decode_attention import kernel_runs as decode_kernel_runs
from batchvl.ops.prefill_attention import AttnMeta, prefill_backend


@dataclass
class Request:
    """One prepared row: token ids with <IMG_CONTEXT> placeholders, and its tiles."""

    input_ids: torch.Tensor  # [L] int64, CPU
    pixel_values: torch.Tensor | None = None  # [tiles, 3, 448, 448] float32, CPU
    image_key: str | None = None  # content hash of the image(s) + tiling, for the embedding cache


@dataclass
class Sampling:
    max_new_tokens: int = 4
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class BatchResult:
    output_ids: list[list[int]]
    vit_ms: float  # ViT + projector for the whole batch (CUDA events on GPU)
    prefill_ms: float
    decode_ms: float
    first_token_s: float  # time.perf_counter() when the first tokens were on the host
    end_s: float  # time.perf_counter() when the last tokens were on the host
    stats: dict = field(default_factory=dict)  # per-request lists: cache_hit_image, cached_prefix_tokens


IMAGE_CACHE_ENTRIES = 64  # images' features kept by the image cache
PREFIX_CACHE_ENTRIES = 8  # prefixes' KV kept by the prefix cache


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


def packed_meta(
    lengths: list[int], prefix_lens: list[int], device, backend: str = "sdpa"
) -> tuple[torch.Tensor, AttnMeta]:
    """Positions [T] and attention metadata for sequences of `lengths` new tokens after `prefix_lens`; `backend`:
    the prefill attention (`prefill_backend`)."""
    new = torch.tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = new.cumsum(0)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), new)
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, lengths, strict=True)])
    meta = AttnMeta(
        cu_seqlens=cu.to(device),
        cu_seqlens_host=cu,
        max_seqlen=max(lengths),
        slot_b=rows.to(device),
        slot_pos=pos.to(device),
        prefix_lens=prefix_lens if any(prefix_lens) else None,
        backend=backend,
    )
    if any(prefix_lens):  # keys = cached prefix + new tokens of each sequence
        total = [p + n for p, n in zip(prefix_lens, lengths, strict=True)]
        cu_k = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu_k[1:] = torch.tensor(total).cumsum(0)
        meta.cu_seqlens_k, meta.max_seqlen_k = cu_k.to(device), max(total)
        meta.key_rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(total)).to(device)
        meta.key_pos = torch.cat([torch.arange(t) for t in total]).to(device)
    return pos.to(device), meta


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
    ):
        self.model, self.cfg, self.settings = model, cfg, settings or EngineSpec()
        self.device, self.dtype = torch.device(device), dtype
        self.eos = tuple(eos_token_ids)
        self.encode_fn = encode_fn or model.vision  # [tiles,3,S,S] -> [tiles, 256, hidden]
        self.image_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.prefix_cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.counters = {"image_cache_hits": 0, "prefix_cache_hits": 0, "prefix_tokens_reused": 0}
        attn = model.llm.layers[0].attn  # this rank's heads, under tensor parallelism
        self.all_heads = attn.n_heads == cfg.llm.num_heads
        # each batch's KV view cleared only where the decode attention reads every slot (its reference path)
        fast_decode = decode_kernel_runs(self.device, dtype, attn.n_heads, attn.n_kv, cfg.llm.head_dim)
        self.arena = KVArena(
            cfg.llm.num_layers, attn.n_kv, cfg.llm.head_dim, self.device, dtype, clear=not fast_decode
        )
        graphs = not self.settings.eager and self.device.type == "cuda"
        self.decode_step = DecodeStep(model.llm, graphs=graphs)
        # a graph per cache shape: pad rows and lengths so that a long job sees a handful of shapes
        self.row_multiple, self.len_multiple = (8, 128) if graphs else (1, 1)

    def batch_bytes(self, max_tokens: int, max_new_tokens: int) -> int:
        """Rough peak device memory of one batch of `max_tokens` prompt tokens: its KV cache plus the largest
        LLM and ViT activations (the MLP's gate/up output dominates)."""
        c, v, el = self.cfg.llm, self.cfg.vision, torch.empty((), dtype=self.dtype).element_size()
        kv = KVCache.bytes_per_token(c.num_layers, self._n_kv(), c.head_dim, self.dtype)
        kv_all = kv * (max_tokens + max_tokens // 64 * max_new_tokens)  # decode room; rows are padded too
        llm_act = max_tokens * (3 * c.intermediate_size + 6 * c.hidden_size) * el
        vit_act = (
            self.settings.max_vit_tiles
            * (v.num_patches + 1)
            * (2 * v.intermediate_size + 6 * v.hidden_size)
            * el
        )
        return kv_all + max(llm_act, vit_act)

    def check_memory(self, max_tokens: int, max_new_tokens: int) -> None:
        """Fail early, with the numbers, when a full batch cannot fit in the free device memory."""
        if self.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        need = self.batch_bytes(max_tokens, max_new_tokens)
        if need > 0.9 * free:
            per_token = need / max_tokens
            fits = int(0.9 * free / per_token) // 1024 * 1024
            raise MemoryError(
                f"a batch of engine.max_prefill_tokens={max_tokens} needs about {need / 2**30:.1f} GiB "
                f"(KV cache + activations) but {free / 2**30:.1f} GiB is free after loading the model; "
                f"use engine.max_prefill_tokens <= {fits}"
            )

    # ---- ViT -------------------------------------------------------------------------------------------------
    def _encode_tiles(self, tiles: list[torch.Tensor]) -> torch.Tensor:
        """Tiles of several requests (CPU) -> [N, 256, hidden] on device, in chunks of max_vit_tiles."""
        px = torch.cat(
            [t.to(self.device, non_blocking=True) for t in tiles]
        )  # cat on the device, not the host
        px = px.to(self.dtype)
        step = self.settings.max_vit_tiles
        return torch.cat([self.encode_fn(px[i : i + step]) for i in range(0, px.shape[0], step)])

    def encode(self, requests: list[Request]) -> tuple[list[torch.Tensor | None], list[bool]]:
        """Image features per request, [tiles*256, hidden] or None; and whether each came from the cache."""
        use_cache = self.settings.image_cache
        feats: list[torch.Tensor | None] = [None] * len(requests)
        hits = [False] * len(requests)
        todo: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            if r.pixel_values is None:
                continue
            key = r.image_key if (use_cache and r.image_key) else f"#{i}"
            if use_cache and key in self.image_cache:
                self.image_cache.move_to_end(key)
                feats[i], hits[i] = self.image_cache[key], True
                self.counters["image_cache_hits"] += 1
            else:
                if key in todo:  # same image twice in this batch: encoded once
                    hits[i] = True
                    self.counters["image_cache_hits"] += 1
                todo.setdefault(key, []).append(i)
        if todo:
            keys = list(todo)
            tiles = [requests[todo[k][0]].pixel_values for k in keys]
            enc = self._encode_tiles(tiles)
            start = 0
            for k, t in zip(keys, tiles, strict=True):
                f = enc[start : start + t.shape[0]].reshape(-1, enc.shape[-1])
                start += t.shape[0]
                for i in todo[k]:
                    feats[i] = f
                if use_cache and not k.startswith("#"):
                    self.image_cache[k] = f.clone()  # not a view: it would keep the batch's features alive
                    while len(self.image_cache) > IMAGE_CACHE_ENTRIES:
                        self.image_cache.popitem(last=False)
        return feats, hits

    # ---- prefix cache ----------------------------------------------------------------------------------------
    def _prefix_len(self, ids: torch.Tensor) -> int:
        """Tokens up to and including the last <IMG_CONTEXT>: system prompt + user header + image."""
        where = (ids == self.cfg.image_token_id).nonzero()
        return int(where[-1]) + 1 if len(where) else 0

    @staticmethod
    def _prefix_key(ids: torch.Tensor, image_key: str | None) -> str:
        return hashlib.blake2b(ids.numpy().tobytes() + (image_key or "").encode(), digest_size=16).hexdigest()

    def _fill_prefixes(self, items: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Prefill each missing prefix alone and keep its KV, [layers, kv_heads, P, head_dim] each."""
        ids = [t for _, t, _ in items]
        feats = [f for _, _, f in items]
        cache = self._prefill(ids, feats, [0] * len(ids), None, extra=0, arena=False)[1]
        for row, (key, t, _) in enumerate(items):
            p = t.shape[0]
            self.prefix_cache[key] = cache.prefix(row, p)
            while len(self.prefix_cache) > PREFIX_CACHE_ENTRIES:
                self.prefix_cache.popitem(last=False)

    # ---- LLM -------------------------------------------------------------------------------------------------
    def _prefill(
        self,
        ids: list[torch.Tensor],
        feats: list,
        prefix_lens: list[int],
        prefixes: list | None,
        extra: int,
        arena: bool = True,
    ) -> tuple[torch.Tensor, KVCache]:
        """Packed prefill of the new tokens `ids[i]` after `prefix_lens[i]` cached ones.
        Returns last-token logits [B, V] and the batch's KV cache (room for `extra` more tokens); the cache is
        the arena's (rows and length padded for the decode graphs) unless `arena` is off."""
        llm, c = self.model.llm, self.cfg.llm
        lengths = [int(t.shape[0]) for t in ids]
        longest = max(p + n for p, n in zip(prefix_lens, lengths, strict=True))
        if arena:
            cache = self.arena.cache(*self._arena_shape(len(ids), longest + extra))
        else:
            cache = KVCache(
                c.num_layers, len(ids), longest + extra, self._n_kv(), c.head_dim, self.device, self.dtype
            )
        if prefixes:
            for b, pk in enumerate(prefixes):
                if pk is not None:
                    cache.set_prefix(b, *pk)
        flat = torch.cat(ids).to(self.device, non_blocking=True)
        img = [f for f in feats if f is not None]
        h = self.model.embed(flat, torch.cat(img, 0) if img else None)
        backend = prefill_backend(
            self.device, self.dtype, c.head_dim, lengths, any(prefix_lens), self.all_heads
        )
        pos, meta = packed_meta(lengths, prefix_lens, self.device, backend)
        # only last tokens go through the last layer's attention output and MLP, and through lm_head
        last = meta.cu_seqlens[1:].long() - 1
        return llm.logits(llm(h, pos, meta, cache, max_position=longest - 1, last=last)), cache

    def _arena_shape(self, rows: int, max_len: int) -> tuple[int, int]:
        """A batch's KV-cache shape in the arena: rows and length padded so decode graphs repeat."""
        return round_up(rows, self.row_multiple), round_up(max_len, self.len_multiple)

    def _n_kv(self) -> int:
        return self.model.llm.layers[0].attn.n_kv

    # ---- one batch: ViT, prefill, decode ---------------------------------------------------------------------
    @torch.inference_mode()
    def run_batch(self, requests: list[Request], s: Sampling) -> BatchResult:
        """ViT -> packed prefill -> decode for one batch."""
        dev = self.device
        with _Timer(dev) as t_vit:
            feats, hits = self.encode(requests)
        prefix_lens = [0] * len(requests)
        prefixes: list | None = None
        ids = [r.input_ids for r in requests]
        with _Timer(dev) as t_pre:
            if self.settings.prefix_cache:
                ids, feats, prefix_lens, prefixes = self._use_prefix_cache(requests, feats)
            logits, cache = self._prefill(ids, feats, prefix_lens, prefixes, extra=s.max_new_tokens)
            gen = torch.Generator(device=dev).manual_seed(s.seed) if s.temperature > 0 else None
            tok = sample(logits, s.temperature, s.top_p, gen)
        out = [[t] for t in tok.tolist()]
        first_token_s = time.perf_counter()
        lens = [p + int(t.shape[0]) for p, t in zip(prefix_lens, ids, strict=True)]
        try:
            with _Timer(dev) as t_dec:
                done_s = self._decode(cache, tok, lens, out, s, gen, first_token_s)
        finally:
            del cache  # free the batch's KV cache, also when a step failed
        end_s = time.perf_counter()
        stats = {
            "cache_hit_image": hits,
            "cached_prefix_tokens": prefix_lens,
            "done_s": [d if d is not None else end_s for d in done_s],
        }
        return BatchResult(
            out, t_vit.elapsed(), t_pre.elapsed(), t_dec.elapsed(), first_token_s, end_s, stats
        )

    def _decode(
        self,
        cache: KVCache,
        tok: torch.Tensor,
        lens: list[int],
        out: list[list[int]],
        s: Sampling,
        gen: torch.Generator | None,
        first_token_s: float,
    ) -> list[float | None]:
        """The remaining tokens of every request, appended to `out`; returns when each request got its last token."""
        dev, n = self.device, len(out)
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.eos))
        done = [o[0] in stops for o in out]
        done_s = [first_token_s if d else None for d in done]
        pad = cache.rows - n  # the cache's padding rows decode a dummy token at position 0
        tok = torch.cat([tok, tok.new_zeros(pad)])
        lens_t = torch.tensor(lens + [0] * pad, device=dev)
        real = (torch.arange(cache.rows, device=dev) < n).long()  # 1 for requests, 0 for padding rows
        for step in range(s.max_new_tokens - 1):
            if all(done):
                break
            self.model.llm.check_position(max(lens) + step)
            logits = self.decode_step(tok, lens_t, cache)  # [rows, V]; rows past n are padding
            new = sample(logits[:n], s.temperature, s.top_p, gen)
            tok = torch.cat([new, tok[n:]])
            lens_t = lens_t + real
            now = None
            for b, t in enumerate(new.tolist()):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in stops
                    if done[b]:
                        done_s[b] = now = now or time.perf_counter()
        return done_s

    def _use_prefix_cache(self, requests: list[Request], feats: list):
        """Split each request into a cached prefix (filled on first sight) and the new tokens after it."""
        keys, plens = [], []
        missing: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}
        for r, f in zip(requests, feats, strict=True):
            p = self._prefix_len(r.input_ids)
            if p == 0 or p >= r.input_ids.shape[0] or (r.pixel_values is not None and r.image_key is None):
                # (an image without a content key cannot be told apart from another: no reuse)
                keys.append(None)
                plens.append(0)
                continue
            k = self._prefix_key(r.input_ids[:p], r.image_key)
            keys.append(k)
            plens.append(p)
            if k not in self.prefix_cache and k not in missing:
                missing[k] = (k, r.input_ids[:p], f)
        if missing:
            self._fill_prefixes(list(missing.values()))
        ids, new_feats, prefixes = [], [], []
        for r, f, k, p in zip(requests, feats, keys, plens, strict=True):
            if k is None or k not in self.prefix_cache:
                ids.append(r.input_ids)
                new_feats.append(f)
                prefixes.append(None)
                plens[len(ids) - 1] = 0
                continue
            self.prefix_cache.move_to_end(k)
            self.counters["prefix_cache_hits"] += 1
            self.counters["prefix_tokens_reused"] += p
            ids.append(r.input_ids[p:])
            new_feats.append(None)  # every image token lies inside the prefix
            prefixes.append(self.prefix_cache[k])
        return ids, new_feats, plens, prefixes
