"""The one builder: a model ready to serve, with its compiled parts.

Weights are loaded (or drawn), the LLM sharded across a tensor-parallel group, lm_head padded, the decoder layers
compiled, and the ViT wrapped as the job asks (compiled, FP8, tensor or data parallel). The engine takes what this
returns and changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.decorators import mark_unbacked

from batchvl import dist
from batchvl.config import InternVLConfig, from_preset, graph_key, load_config
from batchvl.encoder.internvit_compiled import CompiledEncoder
from batchvl.encoder.split_overlap import DPVisionEncoder, TPVisionEncoder, choose_vit_mode
from batchvl.job import EngineSpec, ModelSpec
from batchvl.llm.decoder import Decoder, DecoderLayer
from batchvl.model.internvl import InternVL
from batchvl.model.loader import load_model, random_model
from batchvl.model.memory import MIN_PREFILL_TOKENS, check_fits, memory_plan
from batchvl.ops.fp8 import Fp8Linear, fp8_unsupported
from batchvl.ops.prefill_attention import unbacked_batch_dims
from batchvl.precompile import Precompiled

log = logging.getLogger(__name__)
LIBRARIES_TIMEOUT_S = 120.0  # a set-up beside the load that takes longer is not waited for
TP_VIT_MICRO_BATCHES = (
    2  # a tensor-parallel ViT overlaps one micro-batch's all-reduce with the other's compute
)


def use_compile_cache(cache_dir: str) -> None:
    """Inductor's and Triton's on-disk caches under `cache_dir`, unless the user's environment names theirs. Read
    at each compile, so call it before the first."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # importing parts of torch (e.g. torch.nn.attention.varlen) fills the variable with Inductor's default, which
    # is no choice of the user's
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env is None or os.path.abspath(env) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_dir, "triton"))
    torch._inductor.config.fx_graph_cache = True


