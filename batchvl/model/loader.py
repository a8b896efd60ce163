"""Build InternVL from a local checkpoint (OpenGVLab or transformers layout, safetensors) or with random weights.

The model is built on the meta device; each tensor is read, re-keyed (fused qkv, gate/up, InternLM2's packed
wqkv unpacked) and copied straight to its device and dtype. A `shard` hook lets a tensor-parallel rank keep
only its slice of each tensor.

`quantization="fp8"` makes the decoder layers' linears `Fp8Linear`s on the meta model; each of their weights is
quantized on the device as it is read (or drawn), so the host holds one tensor at a time and the device never holds
the full-precision model. Checkpoints already in FP8 (compressed-tensors / vLLM `fp8` layout: `*.weight` in e4m3
plus `*.weight_scale`, per output channel or per tensor) load as they are; their FP8 tensors for a parameter that is
not FP8 here are dequantized.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batchvl.config import InternVLConfig, from_preset, load_config
from batchvl.job import QUANTIZATIONS
from batchvl.llm.decoder import fp8_llm
from batchvl.model.internvl import InternVL
from batchvl.ops.fp8 import FP8, dequantize

FP8_METHODS = (
    "fp8",
    "compressed-tensors",
)  # quantization_config.quant_method of the FP8 checkpoints that load

ShardFn = Callable[[str, torch.Tensor], torch.Tensor]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the tensor."""


@dataclass
class Recipe:
    sources: tuple[str, ...]
    combine: str = "one"  # "one" | "cat" (concatenate rows) | "wqkv" (InternLM2 packed qkv)


def _vision_rules(layout: str) -> list[tuple[str, tuple[str, ...]]]:
    """(our-name regex, source templates) for the vision tower and projector."""
    if layout == "opengvlab":
        return [
            (r"vision\.vit\.embeddings\.(.+)", ("vision_model.embeddings.{0}",)),
            (r"vision\.vit\.layers\.(\d+)\.(.+)", ("vision_model.encoder.layers.{0}.{1}",)),
            (r"vision\.projector\.norm\.(.+)", ("mlp1.0.{0}",)),
            (r"vision\.projector\.fc1\.(.+)", ("mlp1.1.{0}",)),
            (r"vision\.projector\.fc2\.(.+)", ("mlp1.3.{0}",)),
        ]
    L = "vision_tower.encoder.layer.{0}."
    return [
        (r"vision\.vit\.embeddings\.class_embedding", ("vision_tower.embeddings.cls_token",)),
        (r"vision\.vit\.embeddings\.position_embedding", ("vision_tower.embeddings.position_embeddings",)),
        (r"vision\.vit\.embeddings\.patch_embedding\.(.+)", ("vision_tower.embeddings.patch_embeddings.projection.{0}",)),
        (r"vision\.vit\.layers\.(\d+)\.attn\.qkv\.(.+)",
         (L + "attention.q_proj.{1}", L + "attention.k_proj.{1}", L + "attention.v_proj.{1}")),
        (r"vision\.vit\.layers\.(\d+)\.attn\.(q_norm|k_norm)\.(.+)", (L + "attention.{1}.{2}",)),
        (r"vision\.vit\.layers\.(\d+)\.attn\.proj\.(.+)", (L + "attention.projection_layer.{1}",)),
        (r"vision\.vit\.layers\.(\d+)\.ls1", (L + "lambda_1",)),
        (r"vision\.vit\.layers\.(\d+)\.ls2", (L + "lambda_2",)),
        (r"vision\.vit\.layers\.(\d+)\.norm1\.(.+)", (L + "layernorm_before.{1}",)),
        (r"vision\.vit\.layers\.(\d+)\.norm2\.(.+)", (L + "layernorm_after.{1}",)),
        (r"vision\.vit\.layers\.(\d+)\.mlp\.(.+)", (L + "mlp.{1}",)),
        (r"vision\.projector\.norm\.(.+)", ("multi_modal_projector.layer_norm.{0}",)),
        (r"vision\.projector\.fc1\.(.+)", ("multi_modal_projector.linear_1.{0}",)),
        (r"vision\.projector\.fc2\.(.+)", ("multi_modal_projector.linear_2.{0}",)),
    ]  # fmt: skip


