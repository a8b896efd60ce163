"""What a start does beside the weight load: compile helpers (a 2-layer stand-in compiles the graphs a cold start
needs, in processes of their own, and the full model loads them: batchvl/model/compile_helpers.py), and the GPU
libraries' set-up (`build.warm_libraries`)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from batchvl.config import from_preset
from batchvl.engine import WARM_PARTS, Engine, Request, Sampling
from batchvl.job import EngineSpec
from batchvl.model import compile_helpers
from batchvl.model.build import prepare_llm, vision_encoder
from batchvl.model.compile_helpers import ColdStart, Helpers, compile_part
from batchvl.model.loader import random_model
from batchvl.model.memory import MIN_PREFILL_TOKENS, memory_plan
from batchvl.precompile import COUNTS


def _cfg(layers: int = 3):
    cfg = from_preset("tiny-qwen2")
    return replace(
        cfg, vision=replace(cfg.vision, num_layers=layers), llm=replace(cfg.llm, num_layers=layers)
    )


def _spec(settings: EngineSpec, device: str = "cpu") -> dict:
    return compile_helpers._spec(_cfg(), "none", settings, torch.device(device), torch.float32, 2048)


def _rows(cfg) -> list[Request]:
    greedy = Sampling(max_new_tokens=4, ignore_eos=True)
    img = torch.full((cfg.num_image_token,), cfg.image_token_id)
    s = cfg.vision.image_size
    out = []
    for i in range(3):
        ids = torch.cat([torch.arange(10, 30), img, torch.arange(40 + i, 60 + 3 * i)])
        px = torch.randint(
            0, 255, (1, s, s, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)
        )
        out.append(Request(ids, px, f"img{i % 2}", greedy))
    return out


def _engine(cfg, settings: EngineSpec, compiled: bool) -> Engine:
    model, _ = random_model(cfg, "cpu", torch.float32, seed=1)
    prepare_llm(model.llm, compiled, settings.cache_dir)
    encode = vision_encoder(model, settings) if compiled else model.vision
    return Engine(model, cfg, settings, "cpu", torch.float32, encode_fn=encode, max_seq_len=2048)


@pytest.mark.slow
def test_a_two_layer_stand_in_compiles_the_graphs_the_full_model_loads(monkeypatch, tmp_path) -> None:
    """The ViT and prefill parts compiled through a 2-layer stand-in (other weights, fewer layers) are what a 3-layer
    model's warm-up and prefills run: it loads them, compiles none, and computes the eager model's logits (fp32, the
    packed attention op as on a GPU; rows through the ViT, then after a cached prefix). (Decode is not a helper's on
    a CPU: without CUDA graphs it compiles as rows need it.)"""
    monkeypatch.setattr("batchvl.engine.prefill_backend", lambda *a: "packed")
    settings = EngineSpec(cache_dir=str(tmp_path), prefix_cache=True, max_vit_tiles=4)
    for part, graphs in (("vit", 3), ("prefill_layers", 1), ("prefill_last", 1)):  # as split on a GPU
        before = COUNTS["compiled"]
        compile_part(_spec(settings), part)
        assert COUNTS["compiled"] - before == graphs, part  # each split part its own function's graph only
    loaded, compiled = COUNTS["loaded"], COUNTS["compiled"]
    cfg = _cfg()
    fast, eager = _engine(cfg, settings, compiled=True), _engine(cfg, settings, compiled=False)
    assert fast.warm_part("vit") is not None and fast.warm_part("prefill") is not None
    assert COUNTS["loaded"] - loaded == 5  # ViT embed / layer / head; prefill layer; last layer
    rows = _rows(cfg)
    for batch in (rows[:1], rows[1:]):  # the second: a prefix-cache hit
        torch.testing.assert_close(
            fast.prefill_logits(batch), eager.prefill_logits(batch), atol=1e-4, rtol=1e-4
        )
    assert fast.counters["prefix_cache_hits"] >= 1
    assert COUNTS["compiled"] == compiled  # nothing compiled: not at the warm-up, not for the rows


def test_helpers_run_in_their_own_processes_and_a_failed_one_costs_only_time(tmp_path, caplog) -> None:
    """A helper reads its spec on stdin and exits 0 (on this CPU, the decode part has no graphs to capture); one
    that fails (no CUDA here) is logged with its output's tail, and waiting for it raises nothing."""
    settings = EngineSpec(cache_dir=str(tmp_path))
    ok = Helpers(_spec(settings), ("decode_graphs",))
    bad = Helpers(_spec(settings, device="cuda:0"), ("vit",))
    with caplog.at_level(logging.WARNING, logger="batchvl.model.compile_helpers"):
        assert ok.wait() >= 0 and bad.wait() >= 0
    failed = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failed) == 1 and "compile helper for vit failed" in failed[0] and "Error" in failed[0]


