"""Tests for batchvl.preprocess: image decoding, InternVL tiling, prompt template, tokenizer, row preparation."""

from __future__ import annotations

import io
import os
import pickle
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import save_image
from PIL import Image

from batchvl import preprocess as pp
from batchvl.preprocess import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    IMG_CONTEXT,
    PreprocessConfig,
    PreprocessError,
    Preprocessor,
)

TIGER = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tiger.jpeg"
SYSTEM = "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"


def noise_image(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth-ish random RGB image (noise plus gradients) so resizes have real content."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w, 1), yy * 255 / max(h, 1), (xx + yy) % 256], -1)
    arr = np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB").convert(mode)


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    """Image -> encoded file bytes."""
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height (8-bit RGB) but holds no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def reference_normalize(tiles: list[Image.Image]) -> torch.Tensor:
    """torchvision ToTensor + Normalize(ImageNet), re-derived independently."""
    arr = np.stack([np.asarray(t, dtype=np.float32) / 255.0 for t in tiles])
    arr = (arr - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD, np.float32)
    return torch.from_numpy(arr).permute(0, 3, 1, 2)


def brute_force_grid(w: int, h: int, mn: int, mx: int, size: int = 448) -> tuple[int, int]:
    """InternVL's find_closest_aspect_ratio written out again: set of grids sorted by area, sequential scan."""
    grids = set(
        (i, j)
        for n in range(mn, mx + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if mn <= i * j <= mx
    )
    best, best_diff = (1, 1), float("inf")
    for i, j in sorted(grids, key=lambda g: g[0] * g[1]):
        d = abs(w / h - i / j)
        if d < best_diff:
            best, best_diff = (i, j), d
        elif d == best_diff and w * h > 0.5 * size * size * i * j:
            best = (i, j)
    return best


@pytest.fixture(scope="module")
def tok():
    """The built-in InternVL2.5 tokenizer (built once per process)."""
    return pp.load_tokenizer()


@pytest.fixture(scope="module")
def pre(tok) -> Preprocessor:
    """A default Preprocessor."""
    return Preprocessor(PreprocessConfig())


# ---------------------------------------------------------------- grids and tiles


def test_find_grid_known_sizes():
    assert pp.find_grid(278, 182) == (3, 2)
    assert pp.find_grid(448, 448) == (1, 1)
    assert pp.find_grid(1, 1) == (1, 1)
    assert pp.to_pixel_values(noise_image(448, 448)).shape == (1, 3, 448, 448)  # one tile: no thumbnail
    assert pp.to_pixel_values(Image.new("RGB", (1, 1), (9, 9, 9))).shape == (1, 3, 448, 448)
    assert pp.to_pixel_values(noise_image(448, 448), use_thumbnail=False).shape[0] == 1


@pytest.mark.parametrize(
    "w,h", [(4000, 300), (300, 4000), (1, 1), (1, 1000), (1000, 1), (278, 182), (1000, 999)]
)
@pytest.mark.parametrize("mn,mx", [(1, 12), (1, 6), (2, 8), (4, 4)])
def test_find_grid_brute_force(w, h, mn, mx):
    cols, rows = pp.find_grid(w, h, mn, mx)
    assert mn <= cols * rows <= mx
    best = min(abs(w / h - i / j) for i in range(1, mx + 1) for j in range(1, mx + 1) if mn <= i * j <= mx)
    assert abs(w / h - cols / rows) == best
    assert (cols, rows) == brute_force_grid(w, h, mn, mx)


def test_find_grid_extremes_and_tie_break():
    assert pp.find_grid(4000, 300) == (12, 1) and pp.find_grid(300, 4000) == (1, 12)
    # ratio 2: (2,1) and (4,2) tie; the larger grid wins only if area > 0.5 * 448^2 * 8
    assert pp.find_grid(896, 448) == (2, 1)
    assert pp.find_grid(1792, 896) == (4, 2)
    # InternVL iterates a set sorted by area, so same-area ties resolve in set order: (4,1) before (2,2) here;
    # transformers' get_optimal_tiled_canvas orders (2,2) first and answers (2,2) / (4,1) instead
    assert pp.find_grid(5, 2, 4, 4) == (4, 1) and pp.find_grid(5000, 2000, 4, 4) == (2, 2)
    with pytest.raises(ValueError):
        pp.find_grid(10, 10, 3, 2)


def test_find_grid_matches_transformers_canvas():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    rng = np.random.default_rng(1)
    for w, h in rng.integers(1, 6000, size=(2000, 2)).tolist():
        for mx in (6, 12):
            assert pp.find_grid(w, h, 1, mx) == get_optimal_tiled_canvas((h, w), (448, 448), 1, mx), (
                w,
                h,
                mx,
            )


def test_tiles_row_major_and_thumbnail():
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]
    img = Image.new("RGB", (3 * 64, 2 * 64))
    for k, c in enumerate(colors):  # 3 cols x 2 rows of flat blocks
        img.paste(c, ((k % 3) * 64, (k // 3) * 64, (k % 3 + 1) * 64, (k // 3 + 1) * 64))
    tiles = pp.dynamic_tiles(img, image_size=32)
    assert len(tiles) == 7 and all(t.size == (32, 32) for t in tiles)
    for k, c in enumerate(colors):
        assert tiles[k].getpixel((16, 16)) == c
    assert (
        np.abs(np.asarray(tiles[6]) - np.asarray(img.resize((32, 32), Image.Resampling.BICUBIC))).max() == 0
    )
    assert len(pp.dynamic_tiles(img, image_size=32, use_thumbnail=False)) == 6


@pytest.mark.parametrize("size", [(278, 182), (640, 200), (448, 448), (1200, 1200), (3, 7)])
def test_pixel_values_match_transformers(size):
    # The slow PIL-backed GotOcr2ImageProcessorPil is the one to match: it resizes with PIL bicubic like
    # InternVL's torchvision Resize on PIL images (the fast processor needs torchvision and resizes tensors).
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    hf = GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448},
        crop_to_patches=True,
        min_patches=1,
        max_patches=12,
        image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD),
    )
    img = noise_image(*size, seed=sum(size))
    ref = hf(img, return_tensors="pt")["pixel_values"]
    ours = pp.to_pixel_values(img)
    assert ours.dtype == torch.float32 and ours.is_contiguous()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref.to(torch.float32), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, reference_normalize(pp.dynamic_tiles(img)), atol=1e-6, rtol=0)


