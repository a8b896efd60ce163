"""Tokenizers: InternLM2's from a checkpoint's tokenizer.model (no remote code) against sentencepiece itself, a whole
job on a tiny InternLM2 InternVL checkpoint against transformers, and the stand-ins the random presets get."""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA, llama_to_internlm2, randomize_, tiny_hf_config, to_opengvlab

from batchvl.config import INTERNLM2_VOCAB, from_preset
from batchvl.data import records
from batchvl.job import DataSpec, load_job
from batchvl.output import read_rows
from batchvl.preprocess import build_prompt, load_image, to_pixel_values
from batchvl.runner import run_job, stop_token_ids
from batchvl.tokenizer import image_token_ids, load_tokenizer

spm = pytest.importorskip("sentencepiece")

REPO = Path(__file__).resolve().parents[1]
# InternVL2_5-8B's tokenizer_config.json: InternLM2's named and chat tokens, then InternVL's
SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|plugin|>": 92538, "<|interpreter|>": 92539, "<|action_end|>": 92540,
            "<|action_start|>": 92541, "<|im_end|>": 92542, "<|im_start|>": 92543, "<img>": 92544, "</img>": 92545,
            "<IMG_CONTEXT>": 92546, "<quad>": 92547, "</quad>": 92548, "<ref>": 92549, "</ref>": 92550,
            "<box>": 92551, "</box>": 92552}  # fmt: skip
INTERNVL = ["<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>"]
TRICKY = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "several\n\n\nnewlines\n",
    "tabs\tand\t\tmore tabs",
    "unicode: café, naïve, 你好世界, Привет",
    "emoji 🐯🎉 and a rare one 🦩",
    "<|im_start|>user\nDescribe the tiger.<|im_end|>\n<|im_start|>assistant\n",
    "text<img><IMG_CONTEXT><IMG_CONTEXT></img>next to specials",
    " <|im_end|> spaced <s>bos</s> ",
    "<box>[[1, 2, 3, 4]]</box><ref>a cat</ref>",
    "broken <IMG_CONTEXT specials <|im_end",
    "don't stop . it 's fine , right ?",
    "",
]
WORDS = ("the a tiger cat image picture describe what is this in on with and of photo show me please a large "
         "small striped orange black white 你好 世界 图片 描述 老虎 café naïve 1234 2025").split()  # fmt: skip


def _train(add_dummy_prefix: bool) -> bytes:
    """A tiny byte-fallback BPE sentencepiece model, in the spirit of InternLM2's (no whitespace collapsing)."""
    import io

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) for _ in range(400)]
    lines += ["  indented line\twith a tab", "several\n\nlines"] * 5
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=420, model_type="bpe", byte_fallback=True,
        add_dummy_prefix=add_dummy_prefix, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        split_digits=True, normalization_rule_name="identity", character_coverage=0.9995, num_threads=1,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    return buf.getvalue()


def write_internlm2_tokenizer(d: Path, add_dummy_prefix: bool = True) -> Path:
    """InternVL2_5-8B's tokenizer files: tokenizer.model, tokenizer_config.json (InternLM2Tokenizer via auto_map,
    every added token with its id), special_tokens_map.json and added_tokens.json."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.model").write_bytes(_train(add_dummy_prefix))
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    chat = [
        "<|im_start|>",
        "<|im_end|>",
        "<|action_start|>",
        "<|action_end|>",
        "<|interpreter|>",
        "<|plugin|>",
    ]
    cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): {"content": c, **flags} for c, i in SPECIALS.items()},
        "additional_special_tokens": chat + INTERNVL,
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]},
        "bos_token": "<s>",
        "chat_template": "{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "model_max_length": 16384,
        "pad_token": "</s>",
        "tokenizer_class": "InternLM2Tokenizer",
        "unk_token": "<unk>",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    special_map = {"additional_special_tokens": chat + INTERNVL, "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "</s>", "unk_token": "<unk>"}  # fmt: skip
    (d / "special_tokens_map.json").write_text(json.dumps(special_map))
    (d / "added_tokens.json").write_text(json.dumps({c: SPECIALS[c] for c in INTERNVL}))
    return d


@pytest.fixture(scope="session")
def internlm2_tok_dirs(tmp_path_factory) -> dict[bool, Path]:
    """add_dummy_prefix -> a tokenizer directory (real InternLM2 models may have either setting)."""
    root = tmp_path_factory.mktemp("internlm2_tok")
    return {adp: write_internlm2_tokenizer(root / f"adp{int(adp)}", adp) for adp in (True, False)}


def reference_ids(sp, text: str) -> list[int]:
    """InternLM2Tokenizer's encoding, rebuilt: <s>, then sentencepiece on each stretch between added tokens."""
    ids, pos = [SPECIALS["<s>"]], 0
    pattern = "|".join(re.escape(t) for t in sorted(SPECIALS, key=len, reverse=True))
    for m in re.finditer(pattern, text):
        ids += sp.encode(text[pos : m.start()]) + [SPECIALS[m.group()]]
        pos = m.end()
    return ids + sp.encode(text[pos:])