def test_a_cold_start_runs_helpers_and_a_warmed_one_does_not(monkeypatch, tmp_path) -> None:
    """Helpers start on CUDA where this machine has no marker for the model and settings; after a warm-up the
    marker says its graphs are saved, for any settings that compile the same graphs. None on a CPU, eager, under
    tensor parallelism, or where they would not fit in the GPU's memory beside the model."""
    started, free = [], [1 << 40]
    monkeypatch.setattr(compile_helpers, "platform_key", lambda device: "gpu-key")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[0], 1 << 40))
    monkeypatch.setattr(compile_helpers, "Helpers", lambda spec, parts: started.append(parts) or "helpers")
    cuda, cfg = torch.device("cuda:0"), _cfg()

    def cold(settings: EngineSpec, device=cuda, tp: int = 1, max_seq_len: int = 2048) -> ColdStart:
        return ColdStart(cfg, "none", settings, device, torch.bfloat16, max_seq_len, tp)

    settings = EngineSpec(cache_dir=str(tmp_path))
    first = cold(settings)
    split = ("vit", "prefill_layers", "prefill_last", "decode_graphs")
    assert first.helpers == "helpers" and started == [split]
    first.helpers = None
    first.warmed()
    assert cold(settings).helpers is None  # the marker
    assert (
        cold(replace(settings, prefix_cache=True, max_prefill_tokens=4096)).helpers is None
    )  # the same graphs
    assert cold(settings, max_seq_len=4096).helpers is None  # longer rows: the same graphs
    assert cold(replace(settings, max_vit_tiles=16)).helpers == "helpers"  # graphs for another size
    other = replace(settings, max_vit_tiles=8)  # no marker for this size
    for none in (cold(other, torch.device("cpu")), cold(replace(other, eager=True)), cold(other, tp=2)):
        assert none.helpers is None
    assert len(started) == 2
    # where the model's smallest working set and the split helpers do not both fit, one helper per warm-up part;
    # where those do not either, the start compiles after the load
    plan = memory_plan(cfg, torch.bfloat16, "none", MIN_PREFILL_TOKENS, other.max_vit_tiles)
    model = plan.weights + plan.activations + MIN_PREFILL_TOKENS * plan.kv_per_token
    helpers = {
        parts: compile_helpers.helpers_bytes(cfg, torch.bfloat16, "none", other, parts)
        for parts in (split, WARM_PARTS)
    }
    assert helpers[split] > helpers[WARM_PARTS]
    free[0] = model + helpers[WARM_PARTS] - 1
    assert cold(other).helpers is None
    free[0] = model + helpers[split] - 1
    assert cold(other).helpers == "helpers" and started[-1] == WARM_PARTS
    free[0] = model + helpers[split]
    assert cold(other).helpers == "helpers" and started[-1] == split and len(started) == 4
    # helpers are an optimization: a failure deciding or starting them leaves the start without them
    monkeypatch.setattr(compile_helpers, "platform_key", lambda device: 1 / 0)
    assert cold(replace(other, max_vit_tiles=2)).helpers is None and len(started) == 4


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-6b-style"])
def test_gpu_libraries_are_set_up_with_the_models_own_calls(monkeypatch, caplog, preset) -> None:
    """`warm_libraries` runs the ViT's attention (SDPA, or the 300M's kernel where it has a config) and the LLM's
    per-sequence attention at the model's head shapes without an error (here on a CPU, in fp32: the same calls
    a GPU start makes beside its load, but flash varlen, which has no CPU kernel)."""
    from batchvl.model import build

    monkeypatch.setattr("batchvl.ops.prefill_attention.packed_kernel", lambda d, t, h, lengths, a: "cudnn")
    with caplog.at_level(logging.INFO, logger="batchvl.model.build"):
        build.warm_libraries(from_preset(preset), torch.device("cpu"), torch.float32)
    assert [r.getMessage() for r in caplog.records][-1].startswith("GPU libraries set up beside the load")
