"""Shared fixtures: tiny InternVL checkpoints made with transformers, in both layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchvl.preprocess import Preprocessor

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

IMG_CONTEXT_ID = 151667


def tiny_hf_config(
    vision: str = "6b",
    text: str = "qwen2",
    image_size: int = 448,
    vocab_size: int = 151674,
    image_token_id: int = IMG_CONTEXT_ID,
):
    """A transformers InternVLConfig with tiny shapes. vision '6b': RMSNorm + qk-norm, no qkv bias; '300m':
    LayerNorm + qkv bias. The Qwen vocabulary (151674) keeps real token ids valid; InternLM2's is 92553."""
    from transformers import InternVLConfig

    v = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             image_size=image_size, patch_size=14)  # fmt: skip
    if vision == "6b":
        v.update(norm_type="rms_norm", use_qk_norm=True, attention_bias=False)
    else:
        v.update(norm_type="layer_norm", use_qk_norm=False, attention_bias=True)
    t = dict(model_type=text, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=4096, rope_theta=1e6)  # fmt: skip
    return InternVLConfig(
        vision_config=v, text_config=t, image_token_id=image_token_id, tie_word_embeddings=False
    )


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial weights everywhere (norm weights and layer scales too), so no parameter hides a mapping bug."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "lambda" in name):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """(dir, model): a tiny transformers InternVLForConditionalGeneration saved with save_pretrained."""
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(tiny_hf_config("6b")).eval()
    randomize_(model)
    d = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(d)
    return d, model


def to_opengvlab(hf_dir: Path, out_dir: Path) -> Path:
    """Re-key a transformers-layout tiny checkpoint to the OpenGVLab layout (fused qkv, mlp1.*, ...)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(hf_dir / "model.safetensors")
    cfg = json.loads((hf_dir / "config.json").read_text())
    out: dict[str, torch.Tensor] = {}
    layers = cfg["vision_config"]["num_hidden_layers"]
    ren = {"vision_tower.embeddings.cls_token": "vision_model.embeddings.class_embedding",
           "vision_tower.embeddings.position_embeddings": "vision_model.embeddings.position_embedding",
           "vision_tower.embeddings.patch_embeddings.projection.weight": "vision_model.embeddings.patch_embedding.weight",
           "vision_tower.embeddings.patch_embeddings.projection.bias": "vision_model.embeddings.patch_embedding.bias",
           "multi_modal_projector.layer_norm.weight": "mlp1.0.weight", "multi_modal_projector.layer_norm.bias": "mlp1.0.bias",
           "multi_modal_projector.linear_1.weight": "mlp1.1.weight", "multi_modal_projector.linear_1.bias": "mlp1.1.bias",
           "multi_modal_projector.linear_2.weight": "mlp1.3.weight", "multi_modal_projector.linear_2.bias": "mlp1.3.bias"}  # fmt: skip
    for i in range(layers):
        a, b = f"vision_tower.encoder.layer.{i}.", f"vision_model.encoder.layers.{i}."
        for s in ("weight", "bias"):
            if a + f"attention.q_proj.{s}" in sd:
                out[b + f"attn.qkv.{s}"] = torch.cat([sd.pop(a + f"attention.{x}_proj.{s}") for x in "qkv"])
        for x, y in [("layernorm_before", "norm1"), ("layernorm_after", "norm2"), ("attention.projection_layer", "attn.proj"),
                     ("attention.q_norm", "attn.q_norm"), ("attention.k_norm", "attn.k_norm"), ("mlp.fc1", "mlp.fc1"),
                     ("mlp.fc2", "mlp.fc2")]:  # fmt: skip
            for s in ("weight", "bias"):
                if a + f"{x}.{s}" in sd:
                    ren[a + f"{x}.{s}"] = b + f"{y}.{s}"
        ren[a + "lambda_1"], ren[a + "lambda_2"] = b + "ls1", b + "ls2"
    for k, t in sd.items():
        out[ren.get(k, k)] = t  # language_model.* keys are the same in both layouts
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, out_dir / "model.safetensors")
    v, t = cfg["vision_config"], cfg["text_config"]
    og = {"architectures": ["InternVLChatModel"], "downsample_ratio": 0.5, "select_layer": -1, "ps_version": "v2",
          "template": "internvl2_5", "max_dynamic_patch": 12, "min_dynamic_patch": 1, "use_thumbnail": True,
          "force_image_size": v["image_size"][0],
          "vision_config": {"architectures": ["InternVisionModel"], "hidden_size": v["hidden_size"],
                            "num_hidden_layers": v["num_hidden_layers"], "num_attention_heads": v["num_attention_heads"],
                            "intermediate_size": v["intermediate_size"], "norm_type": v["norm_type"],
                            "qk_normalization": v["use_qk_norm"], "qkv_bias": v["attention_bias"],
                            "layer_norm_eps": v["layer_norm_eps"], "image_size": v["image_size"][0],
                            "patch_size": v["patch_size"][0], "hidden_act": "gelu"},
          "llm_config": {**t, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": cfg["tie_word_embeddings"]}}  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(og))
    # OpenGVLab configs carry no image token id: it comes from the tokenizer files
    (out_dir / "added_tokens.json").write_text(
        json.dumps({"<img>": 151665, "</img>": 151666, "<IMG_CONTEXT>": 151667})
    )
    return out_dir


def pack_wqkv(q, k, v, n_heads, n_kv, head_dim):
    """InternLM2's layout, written from its documentation: per kv group, its q heads, then k, then v."""
    hidden = q.shape[1]
    qg = q.view(n_kv, n_heads // n_kv, head_dim, hidden)
    return torch.cat([qg, k.view(n_kv, 1, head_dim, hidden), v.view(n_kv, 1, head_dim, hidden)], 1).reshape(
        -1, hidden
    )


def llama_to_internlm2(sd: dict, layers: int, n_heads: int, n_kv: int, head_dim: int) -> dict:
    """A Llama decoder's tensors under `language_model.` renamed and packed as an OpenGVLab InternLM2 checkpoint's."""
    out = {}
    for n, t in sd.items():
        n = n.replace("lm_head", "output").replace("embed_tokens", "tok_embeddings")
        n = n.replace("input_layernorm", "attention_norm").replace("post_attention_layernorm", "ffn_norm")
        n = n.replace("self_attn.o_proj", "attention.wo").replace("mlp.gate_proj", "feed_forward.w1")
        n = n.replace("mlp.up_proj", "feed_forward.w3").replace("mlp.down_proj", "feed_forward.w2")
        out[n] = t
    for i in range(layers):
        p = f"language_model.model.layers.{i}."
        q, k, v = (out.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv")
        out[p + "attention.wqkv.weight"] = pack_wqkv(q, k, v, n_heads, n_kv, head_dim)
    return out


# ---------------------------------------------------------------- job / data / pipeline helpers


class FakeEngine:
    """Honours the engine's protocol (`admit`, `step`, `abort` and what admission asks): each request's output ids are
    a function of it alone, one more per step until its own `max_new_tokens`; records every admitted batch.

    `fail_if(request) -> bool` makes any batch holding such a request raise, as a failing engine would."""

    def __init__(self, fail_if=None, rows: int = 64, blocks: int = 10**6):
        import types

        self.fail_if = fail_if or (lambda r: False)
        self.rows, self.live = rows, []
        self.pool = types.SimpleNamespace(free=blocks, num_blocks=blocks + 1)
        self.max_prefill_tokens = 16384
        self.batches: list[dict] = []

    def free_rows(self) -> int:
        return self.rows - len(self.live)

    @property
    def active(self) -> int:
        return len(self.live)

    def cached_tokens(self, r) -> int:
        return 0

    def check_positions(self, r) -> None:
        pass

    def prefix_hit(self, r) -> None:
        return None

    def spare_prefix_blocks(self) -> dict[str, int]:
        return {}

    def needs_vit(self, r) -> bool:
        return r.pixel_values is not None

    def cached_images(self) -> frozenset[str]:
        return frozenset()

    def blocks_needed(self, r) -> int:
        return 1

    def admit(self, requests):
        import time

        tiles = sum(0 if r.pixel_values is None else int(r.pixel_values.shape[0]) for r in requests)
        tokens = sum(len(r.input_ids) for r in requests)
        self.batches.append({"n": len(requests), "tokens": tokens, "tiles": tiles})
        if any(self.fail_if(r) for r in requests):
            raise RuntimeError("fake engine failure")
        time.sleep(0.002)
        first = time.perf_counter()
        for r in requests:
            self.live.append((r, [int(r.input_ids.sum()) % 1000], first))
        return self._finished(first)

    def step(self):
        import time

        time.sleep(0.001)
        for _, out, _ in self.live:
            out.append(out[-1] + 1)
        return self._finished(time.perf_counter())

    def abort(self):
        handles, self.live = [r.handle for r, _, _ in self.live], []
        return handles

    def _finished(self, now):
        from batchvl.engine import Finished

        def stop(r, out):
            return out[-1] in r.sampling.stop_token_ids

        done = [x for x in self.live if len(x[1]) >= x[0].sampling.max_new_tokens or stop(x[0], x[1])]
        self.live = [x for x in self.live if all(x is not d for d in done)]
        return [Finished(r.handle, out, 1.0, 2.0, 3.0, first, now, False, 0, "stop" if stop(r, out) else "length")
                for r, out, first in done]  # fmt: skip


def assert_clock_order(r: dict) -> None:
    """A finished row's clocks run forward: read, prepared, batch start, first token, done."""
    assert r["t_read_s"] <= r["t_prepared_s"] <= r["t_batch_start_s"] <= r["t_first_token_s"] <= r["t_done_s"]


def save_image(path: Path, size=(64, 48), mode: str = "RGB", fmt: str = "PNG") -> Path:
    """Write a small synthetic image in any PIL mode."""
    from PIL import Image

    img = Image.linear_gradient("L").resize(size).convert("RGB")
    if mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    elif mode != "RGB":
        img = img.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt)
    return path


@pytest.fixture(scope="session")
def bad_rows_jsonl(tmp_path_factory) -> Path:
    """A jsonl job input mixing good rows (RGB, L, P, RGBA, CMYK, text-only) and bad ones; see BAD_ROWS."""
    d = tmp_path_factory.mktemp("bad_rows")
    save_image(d / "rgb.png")
    save_image(d / "grey.png", mode="L")
    save_image(d / "palette.png", mode="P")
    save_image(d / "alpha.png", mode="RGBA")
    save_image(d / "cmyk.jpg", mode="CMYK", fmt="JPEG")
    save_image(d / "huge.png", size=(3000, 2000))  # over max_image_pixels=4_000_000 set by the tests
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    (d / "empty.jpg").write_bytes(b"")
    rows = [
        {"id": "rgb", "prompt": "What is this?", "image": "rgb.png"},
        {"id": "grey", "prompt": "What is this?", "image": "grey.png"},
        {"id": "palette", "prompt": "What is this?", "image": "palette.png"},
        {"id": "alpha", "prompt": "What is this?", "image": "alpha.png"},
        {"id": "cmyk", "prompt": "What is this?", "image": "cmyk.jpg"},
        {"id": "text", "prompt": "Say hi."},
        {"id": "corrupt", "prompt": "What is this?", "image": "corrupt.png"},
        {"id": "zero-bytes", "prompt": "What is this?", "image": "empty.jpg"},
        {"id": "missing", "prompt": "What is this?", "image": "no_such_file.png"},
        {"id": "huge", "prompt": "What is this?", "image": "huge.png"},
        {"id": "empty-prompt", "prompt": "  ", "image": "rgb.png"},
        {"id": "overlong", "prompt": "word " * 3000, "image": "rgb.png"},  # over max_input_tokens=2048
        {"id": "rgb", "prompt": "Again?", "image": "rgb.png"},  # duplicate id
    ]
    path = d / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# id -> a substring of the expected error (None: the row succeeds)
BAD_ROWS = {
    "rgb": None, "grey": None, "palette": None, "alpha": None, "cmyk": None, "text": None,
    "corrupt": "", "zero-bytes": "0 bytes", "missing": "not found", "huge": "too large",
    "empty-prompt": "empty prompt", "overlong": "max_input_tokens",
}  # fmt: skip


def run_interpreted(code: str) -> None:
    """Run `code` in a fresh Python with TRITON_INTERPRET=1 (Triton kernels on the CPU); it must print "ok"."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
    p = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


class HangingPreprocessor(Preprocessor):
    """The prompt "hang" blocks its worker for 10 minutes (as reading a FIFO did), after touching the file named by
    $BATCHVL_TEST_HANG. Defined here so that spawned workers can unpickle it."""

    def __call__(self, prompt, image, cached=()):
        if prompt == "hang":
            import os
            import time

            Path(os.environ["BATCHVL_TEST_HANG"]).touch()
            time.sleep(600)
        return super().__call__(prompt, image, cached)


def stopped_at_admission(n: int, **engine_kw):
    """An engine factory for `run_job`: FakeEngines taking one row per batch, whose n-th admission (counted over every
    engine it builds, so a resumed job goes on) raises KeyboardInterrupt, as Ctrl-C would mid-job."""
    admitted = [0]

    class Stops(FakeEngine):
        def admit(self, requests):
            admitted[0] += 1
            if admitted[0] == n:
                raise KeyboardInterrupt
            return super().admit(requests)

    def factory(*args, **kwargs):
        eng = Stops(**engine_kw)
        eng.max_prefill_tokens = 1
        return eng

    return factory