def reference_decode(sp, ids: list[int]) -> str:
    """InternLM2Tokenizer.decode(skip_special_tokens=True): sentencepiece's text of the rest, then transformers 4's
    clean_up_tokenization, which its convert_tokens_to_string always applies."""
    text = sp.decode([i for i in ids if i not in SPECIALS.values()])
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(a, b)
    return text


@pytest.mark.parametrize("add_dummy_prefix", [True, False])
def test_internlm2_tokenizer_equals_sentencepiece(internlm2_tok_dirs, add_dummy_prefix):
    d = internlm2_tok_dirs[add_dummy_prefix]
    tok = load_tokenizer(d)
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    assert type(tok).__name__ == "InternLM2Tokenizer" and load_tokenizer(str(d)) is tok
    for text in TRICKY + [build_prompt("What is in the image?", 1, num_image_token=3)]:
        ids = tok(text)["input_ids"]
        assert ids == reference_ids(sp, text), text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]  # BOS first, no EOS
        assert tok.decode(ids, skip_special_tokens=True) == reference_decode(sp, ids), text
    plain = "  tiger\t\tcat 🐯\n\n你好 "
    assert tok.decode(tok.encode(plain, add_special_tokens=False)) == plain
    assert any(sp.id_to_piece(i).startswith("<0x") for i in tok.encode("🦩", add_special_tokens=False))


def test_internlm2_tokenizer_ids_for_the_runner(internlm2_tok_dirs):
    tok = load_tokenizer(internlm2_tok_dirs[True])
    sp = tok.sp_model
    assert image_token_ids(tok) == {"img_start": 92544, "img_end": 92545, "img_context": 92546}
    assert {c: tok.convert_tokens_to_ids(c) for c in SPECIALS} == SPECIALS
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    assert stop_token_ids(tok) == (2, 92542)
    for c, i in SPECIALS.items():  # each one a single id, never split, skipped by decode when asked
        assert tok.encode(f"a{c}b", add_special_tokens=False) == sp.encode("a") + [i] + sp.encode("b")
        assert tok.decode([i]) == c and tok.decode([i], skip_special_tokens=True) == ""


def test_internlm2_tokenizer_needs_no_remote_code_and_says_what_is_missing(
    internlm2_tok_dirs, tmp_path, monkeypatch
):
    d = shutil.copytree(internlm2_tok_dirs[True], tmp_path / "tok")
    assert not list(d.glob("*.py"))  # auto_map names tokenization_internlm2.py, which is not there
    (d / "tokenizer.model").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.model"):
        load_tokenizer(d)
    shutil.copy(internlm2_tok_dirs[True] / "tokenizer.model", d)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    monkeypatch.delitem(sys.modules, "batchvl.internlm2_tokenizer", raising=False)
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        load_tokenizer(d, trust_remote_code=False)


# ---------------------------------------------------------------- a whole job on an InternLM2 checkpoint