def _llm_rules(arch: str, prefix: str, head: str) -> list[tuple[str, tuple[str, ...]]]:
    """Rules for the decoder; `prefix` is e.g. 'language_model.model.', `head` the lm_head key."""
    P, L = prefix, prefix + "layers.{0}."
    if arch == "internlm2":
        return [
            (r"llm\.embed_tokens\.weight", (P + "tok_embeddings.weight",)),
            (r"llm\.layers\.(\d+)\.input_norm\.weight", (L + "attention_norm.weight",)),
            (r"llm\.layers\.(\d+)\.attn\.qkv\.weight", (L + "attention.wqkv.weight",)),
            (r"llm\.layers\.(\d+)\.attn\.o_proj\.weight", (L + "attention.wo.weight",)),
            (r"llm\.layers\.(\d+)\.post_attn_norm\.weight", (L + "ffn_norm.weight",)),
            (
                r"llm\.layers\.(\d+)\.mlp\.gate_up\.weight",
                (L + "feed_forward.w1.weight", L + "feed_forward.w3.weight"),
            ),
            (r"llm\.layers\.(\d+)\.mlp\.down\.weight", (L + "feed_forward.w2.weight",)),
            (r"llm\.norm\.weight", (P + "norm.weight",)),
            (r"llm\.lm_head\.weight", (head,)),
        ]
    return [
        (r"llm\.embed_tokens\.weight", (P + "embed_tokens.weight",)),
        (r"llm\.layers\.(\d+)\.input_norm\.weight", (L + "input_layernorm.weight",)),
        (r"llm\.layers\.(\d+)\.attn\.qkv\.(.+)",
         (L + "self_attn.q_proj.{1}", L + "self_attn.k_proj.{1}", L + "self_attn.v_proj.{1}")),
        (r"llm\.layers\.(\d+)\.attn\.o_proj\.weight", (L + "self_attn.o_proj.weight",)),
        (r"llm\.layers\.(\d+)\.post_attn_norm\.weight", (L + "post_attention_layernorm.weight",)),
        (r"llm\.layers\.(\d+)\.mlp\.gate_up\.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight")),
        (r"llm\.layers\.(\d+)\.mlp\.down\.weight", (L + "mlp.down_proj.weight",)),
        (r"llm\.norm\.weight", (P + "norm.weight",)),
        (r"llm\.lm_head\.weight", (head,)),
    ]  # fmt: skip


def detect_layout(keys: set[str]) -> tuple[str, str, str]:
    """-> (layout, llm prefix, lm_head key)."""
    if any(k.startswith("vision_model.") for k in keys):
        head = "language_model.lm_head.weight"
        if "language_model.output.weight" in keys:
            head = "language_model.output.weight"
        return "opengvlab", "language_model.model.", head
    if any(k.startswith("model.vision_tower.") for k in keys):
        return "transformers-model", "model.language_model.", "lm_head.weight"
    if any(k.startswith("vision_tower.") for k in keys):
        return "transformers", "language_model.model.", "language_model.lm_head.weight"
    raise CheckpointError("unrecognised checkpoint layout: no vision_model.* or vision_tower.* tensors")


def plan(model: InternVL, keys: set[str], llm_arch: str | None = None) -> dict[str, Recipe]:
    """Our parameter name -> where its tensor comes from. `llm_arch` overrides the key names of the LLM
    (e.g. "qwen2" names for an InternLM2 decoder held as transformers' Llama)."""
    layout, prefix, head = detect_layout(keys)
    strip = "model." if layout == "transformers-model" else ""
    rules = [
        (re.compile(p), [strip + s if not s.startswith(prefix) else s for s in src])
        for p, src in _vision_rules("opengvlab" if layout == "opengvlab" else "transformers")
    ]
    rules += [
        (re.compile(p), list(src)) for p, src in _llm_rules(llm_arch or model.cfg.llm.arch, prefix, head)
    ]
    out = {}
    for name, _ in model.named_parameters(remove_duplicate=True):
        for rx, src in rules:
            m = rx.fullmatch(name)
            if m:
                sources = tuple(s.format(*m.groups()) for s in src)
                combine = (
                    "wqkv" if sources[0].endswith("wqkv.weight") else ("cat" if len(sources) > 1 else "one")
                )
                out[name] = Recipe(sources, combine)
                break
        else:
            raise CheckpointError(f"no checkpoint rule for parameter {name}")
    return out


