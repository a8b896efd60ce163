"""The engine: one batch of prepared requests in, generated tokens and stage times out.

The pipeline (jobs, queues, Parquet) talks to the model only through `Engine.run_batch`:
ViT (with an optional image-embedding cache) -> packed varlen prefill (with an optional shared-prefix KV cache)
-> batched decode against a per-batch KV cache.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchvl.llm.attention import PER_SEQ_MIN_MEAN, AttnMeta, warm_per_seq
from batchvl.llm.decode_attention import kernel_runs as decode_kernel_runs
from batchvl.llm.decode_step import DecodeStep, round_up
from batchvl.llm.kv_cache import KVArena, KVCache
from batchvl.llm.sampling import sample
from batchvl.model.config import InternVLConfig
from batchvl.model.internvl import InternVL


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


@dataclass
class EngineConfig:
    max_prefill_tokens: int = 16384
    max_vit_tiles: int = 64
    image_cache: bool = False
    image_cache_entries: int = 64
    prefix_cache: bool = False
    prefix_cache_entries: int = 8
    compile_vit: bool = True
    vit_compile_mode: str = "default"  # or "tuned" (long jobs), "max-autotune-no-cudagraphs"
    vit_gelu_epilogue: bool = True  # compiled ViT: fc1 + GELU as one cuBLASLt GEMM (+3% 6B, +8% 300M on H200)
    vit_fused_norm: bool = True  # compiled ViT: residual + layer scale + norm, one Triton pass (+2-3%, H200)
    # compiled ViT: residuals added in place by the GEMMs (+1.2-1.4%); None: on where the folded weight copies take
    # <= 1 GiB, which the runner's model always meets: it folds the layer scales into its own proj / fc2 weights
    # (`CompiledEncoder(fold_in_place=True)`), so nothing is copied
    vit_inplace_residual: bool | None = None
    vit_triton_attention: bool = True  # compiled ViT: Triton attention (300M); Triton q/k norm + SDPA (6B)
    vit_fp8: bool = False  # ViT linears in FP8 e4m3 (encoder/fp8.py): opt-in, less accurate, tp 1 only
    compile_llm: bool | None = None  # regional torch.compile of the decoder layers; None: on CUDA only
    overlap_vit: bool = False  # run a batch's ViT on a side stream under the previous batch's decode (CUDA)
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (CUDA only; rows padded to 8)
    vit_mode: str = "auto"
    vit_splits: int = 2
    # LLM prefill: "auto" | "sdpa" | "varlen" | "cudnn" (per-sequence SDPA); auto: cuDNN per sequence on Hopper
    # when a batch's sequences average >= PER_SEQ_MIN_MEAN tokens, else flash varlen (CUDA) or sdpa
    attn_backend: str = "auto"
    # prefill: the last decoder layer's attention output, residuals and MLP for each sequence's last token only (its
    # k / v for all tokens); nothing else reads them (`Decoder.forward(last=...)`)
    last_layer_last_tokens: bool = True


@dataclass
class Encoded:
    """The ViT work of one batch, possibly still running on a side stream until `done`."""

    feats: list  # per request: [tiles*256, hidden] or None
    hits: list[bool]
    timer: _Timer
    done: torch.cuda.Event | None


@dataclass
class Pending:
    """A prefilled batch waiting for its decode steps."""

    sampling: Sampling
    cache: KVCache | None
    tok: torch.Tensor  # [cache rows] last token of each row (padding rows: 0)
    lens: torch.Tensor  # [cache rows] tokens in the cache of each row (padding rows: 0)
    max_len: int  # the largest of `lens`, on the host
    gen: torch.Generator | None
    out: list[list[int]]
    first_token_s: float
    encoded: Encoded
    t_prefill: _Timer
    stats: dict


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


def packed_meta(lengths: list[int], prefix_lens: list[int], device) -> tuple[torch.Tensor, AttnMeta]:
    """Positions [T] and attention metadata for sequences of `lengths` new tokens after `prefix_lens`."""
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
        engine_cfg: EngineConfig | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        eos_token_ids: tuple[int, ...] = (),
        encode_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.model, self.cfg, self.ecfg = model, cfg, engine_cfg or EngineConfig()
        self.device, self.dtype = torch.device(device), dtype
        self.eos = tuple(eos_token_ids)
        self.encode_fn = encode_fn or model.vision  # [tiles,3,S,S] -> [tiles, 256, hidden]
        self.image_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.prefix_cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.side: torch.cuda.Stream | None = None  # where the ViT runs under the previous batch's decode
        self.counters = {"image_cache_hits": 0, "prefix_cache_hits": 0, "prefix_tokens_reused": 0}
        c = cfg.llm
        n_kv = self._n_kv()
        # each batch's KV view cleared only where the decode attention reads every slot (its reference path)
        heads = model.llm.layers[0].attn.n_heads  # this rank's, under tensor parallelism
        fast_decode = decode_kernel_runs(self.device, dtype, heads, n_kv, c.head_dim)
        self.arena = KVArena(c.num_layers, n_kv, c.head_dim, self.device, dtype, clear=not fast_decode)
        graphs = self.ecfg.cuda_graphs and self.device.type == "cuda"
        self.decode_step = DecodeStep(model.llm, graphs=graphs)
        # a graph per cache shape: pad rows and lengths so that a long job sees a handful of shapes
        self.row_multiple, self.len_multiple = (8, 128) if graphs else (1, 1)
        # None: on CUDA (measured at 38B on an H200: prefill +20%, decode step -26%); on CPU it only costs time
        compile_llm = self.ecfg.compile_llm
        if compile_llm is None:
            compile_llm = self.device.type == "cuda"
        # "auto" prefill attention: per-sequence cuDNN where measured faster (Hopper, long sequences, all heads on
        # one GPU), else varlen. Not under tensor parallelism: each call would carry a quarter of the work for the
        # same host cost, unmeasured.
        self.cudnn_prefill = (
            self.ecfg.attn_backend == "auto"
            and model.llm.layers[0].attn.n_heads == cfg.llm.num_heads
            and self.device.type == "cuda"
            and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability(self.device)[0] == 9
        )
        if self.device.type == "cuda":
            model.llm.pad_vocab()  # aligned logits rows: cuBLAS's fast kernels for lm_head (Decoder.pad_vocab)
        for layer in model.llm.layers:
            layer.attn.backend = self.ecfg.attn_backend
            if compile_llm and getattr(layer, "_compiled_call_impl", None) is None:
                layer.compile(dynamic=True)  # one graph, reused by every layer (parameters are inputs)
        if compile_llm and self.ecfg.last_layer_last_tokens and model.llm.compiled_last is None:
            model.llm.compiled_last = torch.compile(model.llm.layers[-1].forward_last, dynamic=True)

    def batch_bytes(self, max_tokens: int, max_new_tokens: int) -> int:
        """Rough peak device memory of one batch of `max_tokens` prompt tokens: its KV cache plus the largest
        LLM and ViT activations (the MLP's gate/up output dominates)."""
        c, v, el = self.cfg.llm, self.cfg.vision, torch.empty((), dtype=self.dtype).element_size()
        kv = KVCache.bytes_per_token(c.num_layers, self._n_kv(), c.head_dim, self.dtype)
        kv_all = kv * (max_tokens + max_tokens // 64 * max_new_tokens)  # decode room; rows are padded too
        llm_act = max_tokens * (3 * c.intermediate_size + 6 * c.hidden_size) * el
        vit_act = (
            self.ecfg.max_vit_tiles * (v.num_patches + 1) * (2 * v.intermediate_size + 6 * v.hidden_size) * el
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
        step = self.ecfg.max_vit_tiles
        return torch.cat([self.encode_fn(px[i : i + step]) for i in range(0, px.shape[0], step)])

    def encode(self, requests: list[Request]) -> tuple[list[torch.Tensor | None], list[bool]]:
        """Image features per request, [tiles*256, hidden] or None; and whether each came from the cache."""
        use_cache = self.ecfg.image_cache
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
                    while len(self.image_cache) > self.ecfg.image_cache_entries:
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
            while len(self.prefix_cache) > self.ecfg.prefix_cache_entries:
                self.prefix_cache.popitem(last=False)

    # ---- LLM -------------------------------------------------------------------------------------------------
    def _prefill(self, ids: list[torch.Tensor], feats: list, prefix_lens: list[int], prefixes: list | None,
                 extra: int, arena: bool = True) -> tuple[torch.Tensor, KVCache]:  # fmt: skip
        """Packed prefill of the new tokens `ids[i]` after `prefix_lens[i]` cached ones.
        Returns last-token logits [B, V] and the batch's KV cache (room for `extra` more tokens); the cache is
        the arena's (rows and length padded for the decode graphs) unless `arena` is off."""
        llm, c = self.model.llm, self.cfg.llm
        lengths = [int(t.shape[0]) for t in ids]
        longest = max(p + n for p, n in zip(prefix_lens, lengths, strict=True))
        if arena:
            cache = self.arena.cache(*self._arena_shape(len(ids), longest + extra))
        else:
            cache = KVCache(c.num_layers, len(ids), longest + extra, self._n_kv(), c.head_dim, self.device,
                            self.dtype)  # fmt: skip
        if prefixes:
            for b, pk in enumerate(prefixes):
                if pk is not None:
                    cache.set_prefix(b, *pk)
        flat = torch.cat(ids).to(self.device, non_blocking=True)
        img = [f for f in feats if f is not None]
        h = self.model.embed(flat, torch.cat(img, 0) if img else None)
        pos, meta = packed_meta(lengths, prefix_lens, self.device)
        meta.per_seq = self.cudnn_prefill and sum(lengths) >= PER_SEQ_MIN_MEAN * len(lengths)
        last = meta.cu_seqlens[1:].long() - 1  # only last tokens go through lm_head
        if self.ecfg.last_layer_last_tokens:  # and through the last layer's attention output and MLP
            return llm.logits(llm(h, pos, meta, cache, max_position=longest - 1, last=last)), cache
        return llm.logits(llm(h, pos, meta, cache, max_position=longest - 1)[last]), cache

    def _arena_shape(self, rows: int, max_len: int) -> tuple[int, int]:
        """A batch's KV-cache shape in the arena: rows and length padded so decode graphs repeat."""
        return round_up(rows, self.row_multiple), round_up(max_len, self.len_multiple)

    def _n_kv(self) -> int:
        return self.model.llm.layers[0].attn.n_kv

    # ---- one batch: ViT (can run under the previous batch's decode), prefill, decode ------------------------
    @torch.inference_mode()
    def encode_async(self, requests: list[Request]) -> Encoded:
        """Start the ViT for `requests`. On CUDA it runs on a side stream, so it can overlap the decode of the
        batch before; `prefill` waits for it on the device, not on the host."""
        if self.device.type != "cuda" or not self.ecfg.overlap_vit:
            with _Timer(self.device) as t:
                feats, hits = self.encode(requests)
            return Encoded(feats, hits, t, None)
        main = torch.cuda.current_stream(self.device)
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            with _Timer(self.device) as t:
                feats, hits = self.encode(requests)
            done = torch.cuda.Event()
            done.record(self.side)
        for f in feats:
            if f is not None:
                f.record_stream(main)  # used (and maybe cached) on the main stream
        return Encoded(feats, hits, t, done)

    @torch.inference_mode()
    def prefill(self, requests: list[Request], sampling: Sampling, encoded: Encoded | None = None) -> Pending:
        """ViT (unless started already) + packed prefill + the first token of every request."""
        dev = self.device
        encoded = encoded or self.encode_async(requests)
        if encoded.done is not None:
            torch.cuda.current_stream(dev).wait_event(encoded.done)
        feats = encoded.feats
        prefix_lens = [0] * len(requests)
        prefixes: list | None = None
        ids = [r.input_ids for r in requests]
        with _Timer(dev) as t_pre:
            if self.ecfg.prefix_cache:
                ids, feats, prefix_lens, prefixes = self._use_prefix_cache(requests, feats)
            logits, cache = self._prefill(ids, feats, prefix_lens, prefixes, extra=sampling.max_new_tokens)
            gen = torch.Generator(device=dev).manual_seed(sampling.seed) if sampling.temperature > 0 else None
            tok = sample(logits, sampling.temperature, sampling.top_p, gen)
        first = tok.tolist()
        lens = [p + int(t.shape[0]) for p, t in zip(prefix_lens, ids, strict=True)]
        pad = cache.rows - len(lens)  # the cache's padding rows decode a dummy token at position 0
        tok = torch.cat([tok, tok.new_zeros(pad)])
        lens_t = torch.tensor(lens + [0] * pad, device=dev)
        return Pending(sampling, cache, tok, lens_t, max(lens), gen, [[t] for t in first], time.perf_counter(),
                       encoded, t_pre, {"cache_hit_image": encoded.hits, "cached_prefix_tokens": prefix_lens})  # fmt: skip

    @torch.inference_mode()
    def warm_decode(self, batches: list[tuple[int, int]], max_new_tokens: int) -> int:
        """Capture the decode-step graphs for batches of (requests, longest prompt) ahead of time, largest cache
        first so the KV arena is allocated once and every later batch views the same buffers; returns how many
        graphs were captured (0 without CUDA graphs). For a timed run that should not include one-time costs."""
        if not self.decode_step.graphs:
            return 0
        before = self.decode_step.captures
        shapes = {self._arena_shape(n, longest + max_new_tokens) for n, longest in batches}
        for rows, max_len in sorted(shapes, key=lambda rl: -rl[0] * rl[1]):
            zeros = torch.zeros(rows, dtype=torch.long, device=self.device)  # token 0 at position 0: scratch
            self.decode_step(zeros, zeros.clone(), self.arena.cache(rows, max_len))
        return self.decode_step.captures - before

    @torch.inference_mode()
    def warm_prefill_attention(self, lengths: list[int]) -> int:
        """With the per-sequence cuDNN prefill (`attn_backend: cudnn`, or "auto" on Hopper), visit every attention
        window those prompt lengths map to, so cuDNN builds its execution plans before a timed run; returns how
        many windows (0 where the prefill never takes that path)."""
        attn = self.model.llm.layers[0].attn  # heads of this rank (tensor parallel shards them)
        if attn.backend != "cudnn" and not self.cudnn_prefill:
            return 0
        return warm_per_seq(lengths, attn.n_heads, attn.n_kv, attn.head_dim, self.device, self.dtype)

    @torch.inference_mode()
    def decode(self, p: Pending) -> BatchResult:
        """The remaining tokens of a prefilled batch, all requests together."""
        dev, s, out, tok, lens = self.device, p.sampling, p.out, p.tok, p.lens
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.eos))
        done = [o[0] in stops for o in out]
        done_s = [p.first_token_s if d else None for d in done]  # when each request got its last token
        n = len(out)
        real = (torch.arange(lens.shape[0], device=dev) < n).long()  # 1 for requests, 0 for padding rows
        try:
            with _Timer(dev) as t_dec:
                for step in range(s.max_new_tokens - 1):
                    if all(done):
                        break
                    self.model.llm.check_position(p.max_len + step)
                    logits = self.decode_step(tok, lens, p.cache)  # [rows, V]; rows past n are padding
                    new = sample(logits[:n], s.temperature, s.top_p, p.gen)
                    tok = torch.cat([new, tok[n:]])
                    lens = lens + real
                    now = None
                    for b, t in enumerate(new.tolist()):
                        if not done[b]:
                            out[b].append(t)
                            done[b] = t in stops
                            if done[b]:
                                done_s[b] = now = now or time.perf_counter()
        finally:
            p.cache = None  # free the batch's KV cache, also when a step failed
        end_s = time.perf_counter()
        stats = {**p.stats, "done_s": [d if d is not None else end_s for d in done_s]}
        vit_ms = p.encoded.timer.elapsed()
        return BatchResult(out, vit_ms, p.t_prefill.elapsed(), t_dec.elapsed(), p.first_token_s, end_s, stats)

    def run_batch(self, requests: list[Request], sampling: Sampling) -> BatchResult:
        """ViT -> packed prefill -> decode for one batch."""
        return self.decode(self.prefill(requests, sampling))

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
