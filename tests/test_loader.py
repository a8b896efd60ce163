"""Checkpoint loading (both layouts) and whole-model parity with transformers, fp32 CPU."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import IMG_CONTEXT_ID, to_opengvlab

from batchvl.config import load_config
from batchvl.engine import Engine, Request, Sampling, packed_meta
from batchvl.llm.kv_cache import blocks_for
from batchvl.model.loader import CheckpointError, load_model, random_model

TOL = dict(atol=2e-5, rtol=1e-4)


def _inputs(n_tiles: int = 2, n_text: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pv = torch.randn(n_tiles, 3, 448, 448, generator=g)
    text = torch.randint(0, 151643, (n_text,), generator=g)
    ids = torch.cat([text[:5], torch.tensor([151665]), torch.full((256 * n_tiles,), IMG_CONTEXT_ID),
                     torch.tensor([151666]), text[5:]])  # fmt: skip
    return ids, pv


def _our_logits(model, ids, pv):
    feats = model.encode_images(pv)
    h = model.embed(ids, feats)
    n = ids.shape[0]
    pos, meta = packed_meta([n], [0], torch.zeros(1, blocks_for(n), dtype=torch.int32))  # no KV pool
    return model.llm.logits(model.llm(h, pos, meta, None))


@pytest.mark.parametrize("layout", ["transformers", "opengvlab"])
def test_logits_match_transformers(hf_model_dir, tmp_path, layout):
    d, hf = hf_model_dir
    if layout == "opengvlab":
        d = to_opengvlab(d, tmp_path / "og")
    model, cfg = load_model(d)
    assert cfg.image_token_id == IMG_CONTEXT_ID
    ids, pv = _inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids[None], pixel_values=pv).logits[0]
        ours = _our_logits(model, ids, pv)
    torch.testing.assert_close(ours, ref, **TOL)


def test_greedy_tokens_match_generate(hf_model_dir):
    d, hf = hf_model_dir
    model, cfg = load_model(d)
    ids, pv = _inputs(n_tiles=1, seed=1)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids[None], pixel_values=pv, max_new_tokens=8, do_sample=False,
                          min_new_tokens=8, eos_token_id=None, pad_token_id=0)[0, ids.shape[0]:].tolist()  # fmt: skip
    req = Request(ids, pv, sampling=Sampling(max_new_tokens=8, ignore_eos=True))
    assert Engine(model, cfg).generate([req])[0].output_ids == ref


def test_opengvlab_and_transformers_layouts_load_same_weights(hf_model_dir, tmp_path):
    d, _ = hf_model_dir
    a, _ = load_model(d)
    b, _ = load_model(to_opengvlab(d, tmp_path / "og"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=0, rtol=0, msg=k)


def test_sharded_index_checkpoint(hf_model_dir, tmp_path):
    """A checkpoint split over two files with model.safetensors.index.json loads the same."""
    from safetensors.torch import load_file, save_file

    d, _ = hf_model_dir
    sd = load_file(d / "model.safetensors")
    keys = sorted(sd)
    out = tmp_path / "sharded"
    out.mkdir()
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for f, ks in halves.items():
        save_file({k: sd[k] for k in ks}, out / f)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in halves.items() for k in ks}})
    )
    (out / "config.json").write_text((d / "config.json").read_text())
    a, _ = load_model(d)
    b, _ = load_model(out)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0, msg=k)


def _edit_checkpoint(src, dst, fn):
    from safetensors.torch import load_file, save_file

    sd = load_file(src / "model.safetensors")
    fn(sd)
    dst.mkdir()
    save_file(sd, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_missing_unexpected_shape_dtype_errors_name_the_tensor(hf_model_dir, tmp_path):
    d, _ = hf_model_dir
    k = "language_model.model.layers.0.self_attn.q_proj.weight"
    bad = _edit_checkpoint(d, tmp_path / "missing", lambda sd: sd.pop(k))
    with pytest.raises(CheckpointError, match="q_proj.weight"):
        load_model(bad)
    bad = _edit_checkpoint(d, tmp_path / "extra", lambda sd: sd.update({"foo.bar": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="foo.bar"):
        load_model(bad)
    bad = _edit_checkpoint(d, tmp_path / "shape", lambda sd: sd.update({k: sd[k][:-1].clone()}))
    with pytest.raises(CheckpointError, match="llm.layers.0.attn.qkv.weight"):
        load_model(bad)
    bad = _edit_checkpoint(d, tmp_path / "dtype", lambda sd: sd.update({k: sd[k].to(torch.int8)}))
    with pytest.raises(CheckpointError, match="q_proj.weight: dtype torch.int8"):
        load_model(bad)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")


def test_config_json_both_layouts(hf_model_dir, tmp_path):
    d, _ = hf_model_dir
    a = load_config(d)
    b = load_config(to_opengvlab(d, tmp_path / "og"))
    assert a.vision == b.vision
    assert a.llm.num_kv_heads == b.llm.num_kv_heads == 2 and a.llm.arch == b.llm.arch == "qwen2"
    assert a.vision.qk_normalization and not a.vision.qkv_bias and a.vision.norm_type == "rms_norm"


def test_random_weights_are_seeded_and_nonzero():
    a, _ = random_model("tiny-qwen2", seed=3)
    b, _ = random_model("tiny-qwen2", seed=3)
    c, _ = random_model("tiny-qwen2", seed=4)
    for (k, x), y, z in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), k
        assert not torch.equal(x, z), k
        assert x.abs().sum() > 0 and torch.isfinite(x).all(), k


def test_model_prefixed_transformers_layout(hf_model_dir, tmp_path):
    """The `model.vision_tower.* / model.language_model.* / lm_head` variant loads to the same weights."""

    def rekey(sd):
        for k in list(sd):
            t = sd.pop(k)
            if k.startswith("language_model.model."):
                k = "model.language_model." + k[len("language_model.model.") :]
            elif k == "language_model.lm_head.weight":
                k = "lm_head.weight"
            else:
                k = "model." + k
            sd[k] = t

    d, _ = hf_model_dir
    b, _ = load_model(_edit_checkpoint(d, tmp_path / "prefixed", rekey))
    a, _ = load_model(d)
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0, msg=k)


def test_llama_text_config_without_qkv_bias_matches_transformers(tmp_path):
    """transformers' InternVL with a Llama LLM (how an InternLM2 one is converted): no qkv bias, same logits."""
    from conftest import randomize_, tiny_hf_config
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(0)
    hf = InternVLForConditionalGeneration(tiny_hf_config("300m", text="llama")).eval()
    randomize_(hf)
    hf.save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path)
    assert not cfg.llm.qkv_bias
    ids, pv = _inputs(n_tiles=1)
    with torch.no_grad():
        torch.testing.assert_close(
            _our_logits(model, ids, pv), hf(input_ids=ids[None], pixel_values=pv).logits[0], **TOL
        )


def test_unsupported_rope_scaling_is_refused(hf_model_dir):
    """A rope type batchvl does not implement (yarn changes RoPE at every position) fails clearly, not silently."""
    from batchvl.config import from_dict

    cfg = json.loads((hf_model_dir[0] / "config.json").read_text())
    cfg["text_config"]["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                             "original_max_position_embeddings": 32768}  # fmt: skip
    with pytest.raises(ValueError, match="'yarn'"):
        from_dict(cfg)
    cfg["text_config"]["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    assert from_dict(cfg).llm.rope_scaling == {"type": "linear", "factor": 2.0}
