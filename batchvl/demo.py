"""The embedded demo's rows: synthetic images drawn in code (several sizes, aspect ratios and modes) + prompts."""

from __future__ import annotations

import functools
import io

from PIL import Image, ImageDraw

# (id, prompt, (width, height), PIL mode, pattern); None size: a text-only row
_ROWS = (
    ("square-gradient", "Describe this image.", (448, 448), "RGB", "gradient"),
    ("wide-stripes", "What pattern do you see?", (1200, 300), "RGB", "stripes"),
    ("tall-checker", "Is this image taller than it is wide?", (300, 900), "RGB", "checker"),
    ("small-circles", "How many circles are there?", (96, 64), "RGB", "circles"),
    ("grey-gradient", "Describe the brightness of this image.", (640, 480), "L", "gradient"),
    ("rgba-shapes", "List the shapes in this picture.", (500, 500), "RGBA", "circles"),
    ("palette-stripes", "Which colours appear here?", (320, 240), "P", "stripes"),
    ("text-only", "Write one sentence about batch inference.", None, "RGB", ""),
)


def draw(size: tuple[int, int], mode: str, pattern: str) -> Image.Image:
    """A deterministic synthetic image."""
    w, h = size
    img = Image.new("RGB", size, (255, 255, 255))
    d = ImageDraw.Draw(img)
    if pattern == "gradient":
        for x in range(w):
            d.line([(x, 0), (x, h)], fill=(255 * x // w, 128, 255 - 255 * x // w))
    elif pattern == "stripes":
        for i, x in enumerate(range(0, w, 40)):
            d.rectangle([x, 0, x + 19, h], fill=((200, 30, 30), (30, 160, 30), (30, 30, 200))[i % 3])
    elif pattern == "checker":
        for y in range(0, h, 50):
            for x in range(0, w, 50):
                if (x // 50 + y // 50) % 2:
                    d.rectangle([x, y, x + 49, y + 49], fill=(20, 20, 20))
    elif pattern == "circles":
        r = min(w, h) // 6
        for i, (cx, cy) in enumerate([(w // 4, h // 3), (w // 2, 2 * h // 3), (3 * w // 4, h // 3)]):
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=((250, 180, 0), (0, 150, 200), (150, 0, 150))[i])
    if mode == "RGBA":
        img = img.convert("RGBA")
        img.putalpha(Image.linear_gradient("L").resize(size))
        return img
    if mode == "P":
        return img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return img.convert(mode)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def _cached_rows() -> tuple[tuple[str, str, bytes | None], ...]:
    return tuple(
        (rid, prompt, None if size is None else png_bytes(draw(size, mode, pattern)))
        for rid, prompt, size, mode, pattern in _ROWS
    )


def demo_rows() -> list[dict]:
    """The demo's rows {id, prompt, image (PNG bytes or None)}."""
    return [{"id": rid, "prompt": prompt, "image": image} for rid, prompt, image in _cached_rows()]