def compile_cache_counts() -> dict[str, int]:
    """This process's compiled graphs: loaded whole from the cache directory (`Precompiled`), traced by Dynamo (at
    each start where nothing was saved), and among those, Inductor's code read back from its on-disk cache (hits) or
    compiled anew (misses); and graph breaks (code that fell back to eager)."""
    from torch._dynamo.utils import counters

    from batchvl.precompile import COUNTS

    c = counters["inductor"]
    return {
        "precompiled_loaded": COUNTS["loaded"],
        "compile_cache_hits": int(c["fxgraph_cache_hit"]),
        "compile_cache_misses": int(c["fxgraph_cache_miss"]),
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def build_model(
    spec: ModelSpec,
    settings: EngineSpec,
    device: torch.device,
    dtype: torch.dtype,
    ctx: dist.DistContext | None = None,
) -> tuple[InternVL, Callable[[torch.Tensor], torch.Tensor]]:
    """(model, encode): the model on `device` (this rank's slice of the LLM under model.tp > 1) and the ViT callable
    tiles [N, 3, S, S] -> image tokens [N, 256, hidden]."""
    if not settings.eager:
        use_compile_cache(settings.cache_dir)
    tp = ctx.tp if ctx is not None else 1
    check_quantization(spec, device, tp)
    cfg = load_config(spec.path) if spec.path else from_preset(spec.preset)
    if device.type == "cuda":  # refuse what cannot fit before loading anything
        budget = settings.max_prefill_tokens or MIN_PREFILL_TOKENS
        plan = memory_plan(cfg, dtype, spec.quantization, budget, settings.max_vit_tiles, tp)
        what = f"{spec.path or spec.preset} ({str(dtype).removeprefix('torch.')}, quantization {spec.quantization})"
        check_fits(plan, torch.cuda.mem_get_info(device)[0], what)
    hooks: dict[str, Any] = {}
    if ctx is not None and ctx.tp > 1:  # the ViT stays whole on every rank of the replica
        from batchvl.llm.tp import shard_llm

        fns: dict[str, Callable] = {}
        hooks["prepare"] = lambda model: fns.update(s=shard_llm(model.llm, ctx.tp_rank, ctx.tp, ctx.tp_group))
        hooks["shard"] = lambda name, t: fns["s"](name, t)
    q = spec.quantization
    # the GPU libraries' one-time set-up, beside the load (their calls release the GIL) instead of in the warm-up
    libs = None
    if device.type == "cuda" and not settings.eager:
        libs = threading.Thread(
            target=warm_libraries, args=(cfg, device, dtype), name="warm-libraries", daemon=True
        )
        libs.start()
    if spec.path:
        model, _ = load_model(spec.path, device, dtype, spec.trust_remote_code, quantization=q, **hooks)
    else:
        model, _ = random_model(spec.preset, device, dtype, seed=spec.seed, quantization=q, **hooks)
    if libs is not None:
        libs.join(timeout=LIBRARIES_TIMEOUT_S)
        if libs.is_alive():
            log.warning("the GPU libraries' set-up still runs after %.0f s; going on", LIBRARIES_TIMEOUT_S)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the load's transient copies go back: the KV pool is sized from what is free
    prepare_llm(model.llm, not settings.eager and device.type == "cuda", settings.cache_dir)
    return model, vision_encoder(model, settings, ctx)


def warm_libraries(cfg: InternVLConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Call, on small random inputs, what the warm-up's first calls would set up for the first time in this process:
    cuBLAS, cuBLASLt's GELU epilogue (the ViT's fc1), cuDNN attention at the ViT's and the LLM's head shapes (cuDNN
    compiles per head configuration), flash varlen with its log-sum-exp. A failure here only logs: the warm-up pays
    the cost instead."""
    from batchvl.encoder.internvit_compiled import SDPA_BACKEND
    from batchvl.ops.prefill_attention import _varlen, causal_attn_per_seq, packed_kernel
    from batchvl.ops.sdpa import sdpa_context
    from batchvl.ops.vit_attention import kernel_config, vit_attention, vit_attention_sdpa

    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            g = torch.Generator(device).manual_seed(0)

            def rand(*shape: int) -> torch.Tensor:
                return torch.randn(*shape, device=device, dtype=dtype, generator=g)

            a = rand(64, 64)
            torch._addmm_activation(rand(64), a, a, use_gelu=True)
            v = cfg.vision
            T, H = v.num_patches + 1, v.num_heads
            qkv = rand(2 * T, 3 * v.hidden_size)
            w = torch.ones(v.hidden_size, device=device, dtype=dtype) if v.qk_normalization else None
            args = (qkv, T, H, v.head_dim**-0.5, w, w, v.layer_norm_eps)
            if kernel_config(qkv, T, H) is not None:  # the 300M's Triton attention
                vit_attention(*args)
            else:  # SDPA (the 6B's head_dim)
                with sdpa_context(SDPA_BACKEND, device):
                    vit_attention_sdpa(*args)
            c, n = cfg.llm, 128
            q, k, kv = (rand(n, h, c.head_dim) for h in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
            cu = torch.tensor([0, n], dtype=torch.int32)
            if packed_kernel(device, dtype, c.head_dim, [1 << 20], True) == "cudnn":  # long rows
                causal_attn_per_seq(q, k, kv, cu, "cudnn")
            if packed_kernel(device, dtype, c.head_dim, [1], True) == "varlen":  # short rows, the cascade
                _varlen(q, k, kv, cu.to(device), cu.to(device), n, n, lse=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - a start-up optimization, never a failed job
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.info("setting up GPU libraries beside the load failed (%s); the warm-up does it", why)
        return
    log.info("GPU libraries set up beside the load in %.2f s", time.perf_counter() - t0)


def check_quantization(spec: ModelSpec, device: torch.device, tp: int) -> None:
    """ValueError naming model.quantization when this device (or tensor parallelism) cannot run it."""
    if spec.quantization == "none":
        return
    if tp > 1:
        raise ValueError(
            f"model.quantization: {spec.quantization} runs the LLM on one GPU per replica; use model.tp: 1"
        )
    why = fp8_unsupported(device)
    if why:
        raise ValueError(f"model.quantization: fp8 cannot run here: {why}. Use quantization: none")


def prepare_llm(llm: Decoder, compile: bool, cache_dir: str | None = None) -> None:
    """lm_head padded for aligned logits rows on CUDA; the decoder layer's forward compiled (one graph shared by all
    layers: parameters are inputs), and the last layer's last-tokens path, their graphs saved under `cache_dir`."""
    if llm.embed_tokens.weight.is_cuda:
        llm.pad_vocab()
    if not compile:
        return
    # sizes that happen to be equal (a batch of 64 decode rows and the pool's 64-slot blocks) would otherwise be
    # tied by Dynamo's duck sizing and compile again when they differ
    torch.fx.experimental._config.use_duck_shape = False
    p = llm.embed_tokens.weight
    tag = f"{graph_key(llm.cfg)} {p.dtype} {type(llm.layers[0].mlp.down).__name__}"
    opts = dict(mark=_mark_prefill, dynamic=True)
    llm.compiled_layer = Precompiled(DecoderLayer.forward, cache_dir, tag, **opts)
    llm.compiled_last = Precompiled(DecoderLayer.forward_last, cache_dir, tag, **opts)


def _mark_prefill(layer, x, cos, sin, meta, *rest) -> None:
    if not meta.is_decode:
        unbacked_batch_dims(meta)
        # forward_last's rows: one graph for any row count (an unbacked row count fails FP8 GEMMs' tracing)
        fp8 = isinstance(layer.mlp.down, Fp8Linear)
        if len(rest) == 2 and not fp8:
            mark_unbacked(rest[1], 0)


def vision_encoder(model: InternVL, settings: EngineSpec, ctx: dist.DistContext | None = None) -> Callable:
    """The ViT callable: compiled unless eager; across a tensor-parallel group, TP with split-batch overlap or DP."""
    tp = ctx.tp if ctx is not None else 1
    if settings.vit_fp8:
        from batchvl.encoder.fp8 import fp8_vit

        if tp > 1:
            raise ValueError(
                "engine.vit_fp8 runs the ViT on one GPU per replica; use model.tp: 1 (or vit_fp8: false)"
            )
        fp8_vit(model.vision)  # in place: the four linears of every layer become Fp8Linear
    if tp > 1:
        mode = settings.vit_mode
        if mode == "auto":
            mode = choose_vit_mode(settings.max_vit_tiles, model.cfg, tp)
            log.info(
                "vit_mode auto -> %s (tp group of %d, %d tiles per ViT call)",
                mode,
                tp,
                settings.max_vit_tiles,
            )
        if mode == "tp":
            return TPVisionEncoder(
                model.vision, ctx.tp_group, TP_VIT_MICRO_BATCHES, compile=not settings.eager
            )
    if settings.eager:
        encode = model.vision
    else:
        encode = CompiledEncoder(model.vision, settings.max_vit_tiles, settings.cache_dir)
    return encode if tp <= 1 else DPVisionEncoder(model.vision, ctx.tp_group, encode=encode)
