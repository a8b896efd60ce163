"""CPU-side row preparation: image decoding, InternVL dynamic tiling, prompt template and tokenization."""

from __future__ import annotations

import functools
import hashlib
import io
import os
import stat
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from batchvl.tokenizer import IMG_CONTEXT, IMG_END, IMG_START, image_token_ids, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_PLACEHOLDER = "<image>"  # InternVL chat(): each one in a question marks where the next image goes

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

_SIXTEEN_BIT = ("I", "I;16", "I;16L", "I;16B", "I;16N", "F")
MAX_IMAGE_BYTES = 64 * 2**20
# no token covers more characters than this (Qwen2.5's longest covers 128; NFC may merge up to ~3 characters into
# one), so a prompt longer than this many characters per allowed token is over-long without tokenizing it
MAX_CHARS_PER_TOKEN = 512
# decoded tiles each process keeps (TileMemo): 8 images of the default 13 tiles at most
MEMO_ENTRIES, MEMO_BYTES = 8, 64 * 2**20


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


@functools.lru_cache(maxsize=8)
def _lut_on(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """_normalize_lut on `device` in `dtype`, copied there once (each entry rounds as its normalized value would)."""
    return torch.from_numpy(_normalize_lut()).to(device, dtype)


def pixel_input(tiles: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ViT's input [N, 3, S, S] in `dtype`, on the tiles' own device: raw uint8 tiles [N, S, S, 3] go through
    ToTensor + ImageNet Normalize (a lookup table: bit for bit the same values); float tiles [N, 3, S, S], already
    normalized, are only cast."""
    if tiles.dtype != torch.uint8:
        return tiles.to(dtype)
    if tiles.dim() != 4 or tiles.shape[-1] != 3:
        raise ValueError(f"uint8 tiles must be [tiles, S, S, 3], got {list(tiles.shape)}")
    n, h, w, _ = tiles.shape
    lut = _lut_on(tiles.device, dtype)
    out = torch.empty((n, 3, h, w), dtype=dtype, device=tiles.device)
    for c in range(3):  # index_select: as fast as numpy's take on a CPU; int32 indices keep the scratch small
        out[:, c] = lut[c].index_select(0, tiles[..., c].reshape(-1).int()).view(n, h, w)
    return out


def to_pixel_values(
    image: Image.Image, min_num: int = 1, max_num: int = 12, image_size: int = 448, use_thumbnail: bool = True
) -> torch.Tensor:
    """Tiles as a float32 [tiles, 3, S, S] tensor, ToTensor + ImageNet Normalize (`pixel_input`)."""
    return pixel_input(torch.from_numpy(_tile_arrays(image, min_num, max_num, image_size, use_thumbnail)))


# ---------------------------------------------------------------- prompt


def with_placeholders(question: str, num_images: int) -> str:
    """The question with one '<image>' per image: as written, or prefixed as InternVL does (one image:
    '<image>\\n', several: 'Image-1: <image>\\nImage-2: <image>\\n'); ValueError if the counts differ."""
    found = question.count(IMAGE_PLACEHOLDER)
    if found == 0 and num_images == 1:
        return IMAGE_PLACEHOLDER + "\n" + question
    if found == 0 and num_images > 1:
        return "".join(f"Image-{i + 1}: {IMAGE_PLACEHOLDER}\n" for i in range(num_images)) + question
    if found != num_images:
        raise ValueError(f"the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) but the row has "
                         f"{num_images} image{'s' if num_images > 1 else ''}")  # fmt: skip
    return question


def build_prompt(
    question: str,
    num_tiles: int | list[int],
    num_image_token: int = 256,
    template: str = "internvl2_5",
    system_message: str | None = None,
) -> str:
    """The InternVL chat() query: each image's block (`num_tiles`: per image, or one image's) replaces the next
    '<image>', or the blocks are prefixed (see with_placeholders); no images: the question as it is."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; known: {sorted(TEMPLATES)}")
    sys_tpl, default_sys, user, assistant, sep = TEMPLATES[template]
    system = default_sys if system_message is None else system_message
    tiles = [num_tiles] if isinstance(num_tiles, int) else list(num_tiles)
    tiles = [t for t in tiles if t > 0]
    if tiles:
        question = with_placeholders(question, len(tiles))
        for t in tiles:
            block = IMG_START + IMG_CONTEXT * (num_image_token * t) + IMG_END
            question = question.replace(IMAGE_PLACEHOLDER, block, 1)
    return sys_tpl.format(system_message=system) + sep + user + question + sep + assistant


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
    max_tiles_per_row: int | None = (
        None  # a row's images share it: each gets at most max_tiles_per_row // images
    )
    max_image_bytes: int = MAX_IMAGE_BYTES  # an image file or bytes above this is an error row, never read

    def __post_init__(self) -> None:
        if not 1 <= self.min_tiles <= self.max_tiles:
            raise ValueError(f"need 1 <= min_tiles <= max_tiles, got {self.min_tiles}, {self.max_tiles}")
        if self.max_tiles_per_row is not None and self.max_tiles_per_row < 1:
            raise ValueError(f"max_tiles_per_row must be >= 1, got {self.max_tiles_per_row}")
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
    # raw uint8 tiles [tiles, S, S, 3] (`pixel_input` gives the ViT's input); None for a text-only row, or when every
    # image's features are in the engine's image cache (`cached`): the tiles need not cross to the engine
    pixel_values: torch.Tensor | None
    num_tiles: int
    num_image_tokens: int
    num_text_tokens: int
    image_key: str | None  # the row's images together (one image: its own key)
    images: tuple[tuple[str, int], ...] = ()  # (content key, tiles) of each image, in prompt order