def _unpack_wqkv(w: torch.Tensor, n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """InternLM2 packs [kv groups, (q_per_kv q heads, k, v), head_dim] rows; return [q; k; v] rows."""
    g = w.view(n_kv, n_heads // n_kv + 2, head_dim, -1)
    q = g[:, :-2].reshape(n_heads * head_dim, -1)
    return torch.cat([q, g[:, -2].reshape(n_kv * head_dim, -1), g[:, -1].reshape(n_kv * head_dim, -1)])


class _Reader:
    """Reads tensors by name from a directory of safetensors files (sharded via the index, or single)."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors files in {path} (only safetensors checkpoints load)"
                )
            weight_map = {}
            for f in files:
                with safe_open(f, "pt") as h:
                    weight_map.update(dict.fromkeys(h.keys(), f.name))
        self.path, self.weight_map, self._open = path, weight_map, {}

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        fname = self.weight_map[key]
        if fname not in self._open:
            if not (self.path / fname).is_file():
                raise FileNotFoundError(f"{key}: shard file {fname} listed in the index is missing")
            self._open[fname] = safe_open(self.path / fname, "pt")
        return self._open[fname].get_tensor(key)


def build_empty(cfg: InternVLConfig) -> InternVL:
    with torch.device("meta"):
        return InternVL(cfg)


def _materialize(
    model: InternVL, device: torch.device, dtype: torch.dtype, quantization: str = "none"
) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    model.to(dtype)  # still on meta: allocate in the target dtype, not float32 first
    if quantization == "fp8":
        fp8_llm(model.llm)  # still on meta: e4m3 weights and fp32 scales, filled as each tensor is read
    tied = model.cfg.llm.tie_word_embeddings
    if tied:  # to_empty would allocate the shared table twice, and the spare stays reserved on CUDA
        model.llm.lm_head.weight = None
    model.to_empty(device=device)
    model.llm.rotary.reset(device)
    if tied:
        model.llm.lm_head.weight = model.llm.embed_tokens.weight


@torch.no_grad()
def _store(model: InternVL, name: str, p: torch.Tensor, t: torch.Tensor) -> None:
    """Copy the full-precision tensor t (any device) into parameter `name`; an FP8 weight is quantized from it, on
    its own device."""
    if p.dtype == FP8:
        model.get_submodule(name.rpartition(".")[0]).quantize_from(t)
    else:
        p.copy_(t)  # casts on the way: no second copy of t in p's dtype


def _row_scales(s: torch.Tensor, rows: int, key: str) -> torch.Tensor:
    """A checkpoint's FP8 weight scale -> fp32 [rows, 1]: per output channel ([rows, 1] or [rows]) or per tensor."""
    if s.numel() == 1:
        return s.float().reshape(1, 1).expand(rows, 1)
    if s.numel() == rows and s.shape[-1] in (rows, 1):
        return s.float().reshape(rows, 1)
    raise CheckpointError(
        f"{key}: FP8 scale of shape {tuple(s.shape)} for {rows} rows; batchvl reads per-tensor and "
        f"per-output-channel scales, not block-wise ones"
    )


def checkpoint_quantization(path: Path) -> str | None:
    """'fp8' when config.json names an FP8 quantization_config (top level or the LLM's), None when it names none;
    CheckpointError for another method."""
    cfg = json.loads((path / "config.json").read_text())
    q = cfg.get("quantization_config") or (cfg.get("llm_config") or cfg.get("text_config") or {}).get(
        "quantization_config"
    )
    if not q:
        return None
    method = q.get("quant_method")
    if method not in FP8_METHODS:
        raise CheckpointError(
            f"{path}: quantization_config.quant_method {method!r}; batchvl loads FP8 checkpoints "
            f"({' or '.join(FP8_METHODS)}, e4m3 weights with weight_scale) and unquantized ones"
        )
    return "fp8"


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    shard: ShardFn | None = None,
    prepare: Callable[[InternVL], None] | None = None,
    quantization: str = "none",
) -> tuple[InternVL, InternVLConfig]:
    """Load a checkpoint directory. `prepare(model)` runs on the meta model (e.g. TP sharding) before loading.
    quantization "fp8": the decoder layers' linears in FP8 (quantized at load, or as the checkpoint has them)."""
    del trust_remote_code  # batchvl's own modules are used; no checkpoint code is ever run
    path, device = Path(path), torch.device(device)
    cfg = load_config(path)
    checkpoint_quantization(path)  # refuses quantization methods batchvl cannot read
    reader = _Reader(path)
    keys = reader.keys()
    if cfg.image_token_id < 0:
        cfg.image_token_id = _image_token_from_tokenizer(path)
    model = build_empty(cfg)
    if prepare is not None:
        prepare(model)
    recipes = plan(model, keys)
    used: set[str] = set()
    _materialize(model, device, dtype, quantization)
    for name, r in recipes.items():
        if name == "llm.lm_head.weight" and cfg.llm.tie_word_embeddings:
            continue
        used.update(_load_param(model, name, r, reader, cfg, shard))
    ignored = _IGNORED(keys)
    if cfg.llm.tie_word_embeddings:  # a tied head some checkpoints still ship: the embedding is used
        ignored |= {k for k in keys if k in ("lm_head.weight", "language_model.lm_head.weight")}
    unexpected = sorted(keys - used - ignored)
    if unexpected:
        raise CheckpointError(
            f"unexpected tensors in {path}: {', '.join(unexpected[:8])}"
            + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        )
    return model.eval(), cfg


def _load_param(
    model: InternVL, name: str, r: Recipe, reader: _Reader, cfg: InternVLConfig, shard: ShardFn | None
) -> list[str]:
    """Read parameter `name`'s tensors and set it (a function: the host lets go of them when it returns); returns
    the checkpoint keys read."""
    p = model.get_parameter(name)
    t, scales, read = _read(reader, r, cfg, name)
    if scales is not None and p.dtype == FP8 and shard is None:  # an FP8 checkpoint into FP8 linears: as is
        _check_shape(name, r, t, p)
        model.get_submodule(name.rpartition(".")[0]).load_quantized(t.to(p.device), scales.to(p.device))
        return read
    if scales is not None:  # FP8 tensors for a parameter that is not FP8 here (or to be sharded first)
        t = dequantize(t.to(p.device), scales.to(p.device))
    if shard is not None:
        t = shard(name, t)
    _check_shape(name, r, t, p)
    _store(model, name, p, t)
    return read


def _read(
    reader: _Reader, r: Recipe, cfg: InternVLConfig, name: str
) -> tuple[torch.Tensor, torch.Tensor | None, list[str]]:
    """A recipe's tensor on the host (our parameter's rows); from an FP8 checkpoint, also its row scales [rows, 1]
    (else None); and the checkpoint keys read."""
    keys = reader.weight_map
    missing = [s for s in r.sources if s not in keys]
    if missing:
        raise CheckpointError(f"{name}: missing tensor(s) {', '.join(missing)} in {reader.path}")
    parts = [reader.get(s) for s in r.sources]
    for s, t in zip(r.sources, parts, strict=True):
        if not t.is_floating_point() or (t.itemsize == 1 and t.dtype != FP8):
            raise CheckpointError(f"{s}: dtype {t.dtype} is not a floating-point (or e4m3) weight")
    if not any(t.dtype == FP8 for t in parts):
        return _combine(r, parts, cfg), None, list(r.sources)
    scale_keys = [s + "_scale" for s in r.sources]
    if not all(t.dtype == FP8 for t in parts) or any(k not in keys for k in scale_keys):
        raise CheckpointError(f"{name}: FP8 tensors {', '.join(r.sources)} must all be e4m3, each with its "
                              "weight_scale")  # fmt: skip
    scales = [_row_scales(reader.get(k), t.shape[0], k) for k, t in zip(scale_keys, parts, strict=True)]
    return _combine(r, parts, cfg), _combine(r, scales, cfg), [*r.sources, *scale_keys]


def _check_shape(name: str, r: Recipe, t: torch.Tensor, p: torch.Tensor) -> None:
    if t.shape != p.shape:
        raise CheckpointError(
            f"{name} (from {', '.join(r.sources)}): shape {tuple(t.shape)} != {tuple(p.shape)}"
        )


def _combine(r: Recipe, parts: list[torch.Tensor], cfg: InternVLConfig) -> torch.Tensor:
    """A recipe's source tensors (or their FP8 row scales, [rows, 1]) -> our parameter's rows."""
    if r.combine == "wqkv":
        c = cfg.llm
        return _unpack_wqkv(parts[0], c.num_heads, c.num_kv_heads, c.head_dim)
    return torch.cat(parts, 0) if r.combine == "cat" else parts[0]


def _IGNORED(keys: set[str]) -> set[str]:  # noqa: N802
    """Tensors a checkpoint may carry that InternVL2.5 inference does not use (an FP8 checkpoint's static
    activation scales among them: batchvl scales activations per token at run time)."""
    return {k for k in keys if k.endswith(("rotary_emb.inv_freq", "embeddings.mask_token", ".input_scale"))}


def _image_token_from_tokenizer(path: Path) -> int:
    """OpenGVLab checkpoints name no image token id in config.json: look <IMG_CONTEXT> up in the tokenizer files."""
    for fname in ("tokenizer.json", "added_tokens.json", "tokenizer_config.json"):
        f = path / fname
        if not f.is_file():
            continue
        data = json.loads(f.read_text())
        if fname == "tokenizer.json":
            for tok in data.get("added_tokens", []):
                if tok.get("content") == "<IMG_CONTEXT>":
                    return int(tok["id"])
        elif fname == "added_tokens.json" and "<IMG_CONTEXT>" in data:
            return int(data["<IMG_CONTEXT>"])
        elif fname == "tokenizer_config.json":
            for tid, tok in (data.get("added_tokens_decoder") or {}).items():
                if tok.get("content") == "<IMG_CONTEXT>":
                    return int(tid)
    raise CheckpointError(
        f"cannot find the <IMG_CONTEXT> token id in {path}'s tokenizer files or config.json"
    )


@torch.no_grad()
def init_random(
    model: InternVL,
    seed: int = 0,
    std: float = 0.02,
    shard: ShardFn | None = None,
    full_shapes: dict | None = None,
) -> None:
    """Draw every parameter on its device: N(0, std) for weights and biases, 1 + N(0, std) for norm weights,
    0.1 + N(0, std) for layer scales (an FP8 weight: quantized from its fp32 draw). Never zeros, never uninitialised memory. Each tensor has its own seed
    (from its name), so a tensor-parallel rank that draws the full tensor and keeps its shard gets the same
    values as one process."""
    shapes = full_shapes or {name: p.shape for name, p in model.named_parameters()}
    # the largest first: each later fp32 copy then fits in the first's cached block, which on CUDA would otherwise
    # stay reserved beside a new one for every larger tensor (the seed is the tensor's index, not its turn)
    params = sorted(enumerate(model.named_parameters()), key=lambda ip: -shapes[ip[1][0]].numel())
    for i, (name, p) in params:
        shape = shapes[name]
        g = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
        # scaled in place: one fp32 copy at a time, not two (a stand-in's embedding table: 2.9 GiB each)
        t = torch.randn(shape, generator=g, device=p.device, dtype=torch.float32).mul_(std)
        if re.search(r"norm\d?\.weight$", name):
            t += 1.0
        elif name.endswith(("ls1", "ls2")):
            t += 0.1
        if shard is not None:
            t = shard(name, t)
        _store(model, name, p, t)
        del t  # else the loop variable keeps this draw alive while the next is drawn


def random_model(
    preset: str | InternVLConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    prepare: Callable[[InternVL], None] | None = None,
    shard: ShardFn | None = None,
    quantization: str = "none",
) -> tuple[InternVL, InternVLConfig]:
    """A model of a preset's shapes with seeded random weights drawn on `device`, tensor by tensor (an FP8 weight
    is drawn in fp32, then quantized)."""
    cfg = from_preset(preset) if isinstance(preset, str) else preset
    model = build_empty(cfg)
    full_shapes = {n: p.shape for n, p in model.named_parameters()}
    if prepare is not None:
        prepare(model)
    _materialize(model, torch.device(device), dtype, quantization)
    init_random(model, seed, shard=shard, full_shapes=full_shapes)
    return model.eval(), cfg
