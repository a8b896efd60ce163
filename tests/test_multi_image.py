"""Several images per row, as InternVL2.5 does it, checked against transformers' InternVL processor and model on CPU:
tiles, token ids and greedy tokens for 2- and 3-image rows; the tile budget; the image cache per image."""

from __future__ import annotations

import pytest
import torch
from conftest import IMG_CONTEXT_ID, FakeEngine
from test_preprocess import IMAGENET_MEAN, IMAGENET_STD, SYSTEM, noise_image

from batchvl.data import SourceRow
from batchvl.engine import Engine, Request, Sampling
from batchvl.job import EngineSpec
from batchvl.model.loader import load_model
from batchvl.pipeline import Flow, RowLoop
from batchvl.preprocess import PreprocessConfig, PreprocessError, Preprocessor, load_tokenizer, pixel_input

IMAGES = [noise_image(600, 300, seed=1), noise_image(300, 300, seed=2), noise_image(200, 500, seed=3)]
# (our prompt, the processor's text between the template's user and assistant turns, images)
ROWS = [
    ("Compare <image> with <image>, briefly.", "Compare <IMG_CONTEXT> with <IMG_CONTEXT>, briefly.", IMAGES[:2]),
    ("What differs?", "Image-1: <IMG_CONTEXT>\nImage-2: <IMG_CONTEXT>\nImage-3: <IMG_CONTEXT>\nWhat differs?", IMAGES),
]  # fmt: skip


def hf_processor(max_patches: int):
    """transformers' InternVLProcessor over the PIL image processor and the built-in tokenizer. Its class check
    would import a video processor (torchvision), which a row of images never uses."""
    from transformers import InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    class Processor(InternVLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return type(arg)

    tok = load_tokenizer()
    for name, token in (
        ("start_image", "<img>"),
        ("end_image", "</img>"),
        ("context_image", "<IMG_CONTEXT>"),
    ):
        setattr(tok, f"{name}_token", token)
        setattr(tok, f"{name}_token_id", tok.convert_tokens_to_ids(token))
    tok.video_token = "<video>"
    images = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1,
                                      max_patches=max_patches, image_mean=list(IMAGENET_MEAN),
                                      image_std=list(IMAGENET_STD))  # fmt: skip
    return Processor(image_processor=images, tokenizer=tok, video_processor=None, image_seq_length=256)