def lut_reference(tiles: np.ndarray) -> torch.Tensor:
    """The float tiles as to_pixel_values made them before the engine normalized raw tiles: numpy's take through the
    lookup table, channel by channel."""
    lut = pp._normalize_lut()
    out = np.empty((len(tiles), 3, *tiles.shape[1:3]), dtype=np.float32)
    for c in range(3):
        np.take(lut[c], tiles[..., c], out=out[:, c])
    return torch.from_numpy(out)


@pytest.mark.parametrize("which", ["tiger", "odd"])
def test_raw_tiles_normalize_bit_for_bit(which):
    """What the engine does with a row's raw uint8 tiles (on its device; here the CPU) equals to_pixel_values and
    the lookup table the float tiles used to be made with, bit for bit; in bfloat16 too, as a cast of them."""
    if which == "tiger" and not TIGER.is_file():
        pytest.skip("../shared/data is absent")
    img = pp.load_image(TIGER) if which == "tiger" else noise_image(333, 217, seed=5)
    raw = pp._tile_arrays(img, 1, 12, 448, True)
    assert raw.dtype == np.uint8 and raw.shape[1:] == (448, 448, 3)
    got = pp.pixel_input(torch.from_numpy(raw))
    assert got.dtype == torch.float32 and got.shape == (len(raw), 3, 448, 448) and got.is_contiguous()
    assert torch.equal(got, pp.to_pixel_values(img))
    assert torch.equal(got, lut_reference(raw))
    torch.testing.assert_close(got, reference_normalize(pp.dynamic_tiles(img)), atol=1e-6, rtol=0)
    assert torch.equal(pp.pixel_input(torch.from_numpy(raw), torch.bfloat16), got.to(torch.bfloat16))
    assert pp.pixel_input(got) is got  # normalized float tiles pass as they are
    assert torch.equal(pp.pixel_input(got, torch.bfloat16), got.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[tiles, S, S, 3\]"):
        pp.pixel_input(torch.from_numpy(raw).permute(0, 3, 1, 2))  # uint8 in the float layout


def counting_decode(monkeypatch) -> list:
    """Count the calls to the decoder (`_decode`)."""
    calls, real = [], pp._decode
    monkeypatch.setattr(pp, "_decode", lambda *a: calls.append(1) or real(*a))
    return calls


def test_memo_decodes_an_image_once(monkeypatch):
    png = encode(noise_image(700, 300, seed=3))
    ref = pp.to_pixel_values(pp.load_image(png), 1, 4)
    calls = counting_decode(monkeypatch)
    pre = Preprocessor(PreprocessConfig(max_tiles=4))
    first = pre("What is it?", png)
    again = pre("Another question", png)
    assert len(calls) == 1 and again.image_key == first.image_key
    assert again.pixel_values.dtype == torch.uint8 and torch.equal(again.pixel_values, first.pixel_values)
    assert torch.equal(pp.pixel_input(first.pixel_values), ref)
    first.pixel_values.zero_()  # a caller writing to its tiles leaves the memo's as they were
    assert torch.equal(pre("Third", [png, png]).pixel_values, torch.cat([again.pixel_values] * 2))
    assert len(calls) == 1
    pre("A fourth", noise_image(700, 300, seed=3))  # a PIL image is already decoded: no key before decoding
    assert len(calls) == 2 and len(pre._memo.items) == 1
    assert not pickle.loads(pickle.dumps(pre))._memo.items  # each worker keeps its own


def test_memo_keeps_no_failed_image(monkeypatch):
    calls = counting_decode(monkeypatch)
    pre = Preprocessor(PreprocessConfig())
    jpeg = encode(noise_image(256, 256), "JPEG", quality=95)
    for _ in range(2):
        with pytest.raises(PreprocessError, match="truncated"):
            pre("What is it?", jpeg[: len(jpeg) // 2])
    assert len(calls) == 2 and not pre._memo.items
    with pytest.raises(PreprocessError, match="not an image"):
        pre("What is it?", os.urandom(2000))
    assert not pre._memo.items


def test_memo_is_bounded():
    memo = pp.TileMemo(entries=3, max_bytes=1000)
    arrays = {k: np.zeros(n, np.uint8) for k, n in zip("abcde", (100, 200, 300, 400, 1001), strict=True)}
    for k in "abc":
        memo.put(k, arrays[k])
    assert memo.get("a") is arrays["a"]  # now the most recently used
    memo.put("d", arrays["d"])  # 4 entries: the least recently used (b) goes
    assert list(memo.items) == ["c", "a", "d"] and memo.nbytes == 800
    memo.put("e", arrays["e"])  # larger than the whole memo: not kept
    assert "e" not in memo.items and memo.nbytes == 800
    memo.put("b", arrays["b"])  # 1000 bytes in 3 entries: c goes for the entry bound
    assert list(memo.items) == ["a", "d", "b"] and memo.nbytes == 700
    memo.put("f", np.zeros(600, np.uint8))  # the byte bound: a and d go
    assert list(memo.items) == ["b", "f"] and memo.nbytes == 800
    assert not arrays["a"].flags.writeable  # what the memo held is never written to


def test_memo_in_a_preprocessor_stays_bounded():
    pre = Preprocessor(PreprocessConfig(max_tiles=1))
    for i in range(pp.MEMO_ENTRIES + 3):
        pre("What is it?", encode(Image.new("RGB", (8, 8), (i, 0, 0))))
    assert len(pre._memo.items) == pp.MEMO_ENTRIES
    assert pre._memo.nbytes == pp.MEMO_ENTRIES * 448 * 448 * 3 <= pp.MEMO_BYTES


# ---------------------------------------------------------------- images


def test_load_image_errors(tmp_path):
    with pytest.raises(PreprocessError, match="not found"):
        pp.load_image(tmp_path / "nope.jpg")
    (tmp_path / "empty.jpg").write_bytes(b"")
    with pytest.raises(PreprocessError, match="empty"):
        pp.load_image(str(tmp_path / "empty.jpg"))
    with pytest.raises(PreprocessError, match="empty"):
        pp.load_image(b"")
    jpeg = encode(noise_image(256, 256), "JPEG", quality=95)
    with pytest.raises(PreprocessError, match="truncated"):
        pp.load_image(jpeg[: len(jpeg) // 2])
    with pytest.raises(PreprocessError, match="not an image"):
        pp.load_image(os.urandom(2000))
    with pytest.raises(PreprocessError, match="too large"):
        pp.load_image(png_header_only(50_000, 50_000))
    with warnings.catch_warnings():  # 108 Mpx: PIL only warns; our limit must refuse before decoding
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(PreprocessError, match="too large: 12000x9000"):
            pp.load_image(png_header_only(12_000, 9_000))
    with pytest.raises(PreprocessError, match="max_image_pixels=100"):
        pp.load_image(encode(noise_image(20, 20)), max_image_pixels=100)
    with pytest.raises(PreprocessError, match="unsupported image source"):
        pp.load_image(12345)  # type: ignore[arg-type]
    assert pp.load_image(encode(noise_image(10, 10)), max_image_pixels=100).size == (10, 10)


def test_load_image_modes():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    out = pp.load_image(encode(rgba))
    assert (
        out.mode == "RGB" and out.getpixel((1, 1)) == (255, 255, 255) and out.getpixel((0, 0)) == (10, 20, 30)
    )
    la = pp.load_image(encode(Image.new("LA", (4, 4), (0, 0))))
    assert la.getpixel((0, 0)) == (255, 255, 255)
    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    assert pp.load_image(encode(pal)).getpixel((0, 0)) == (200, 100, 50)
    pal.info["transparency"] = 1
    assert pp.load_image(encode(pal, transparency=1)).getpixel((0, 0)) == (255, 255, 255)
    assert pp.load_image(encode(Image.new("L", (4, 4), 77))).getpixel((0, 0)) == (77, 77, 77)
    r, g, b = pp.load_image(
        encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=100)
    ).getpixel((4, 4))
    assert r > 240 and g < 15 and b < 15
    i16 = Image.fromarray(np.array([[65535, 32896], [0, 257]], dtype=np.uint16))
    got = np.asarray(pp.load_image(encode(i16)))[..., 0]
    assert got.tolist() == [[255, 128], [0, 1]]
    dark = pp.load_image(encode(Image.fromarray(np.array([[200, 1000]], dtype=np.uint16))))
    assert np.asarray(dark)[..., 0].tolist() == [[1, 4]]  # 16-bit data is always scaled, even when dark
    assert pp.load_image(Image.new("1", (3, 3), 1)).getpixel((0, 0)) == (255, 255, 255)
    assert pp.load_image(Image.new("F", (3, 3), 0.5)).getpixel((0, 0)) == (128, 128, 128)
    for mode in ("L", "P", "RGBA", "CMYK", "LA", "I;16", "YCbCr"):
        pv = pp.to_pixel_values(pp.load_image(noise_image(30, 20).convert(mode)))
        assert pv.shape == (7, 3, 448, 448) and torch.isfinite(pv).all()


def test_exif_orientation_applied():
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # stored image must be rotated 90 degrees clockwise for display
    out = pp.load_image(encode(img, "JPEG", quality=100, exif=exif))
    assert out.size == (20, 40)
    top, bottom = out.getpixel((10, 3)), out.getpixel((10, 36))
    assert top[0] > 200 and top[2] < 60 and bottom[2] > 200 and bottom[0] < 60
    assert pp.load_image(encode(img, "JPEG", quality=100)).size == (40, 20)


# ---------------------------------------------------------------- prompt and tokenizer


def test_build_prompt_exact():
    head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    assert pp.build_prompt("Hi?", 0) == head + "Hi?" + tail
    block = "<img>" + IMG_CONTEXT * 6 + "</img>"
    assert pp.build_prompt("Hi?", 3, num_image_token=2) == head + block + "\nHi?" + tail
    with pytest.raises(ValueError, match="the prompt has 2 <image> placeholder.s. but the row has 1 image"):
        pp.build_prompt("A <image> B <image>", 3, 2)  # (the second one once stayed in the prompt as text)
    block1 = "<img>" + IMG_CONTEXT * 2 + "</img>"
    assert pp.build_prompt("A <image> B <image>", [3, 1], 2) == head + "A " + block + " B " + block1 + tail
    two = pp.build_prompt("Hi?", [3, 1], 2)  # InternVL's multi-image convention
    assert two == head + "Image-1: " + block + "\nImage-2: " + block1 + "\nHi?" + tail
    assert pp.build_prompt("x <image>", 0) == head + "x <image>" + tail  # text-only: placeholder stays text
    assert pp.build_prompt("q", 0, system_message="").startswith(
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user"
    )
    assert pp.build_prompt("q", 0, system_message="Be brief.").startswith(
        "<|im_start|>system\nBe brief.<|im_end|>"
    )
    with pytest.raises(ValueError, match="unknown template"):
        pp.build_prompt("q", 0, template="nope")


def test_builtin_tokenizer_ids(tok):
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|file_sep|>")
    }
    assert ids == {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|file_sep|>": 151664,
    }
    names = ["<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>"]
    assert [tok.convert_tokens_to_ids(t) for t in names] == list(range(151665, 151674))
    assert len(tok) == 151674 and tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    assert tok.encode("<img><IMG_CONTEXT><IMG_CONTEXT></img>", add_special_tokens=False) == [
        151665,
        151667,
        151667,
        151666,
    ]
    assert tok("<think>")["input_ids"] != [151667]  # Qwen3's tokens at these ids are gone
    assert pp.image_token_ids(tok) == {"img_start": 151665, "img_end": 151666, "img_context": 151667}
    for text in ["Hello, world!", "  spaced\n\nlines\t tab", "中文和 emoji 🐯 mixed", "a<b>c </d> 1234567"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert pp.load_tokenizer() is tok  # cached per process


def test_load_tokenizer_bad_dirs(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        pp.load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        pp.load_tokenizer(str(tmp_path))


def test_load_tokenizer_from_checkpoint_dir(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = pp.load_tokenizer(str(tmp_path))
    assert pp.image_token_ids(loaded) == pp.image_token_ids(tok)
    text = pp.build_prompt("What is this?", 1, num_image_token=4)
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]


# ---------------------------------------------------------------- rows


def test_tiger_row(pre, tok):
    if not TIGER.is_file():
        pytest.skip("../shared/data is absent")
    out = pre("Please describe the image shortly.", str(TIGER))
    assert out.num_tiles == 7 and out.pixel_values.shape == (7, 448, 448, 3)
    assert torch.equal(pp.pixel_input(out.pixel_values), pp.to_pixel_values(pp.load_image(TIGER)))
    assert out.input_ids.count(151667) == 1792 == out.num_image_tokens
    assert out.num_text_tokens == len(out.input_ids) - 1792
    # the spliced ids equal tokenizing InternVL's full chat() query in one go
    assert out.input_ids == tok(pp.build_prompt("Please describe the image shortly.", 7))["input_ids"]
    assert out.input_ids[0] == 151644 and out.input_ids[-3:] == tok.encode("<|im_start|>assistant\n")
    start = out.input_ids.index(151665)
    assert out.input_ids[start + 1793] == 151666 and out.input_ids.count(151665) == 1
    assert out.image_key == pre("Another question", TIGER.read_bytes()).image_key


def test_text_only_row(pre, tok):
    out = pre("What is 2+2?", None)
    assert (
        out.pixel_values is None
        and out.num_tiles == 0
        and out.num_image_tokens == 0
        and out.image_key is None
    )
    assert 151665 not in out.input_ids and 151667 not in out.input_ids
    assert tok.decode(out.input_ids) == pp.build_prompt("What is 2+2?", 0)
    assert out.num_text_tokens == len(out.input_ids)
    assert pre("What is 2+2?", "").input_ids == out.input_ids  # an empty path column means no image


def test_image_key(pre, tmp_path):
    a, b = encode(noise_image(100, 60, seed=1)), encode(noise_image(100, 60, seed=2))
    (tmp_path / "a.png").write_bytes(a)
    key = pre("q", a).image_key
    assert key and key == pre("other prompt", str(tmp_path / "a.png")).image_key
    assert key != pre("q", b).image_key
    assert key != Preprocessor(PreprocessConfig(max_tiles=4))("q", a).image_key
    pil_key = pre("q", noise_image(100, 60, seed=1)).image_key
    assert (
        pil_key
        and pil_key
        == pre("q", noise_image(100, 60, seed=1)).image_key
        != pre("q", noise_image(9, 9)).image_key
    )


def test_row_errors(pre, tmp_path):
    for prompt in ("", "   \n\t", None):
        with pytest.raises(PreprocessError, match="^empty prompt$"):
            pre(prompt, None)  # type: ignore[arg-type]
    with pytest.raises(PreprocessError, match="not text"):
        pre(42, None)  # type: ignore[arg-type]
    with pytest.raises(PreprocessError, match="not found"):
        pre("q", str(tmp_path / "missing.png"))
    with pytest.raises(PreprocessError, match="truncated"):
        jpeg = encode(noise_image(64, 64), "JPEG")
        pre("q", jpeg[: len(jpeg) // 2])
    with pytest.raises(PreprocessError, match="reserved image token"):
        pre(f"sneaky {IMG_CONTEXT}", None)
    assert issubclass(PreprocessError, ValueError)


def test_overlong_error(tok):
    small = Preprocessor(PreprocessConfig(max_input_tokens=60))
    with pytest.raises(
        PreprocessError, match=r"prompt has \d+ tokens \(0 image \+ \d+ text\) > max_input_tokens=60"
    ):
        small("word " * 200, None)
    img = Preprocessor(PreprocessConfig(max_input_tokens=1000))
    with pytest.raises(PreprocessError, match=r"\(1792 image \+ \d+ text\) > max_input_tokens=1000"):
        img("q", noise_image(278, 182))


def test_overlong_truncate(tok):
    full = Preprocessor(PreprocessConfig())("Count: " + " ".join(str(i) for i in range(400)), None)
    cut = Preprocessor(PreprocessConfig(max_input_tokens=80, overlong="truncate"))
    out = cut("Count: " + " ".join(str(i) for i in range(400)), None)
    assert len(full.input_ids) > 80 and 75 <= len(out.input_ids) <= 80
    text = tok.decode(out.input_ids)
    assert text.startswith(pp.build_prompt("Count: 0 1 2", 0).split("Count")[0] + "Count: 0 1 2")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # with an image: image tokens are never cut, only the question
    limit = 256 + 60
    img = Preprocessor(PreprocessConfig(max_input_tokens=limit, overlong="truncate"))
    out = img("Describe " * 300, noise_image(448, 448))
    assert out.num_tiles == 1 and out.input_ids.count(151667) == 256 and len(out.input_ids) <= limit
    assert out.num_text_tokens == len(out.input_ids) - 256
    assert tok.decode(out.input_ids).count("Describe") >= 5
    with pytest.raises(PreprocessError, match="cannot be truncated"):
        Preprocessor(PreprocessConfig(max_input_tokens=200, overlong="truncate"))(
            "q " * 50, noise_image(448, 448)
        )


def test_config_validation():
    for bad in ({"overlong": "drop"}, {"min_tiles": 0}, {"min_tiles": 5, "max_tiles": 4}, {"template": "x"}):
        with pytest.raises(ValueError):
            PreprocessConfig(**bad)


def test_preprocessor_pickles_without_tokenizer(pre):
    pre("warm up", None)
    blob = pickle.dumps(pre)
    assert len(blob) < 10_000
    clone = pickle.loads(blob)
    assert clone("hello", noise_image(64, 64)).input_ids == pre("hello", noise_image(64, 64)).input_ids


def _in_thread(fn, timeout: float = 10.0):
    """fn()'s result or exception, failing the test (not hanging it) when fn blocks."""
    import threading

    box: dict = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "blocked"
    return box


def test_devices_fifos_dirs_and_oversized_files_are_refused_before_reading(pre, tmp_path):
    """/dev/zero never ends and a FIFO blocks forever: both must fail at once (issue 27)."""
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        box = _in_thread(lambda p=path: pre("q", p))
        assert isinstance(box.get("err"), PreprocessError) and "not a regular file" in str(box["err"]), path
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate(3 * 2**20)  # sparse: its size says too large, nothing needs to be read
    small = Preprocessor(PreprocessConfig(max_image_bytes=2**20))
    with pytest.raises(PreprocessError, match=r"has 3145728 bytes > preprocess.max_image_bytes=1048576"):
        small("q", str(big))
    with pytest.raises(PreprocessError, match="max_image_bytes"):
        small("q", b"\0" * (2**20 + 1))
    ok = tmp_path / "ok.png"
    ok.write_bytes(encode(noise_image(32, 32)))
    assert small("q", str(ok)).num_tiles == 1


class _CountingTokenizer:
    """The real tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def __call__(self, text, **kw):
        self.lengths.append(len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_huge_prompt_is_refused_or_cut_without_tokenizing_it_whole(tok):
    """A prompt of a few MB (the 49 MB case of issue 27, smaller): rejected from its length in characters."""
    huge = "word " * 1_000_000  # 5 MB
    for overlong in ("error", "truncate"):
        pre = Preprocessor(PreprocessConfig(max_input_tokens=1000, overlong=overlong))
        pre._tok, pre._ctx_id = _CountingTokenizer(tok), tok.convert_tokens_to_ids(IMG_CONTEXT)
        if overlong == "error":
            with pytest.raises(PreprocessError, match=r"5000000 characters, more than max_input_tokens=1000"):
                pre(huge, None)
            assert pre._tok.lengths == []  # never tokenized
        else:
            assert len(pre(huge, None).input_ids) == 1000
            assert max(pre._tok.lengths) <= 1000 * pp.MAX_CHARS_PER_TOKEN + 500  # the cut question + template


def test_no_tiles_for_a_row_whose_images_are_all_cached(tmp_path):
    """`cached` names image keys the engine holds: a row with only those gets no tiles, and the same ids, images and
    tile counts; a row with any other image gets all its tiles."""
    a, b = save_image(tmp_path / "a.png"), save_image(tmp_path / "b.png", size=(300, 90))
    pre = Preprocessor(PreprocessConfig(max_tiles=4))
    full = pre("What is this?", str(a))
    key = full.images[0][0]
    light = pre("What is this?", str(a), cached={key})
    assert light.pixel_values is None and full.pixel_values is not None
    assert (light.input_ids, light.images, light.num_tiles, light.image_key) == (
        full.input_ids, full.images, full.num_tiles, full.image_key)  # fmt: skip
    both = pre("<image> and <image>?", [str(a), str(b)], cached={key})
    assert both.pixel_values is not None and both.pixel_values.shape[0] == both.num_tiles
