"""InternLM2's tokenizer from a checkpoint's tokenizer.model, without its remote code (tokenization_internlm2.py).

It behaves as InternLM2Tokenizer does: the text between added tokens goes through sentencepiece itself (its
whitespace, normalization and byte-fallback rules, exactly), added tokens are never split, <s> starts every
encoding and no </s> ends it. Its own module because it needs the `sentencepiece` package, which only InternLM2
checkpoints (InternVL2.5 2B, 8B, 26B) do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

try:
    import sentencepiece
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError(
        "this checkpoint's tokenizer is InternLM2's sentencepiece model (tokenizer.model), which needs the "
        "sentencepiece package: pip install 'batchvl[internlm2]' (or pip install sentencepiece)"
    ) from None
from transformers import AddedToken, PreTrainedTokenizer

# transformers 4's clean_up_tokenization, which InternLM2Tokenizer's decode applies whatever the config says
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip


class InternLM2Tokenizer(PreTrainedTokenizer):
    """A sentencepiece model plus the checkpoint's added tokens (InternLM2's chat tokens, InternVL's image tokens)."""

    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self, vocab_file: str, add_bos_token: bool = True, add_eos_token: bool = False, **kwargs: Any
    ):
        self.vocab_file = vocab_file
        self.sp_model = sentencepiece.SentencePieceProcessor(model_file=vocab_file)
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp_model.get_piece_size()

    def get_vocab(self) -> dict[str, int]:
        vocab = {self.sp_model.id_to_piece(i): i for i in range(self.vocab_size)}
        return vocab | self.added_tokens_encoder

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return self.sp_model.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp_model.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp_model.id_to_piece(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Pieces decode through sentencepiece, each run between added tokens on its own (as InternLM2's does);
        added tokens stay verbatim."""
        added, out, run = self.added_tokens_encoder, [], []
        for t in tokens:
            if t in added:
                out += [self.sp_model.decode_pieces(run), t]
                run = []
            else:
                run.append(t)
        text = "".join(out) + self.sp_model.decode_pieces(run)
        for a, b in _CLEAN_UP:
            text = text.replace(a, b)
        return text

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None):
        bos = [self.bos_token_id] if self.add_bos_token else []
        eos = [self.eos_token_id] if self.add_eos_token else []
        return bos + token_ids_0 + eos + ([] if token_ids_1 is None else bos + token_ids_1 + eos)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        path = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + "tokenizer.model")
        path.write_bytes(self.sp_model.serialized_model_proto())
        return (str(path),)


def load_internlm2_tokenizer(root: Path) -> InternLM2Tokenizer:
    """The tokenizer of an InternLM2 checkpoint directory: tokenizer.model, and the added and special tokens (with
    their ids) from tokenizer_config.json, added_tokens.json and special_tokens_map.json."""
    model = root / "tokenizer.model"
    if not model.is_file():
        raise FileNotFoundError(
            f"{root}: tokenizer_config.json names InternLM2Tokenizer but there is no tokenizer.model"
        )
    cfg = _read_json(root / "tokenizer_config.json")
    special_map = _read_json(root / "special_tokens_map.json")
    named = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
    for key, default in named.items():
        named[key] = _content(special_map.get(key) or cfg.get(key)) or default
    listed = special_map.get("additional_special_tokens") or cfg.get("additional_special_tokens") or []
    listed = {_content(t) for t in listed}
    added = {int(i): _added_token(t) for i, t in (cfg.get("added_tokens_decoder") or {}).items()}
    for content, i in _read_json(root / "added_tokens.json").items():
        added.setdefault(int(i), AddedToken(content, normalized=False, special=content in listed))
    # decode(skip_special_tokens=True) skips every special added token, listed or not
    extra = sorted(({t.content for t in added.values() if t.special} | listed) - set(named.values()))
    return InternLM2Tokenizer(
        str(model),
        add_bos_token=bool(cfg.get("add_bos_token", True)),
        add_eos_token=bool(cfg.get("add_eos_token", False)),
        added_tokens_decoder=added,
        additional_special_tokens=extra,
        clean_up_tokenization_spaces=False,
        **named,
    )


def _added_token(entry: dict) -> AddedToken:
    """An added_tokens_decoder entry of tokenizer_config.json."""
    flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
    return AddedToken(entry["content"], **{k: bool(entry[k]) for k in flags if k in entry})


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _content(token: str | dict | None) -> str | None:
    """A special token as tokenizer configs write it: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token