@pytest.fixture(scope="module")
def internlm2_checkpoint(internlm2_tok_dirs, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(dir, reference): a tiny InternVL with an InternLM2 decoder in the OpenGVLab layout (InternVL2_5-8B's files,
    the tokenizer above), made from a transformers InternVL with a Llama decoder (the reference)."""
    from safetensors.torch import load_file, save_file
    from transformers import InternVLForConditionalGeneration

    root = tmp_path_factory.mktemp("internlm2_ckpt")
    torch.manual_seed(0)
    hf_cfg = tiny_hf_config(
        "300m", text="llama", vocab_size=INTERNLM2_VOCAB, image_token_id=SPECIALS["<IMG_CONTEXT>"]
    )
    hf = InternVLForConditionalGeneration(hf_cfg).eval()
    randomize_(hf)
    n_pieces = spm.SentencePieceProcessor(
        model_file=str(internlm2_tok_dirs[True] / "tokenizer.model")
    ).vocab_size()
    with torch.no_grad():  # ids no token has (between the pieces and the chat tokens) never win the argmax
        hf.lm_head.weight[n_pieces : SPECIALS["<|plugin|>"]] = 0.0
    hf.save_pretrained(root / "hf")
    og = to_opengvlab(root / "hf", root / "og")
    t = hf_cfg.text_config
    heads = (t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    save_file(llama_to_internlm2(load_file(og / "model.safetensors"), *heads), og / "model.safetensors")
    cfg = json.loads((og / "config.json").read_text())
    cfg["llm_config"] = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": False,
                         "vocab_size": INTERNLM2_VOCAB, "hidden_size": t.hidden_size,
                         "num_hidden_layers": t.num_hidden_layers, "num_attention_heads": t.num_attention_heads,
                         "num_key_value_heads": t.num_key_value_heads, "intermediate_size": t.intermediate_size,
                         "rope_theta": 1e6, "rms_norm_eps": t.rms_norm_eps, "max_position_embeddings": 4096,
                         "tie_word_embeddings": False}  # fmt: skip
    (og / "config.json").write_text(json.dumps(cfg))
    for f in internlm2_tok_dirs[
        True
    ].iterdir():  # replaces the Qwen ids to_opengvlab wrote in added_tokens.json
        shutil.copy(f, og)
    return og, hf


@pytest.mark.slow
def test_internlm2_checkpoint_job_matches_transformers(internlm2_checkpoint, tmp_path):
    og, hf = internlm2_checkpoint
    prompts = {f"t{i}": p for i, p in enumerate(TRICKY) if p.strip() and "<IMG_CONTEXT>" not in p}
    rows = [{"id": i, "prompt": p} for i, p in prompts.items()]
    rows.append(
        {"id": "tiger", "prompt": "What animal is this? 🐯", "image": str(SHARED_DATA / "tiger.jpeg")}
    )
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    job = load_job(REPO / "jobs/demo.yaml", [
        "model.preset=null", "model.weights=null", f"model.path={og}", "data.format=jsonl", f"data.path={path}",
        f"output.dir={tmp_path / 'run'}", "preprocess.max_tiles=1", "generation.max_new_tokens=5",
        "generation.ignore_eos=true",
    ])  # fmt: skip
    assert job.model.trust_remote_code is False and job.model.tokenizer is None
    summary = run_job(job)
    assert summary["successful_requests"] == len(rows) and summary["failed_requests"] == 0
    got = {r["id"]: r for r in read_rows(job.output.dir).to_pylist()}
    sp = spm.SentencePieceProcessor(model_file=str(og / "tokenizer.model"))
    pv = to_pixel_values(load_image(SHARED_DATA / "tiger.jpeg"), 1, 1)
    for r in rows:
        row, tiles = got[r["id"]], int("image" in r)
        want = reference_ids(sp, build_prompt(r["prompt"], tiles, 256))
        assert row["prompt_token_ids"] == want and row["num_tiles"] == tiles, r["id"]
        with torch.no_grad():
            pixels = {"pixel_values": pv} if tiles else {}
            out = hf.generate(input_ids=torch.tensor([want]), **pixels, max_new_tokens=5, min_new_tokens=5,
                              do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        ref = out[0, len(want) :].tolist()
        assert row["output_token_ids"] == ref, r["id"]
        assert row["output_text"] == reference_decode(sp, ref), r["id"]


# ---------------------------------------------------------------- the stand-ins of random-weight presets


def test_internlm2_stand_in_fits_the_presets():
    tok = load_tokenizer(None, llm_arch="internlm2")
    for name in ("internvl2_5-2b", "internvl2_5-8b", "internvl2_5-26b", "tiny-internlm2"):
        cfg = from_preset(name)
        assert cfg.llm.arch == "internlm2" and len(tok) == cfg.llm.vocab_size == INTERNLM2_VOCAB
        assert image_token_ids(tok)["img_context"] == cfg.image_token_id
    assert {c: tok.convert_tokens_to_ids(c) for c in SPECIALS} == SPECIALS
    assert stop_token_ids(tok) == (2, 92542)
    ids = tok(build_prompt("Describe <box>this</box> 🐯", 1, num_image_token=2))["input_ids"]
    assert ids[:2] == [1, 92543] and ids.count(92546) == 2 and ids.count(92551) == 1 and ids.count(1) == 1
    text = "Plain text, 中文 and emoji 🐯\n\n\tdone. "
    plain = tok.encode(text, add_special_tokens=False)
    assert max(plain) < SPECIALS["<|plugin|>"] and tok.decode(plain) == text
    assert tok.decode(tok(text + "<|im_end|>")["input_ids"], skip_special_tokens=True) == text


def test_internlm2_stand_in_lengths_match_qwen():
    """Prompts of the ShareGPT sample: the stand-in (Qwen's BPE cut to 92535 tokens) counts within 10% of Qwen."""
    spec = DataSpec(format="sharegpt", path=str(SHARED_DATA / "ShareGPT_V3_filtered_1000.json"))
    prompts = [r["prompt"] for r in records(spec) if r.get("prompt")]
    assert len(prompts) >= 900
    qwen, stand_in = load_tokenizer(None), load_tokenizer(None, llm_arch="internlm2")
    a = np.array([len(x) for x in qwen(prompts, add_special_tokens=False)["input_ids"]])
    ids = stand_in(prompts, add_special_tokens=False)["input_ids"]
    b = np.array([len(x) for x in ids])
    assert abs(b.sum() / a.sum() - 1) <= 0.10
    assert np.mean(np.abs(b / a - 1) <= 0.10) >= 0.95  # prompt by prompt too
    assert max(max(x) for x in ids) < SPECIALS["<|plugin|>"]  # text never becomes a chat or image token


@pytest.mark.slow
def test_internlm2_preset_job_runs_with_no_tokenizer_setting(tmp_path):
    """The runner gives an InternLM2 preset the InternLM2 stand-in (tiny-internlm2: the 2B/8B/26B presets' vocabulary
    and image token id)."""
    data = SHARED_DATA / "ShareGPT_V3_filtered_1000.json"
    job = load_job(REPO / "jobs/demo.yaml", [
        "model.preset=tiny-internlm2", "data.format=sharegpt", f"data.path={data}", "data.limit=3",
        f"data.image={SHARED_DATA / 'tiger.jpeg'}", f"output.dir={tmp_path / 'run'}", "preprocess.max_tiles=1",
        "generation.max_new_tokens=3",
    ])  # fmt: skip
    assert job.model.tokenizer is None
    assert run_job(job)["successful_requests"] == 3
    tok = load_tokenizer(None, llm_arch="internlm2")
    prompts = {r["id"]: r["prompt"] for r in records(job.data)}
    for row in read_rows(job.output.dir).to_pylist():
        assert row["error"] is None and row["num_tiles"] == 1
        assert row["prompt_token_ids"] == tok(build_prompt(prompts[row["id"]], 1, 256))["input_ids"]
        assert max(row["output_token_ids"]) < INTERNLM2_VOCAB
        assert row["output_text"] == tok.decode(row["output_token_ids"], skip_special_tokens=True)