def hf_text(question: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")  # fmt: skip


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    # 2 tiles per image at most (a row of 3 shares 6): the 600x300 image takes 2 + thumbnail, 300x300 one tile
    return Preprocessor(PreprocessConfig(max_tiles=4, max_tiles_per_row=6))


@pytest.mark.parametrize("row", ROWS, ids=["2-images-placeholders", "3-images-prefixed"])
def test_tiles_and_token_ids_match_transformers(pre, row):
    prompt, question, images = row
    per_image = min(4, 6 // len(images))
    ref = hf_processor(per_image)(images=[images], text=[hf_text(question)], return_tensors="pt")
    ours = pre(prompt, images)
    assert ours.input_ids == ref["input_ids"][0].tolist()
    pv = pixel_input(ours.pixel_values)
    assert pv.shape == ref["pixel_values"].shape
    torch.testing.assert_close(pv, ref["pixel_values"].float(), atol=1e-5, rtol=0)
    assert [n for _, n in ours.images] == [3, 1] + ([3] if len(images) == 3 else [])
    assert ours.num_tiles == sum(n for _, n in ours.images) and ours.num_image_tokens == 256 * ours.num_tiles


def test_greedy_tokens_match_transformers_generate(hf_model_dir):
    d, hf = hf_model_dir
    model, cfg = load_model(d)
    pre = Preprocessor(PreprocessConfig(max_tiles=2))  # the built-in tokenizer: the tiny checkpoint has none
    for prompt, question, images in ROWS:
        ref_in = hf_processor(2)(images=[images], text=[hf_text(question)], return_tensors="pt")
        with torch.no_grad():
            ref = hf.generate(**ref_in, max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, ref_in["input_ids"].shape[1]:].tolist()  # fmt: skip
        p = pre(prompt, images)
        req = Request(torch.tensor(p.input_ids), p.pixel_values, p.image_key,
                      Sampling(max_new_tokens=6, ignore_eos=True), images=p.images)  # fmt: skip
        assert Engine(model, cfg).generate([req])[0].output_ids == ref, prompt


def test_placeholder_count_and_tile_budget_errors(pre):
    with pytest.raises(
        PreprocessError, match="the prompt has 1 <image> placeholder.s. but the row has 2 images"
    ):
        pre("Only <image> here", IMAGES[:2])
    with pytest.raises(
        PreprocessError, match="the prompt has 3 <image> placeholder.s. but the row has 2 images"
    ):
        pre("<image> <image> <image>", IMAGES[:2])
    with pytest.raises(PreprocessError, match="7 images but max_tiles_per_row=6: not one tile for each"):
        pre("q", IMAGES * 2 + IMAGES[:1])
    with pytest.raises(PreprocessError, match="image 2 of 2: image file not found"):
        pre("q", [IMAGES[0], "/no/such.png"])
    one = Preprocessor(PreprocessConfig(max_tiles=4))("q", [IMAGES[0]])  # a one-image list is that image
    assert one.images == ((one.image_key, 3),) and one.input_ids == pre("q", IMAGES[0]).input_ids != []
    # the same image in rows of different counts gets a different tiling, so a different key
    assert pre("q", IMAGES[0]).image_key != pre("q", IMAGES[:3]).images[0][0]
    assert pre("q", IMAGES[:2]).images[0] == pre("q", [IMAGES[0], IMAGES[2]]).images[0]


def test_image_cache_keys_each_image(pre):
    model, cfg = load_model_random()
    a, b, c = (
        pre("q", imgs) for imgs in ([IMAGES[0], IMAGES[1]], [IMAGES[1], IMAGES[2]], [IMAGES[2], IMAGES[0]])
    )

    def req(p):
        return Request(torch.tensor(p.input_ids), p.pixel_values, p.image_key, Sampling(4, ignore_eos=True),
                       images=p.images)  # fmt: skip

    plain = Engine(model, cfg, max_seq_len=4096, pool_blocks=200)
    want = [f.output_ids for f in plain.generate([req(a), req(b), req(c)])]
    cached = Engine(model, cfg, EngineSpec(image_cache=True), max_seq_len=4096, pool_blocks=200)
    got = [f.output_ids for f in cached.generate([req(a)])] + [
        f.output_ids for f in cached.generate([req(b)])
    ]
    assert cached.counters["image_cache_hits"] == 1  # b's first image is a's second
    assert sorted(cached.image_cache) == sorted({k for p in (a, b) for k, _ in p.images})
    assert not cached.needs_vit(req(c))  # c's images were b's second and a's first (tiled alike: rows of 2)
    got += [f.output_ids for f in cached.generate([req(c)])]
    assert got == want and cached.counters["image_cache_hits"] == 3


def load_model_random():
    from batchvl.model.loader import random_model

    return random_model("tiny-6b-style", seed=0)


def test_a_row_of_images_through_the_pipeline(pre):
    """Several images ride in one Request (tiles concatenated, each image's key and tiles); a mismatch is an error
    row and the job goes on."""
    engine = FakeEngine()
    seen = []
    admit = engine.admit
    engine.admit = lambda reqs: seen.extend(reqs) or admit(reqs)
    flow = Flow(engine, pre, lambda ids: "", Sampling(max_new_tokens=2))
    rows = [SourceRow(0, "two", "Compare <image> and <image>", IMAGES[:2]),
            SourceRow(1, "bad", "Only <image>", IMAGES[:2]), SourceRow(2, "one", "q", IMAGES[2])]  # fmt: skip
    written = []
    RowLoop(flow, written.append, t0=0.0).run(rows)
    by_id = {r["id"]: r for r in written}
    assert by_id["bad"]["error"] == "the prompt has 1 <image> placeholder(s) but the row has 2 images"
    assert by_id["two"]["error"] is None and by_id["two"]["num_tiles"] == 4
    assert by_id["two"]["prompt_token_ids"].count(IMG_CONTEXT_ID) == 4 * 256
    two = next(r for r in seen if r.pixel_values.shape[0] == 4)
    assert [n for _, n in two.images] == [3, 1] and len({k for k, _ in two.images}) == 2