class TileMemo:
    """Decoded tiles by content key, the least recently used dropped first: at most `entries` arrays and `max_bytes`
    bytes, so a dataset asking many questions about one image decodes it once per process."""

    def __init__(self, entries: int = MEMO_ENTRIES, max_bytes: int = MEMO_BYTES) -> None:
        self.entries, self.max_bytes = entries, max_bytes
        self.items: OrderedDict[str, np.ndarray] = OrderedDict()
        self.nbytes = 0

    def get(self, key: str) -> np.ndarray | None:
        tiles = self.items.get(key)
        if tiles is not None:
            self.items.move_to_end(key)
        return tiles

    def put(self, key: str, tiles: np.ndarray) -> None:
        """Keep `tiles` (made read-only: every later row shares them) unless larger than the whole memo."""
        tiles.flags.writeable = False
        if tiles.nbytes <= self.max_bytes and key not in self.items:
            self.items[key] = tiles
            self.nbytes += tiles.nbytes
            while len(self.items) > self.entries or self.nbytes > self.max_bytes:
                self.nbytes -= self.items.popitem(last=False)[1].nbytes


class Preprocessor:
    """Turns (prompt, image) rows into Prepared; picklable, loads its tokenizer once per process."""

    def __init__(
        self,
        cfg: PreprocessConfig,
        tokenizer_path: str | os.PathLike | None = None,
        trust_remote_code: bool = False,
        llm_arch: str = "qwen2",  # without a tokenizer path: whose stand-in tokenizer
    ):
        self.cfg = cfg
        self.tokenizer_path = None if tokenizer_path is None else os.fspath(tokenizer_path)
        self.trust_remote_code = trust_remote_code
        self.llm_arch = llm_arch
        self._tok: Any = None
        self._ctx_id = -1
        self._memo = TileMemo()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the tokenizer or the memo; the receiving process loads (and caches) its own."""
        return {**self.__dict__, "_tok": None, "_ctx_id": -1, "_memo": TileMemo()}

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, loaded on first use; ValueError if it lacks InternVL's image tokens."""
        if self._tok is None:
            tok = load_tokenizer(self.tokenizer_path, self.trust_remote_code, self.llm_arch)
            self._ctx_id = image_token_ids(tok)["img_context"]
            self._tok = tok
        return self._tok

    def _encode(self, question: str, tiles: list[int]) -> list[int]:
        """Token ids of the full prompt; each image block is tokenized with one context token, then expanded."""
        c = self.cfg
        text = build_prompt(question, [1] * len(tiles), 1, c.template, c.system_message)
        ids = list(self.tokenizer(text)["input_ids"])
        where = [i for i, t in enumerate(ids) if t == self._ctx_id]
        for at, t in zip(
            reversed(where), reversed(tiles), strict=True
        ):  # from the end: earlier places stay put
            ids[at : at + 1] = [self._ctx_id] * (c.num_image_token * t)
        return ids

    def _truncate(self, question: str, tiles: list[int], total: int) -> list[int]:
        """Cut the question's tail after its last image (whole tokens) until the prompt fits max_input_tokens."""
        tok, limit = self.tokenizer, self.cfg.max_input_tokens
        if tiles:
            question = with_placeholders(question, len(tiles))
        head, mark, tail = question.rpartition(IMAGE_PLACEHOLDER)
        q_ids = tok(tail, add_special_tokens=False)["input_ids"]
        keep = len(q_ids) - (total - limit)
        for _ in range(16):
            if keep < 1:
                break
            text = tok.decode(q_ids[:keep], skip_special_tokens=False).rstrip("\ufffd")
            ids = self._encode(head + mark + text, tiles) if text.strip() else []
            if ids and len(ids) <= limit:
                return ids
            keep -= max(1, len(ids) - limit)
        raise PreprocessError(
            f"prompt has {total} tokens > max_input_tokens={limit} and the question cannot be truncated to fit "
            f"(image and template tokens alone are about {total - len(q_ids)})"
        )

    def _pixels(self, image: Any, max_tiles: int) -> tuple[np.ndarray, str]:
        """One image's raw tiles (uint8 [tiles, S, S, 3]; maybe the memo's own, read-only) and its content key
        (the encoded file, or the pixels, and the tiling). Encoded images are keyed before decoding, so an image
        seen again in this process is not decoded again."""
        c = self.cfg
        min_tiles = min(c.min_tiles, max_tiles)
        data, img = _read_source(image, c.max_image_bytes)
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{c.image_size},{min_tiles},{max_tiles},{int(c.use_thumbnail)};".encode())
        if data is not None:
            h.update(b"file;")
            h.update(data)
            key = h.hexdigest()
            tiles = self._memo.get(key)
            if tiles is None:
                img = _decode(img, c.max_image_pixels)  # a bad image raises here, every time: nothing is kept
                tiles = _tile_arrays(img, min_tiles, max_tiles, c.image_size, c.use_thumbnail)
                self._memo.put(key, tiles)
            return tiles, key
        img = _decode(img, c.max_image_pixels)
        h.update(f"pixels;{img.width}x{img.height};".encode())
        h.update(img.tobytes())
        return _tile_arrays(img, min_tiles, max_tiles, c.image_size, c.use_thumbnail), h.hexdigest()

    def _images(
        self, image: Any, cached: Collection[str] = ()
    ) -> tuple[torch.Tensor | None, tuple[tuple[str, int], ...]]:
        """All images' raw tiles (uint8 [tiles, S, S, 3], a fresh tensor), concatenated in order, or None when every
        image's key is in `cached`; and each image's (key, tiles)."""
        images = list(image) if isinstance(image, (list, tuple)) else [] if image is None else [image]
        if not images:
            return None, ()
        c, n = self.cfg, len(images)
        max_tiles = c.max_tiles if c.max_tiles_per_row is None else min(c.max_tiles, c.max_tiles_per_row // n)
        if max_tiles < 1:
            raise PreprocessError(f"{n} images but max_tiles_per_row={c.max_tiles_per_row}: "
                                  "not one tile for each")  # fmt: skip
        tiles, keys = [], []
        for i, src in enumerate(images):
            if src is None or (isinstance(src, str) and not src.strip()):
                raise PreprocessError(f"image {i + 1} of {n} is empty")
            try:
                px, key = self._pixels(src, max_tiles)
            except PreprocessError as e:
                raise PreprocessError(f"image {i + 1} of {n}: {e}" if n > 1 else str(e)) from None
            tiles.append(px)
            keys.append((key, len(px)))
        if all(key in cached for key, _ in keys):
            return None, tuple(keys)
        # a copy, even of one image: the memo's tiles stay as they are whatever callers do with theirs
        return torch.from_numpy(np.concatenate(tiles)), tuple(keys)

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

    def __call__(self, prompt: str, image: Any, cached: Collection[str] = ()) -> Prepared:
        """Prepare one row (`image`: a path, bytes, a PIL image, a list of them, or None); raises PreprocessError
        with the reason for a bad row. cached: image keys whose features the engine holds (no tiles are sent for a
        row whose images all are)."""
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
        pixel_values, images = self._images(image, cached)
        try:
            prompt = with_placeholders(prompt, len(images)) if images else prompt
        except ValueError as e:
            raise PreprocessError(str(e)) from None
        tiles = [t for _, t in images]
        ids = self._encode(prompt, tiles)
        n_img = c.num_image_token * sum(tiles)
        if len(ids) > c.max_input_tokens:
            if c.overlong != "truncate":
                raise PreprocessError(
                    f"prompt has {len(ids)} tokens ({n_img} image + {len(ids) - n_img} text) "
                    f"> max_input_tokens={c.max_input_tokens}"
                )
            ids = self._truncate(prompt, tiles, len(ids))
        key = None if not images else images[0][0] if len(images) == 1 else _joint_key(images)
        return Prepared(ids, pixel_values, sum(tiles), n_img, len(ids) - n_img, key, images)


def _joint_key(images: tuple[tuple[str, int], ...]) -> str:
    """A row's key for several images: the hash of theirs, in order."""
    return hashlib.blake2b(";".join(k for k, _ in images).encode(), digest_size=16).hexdigest()
