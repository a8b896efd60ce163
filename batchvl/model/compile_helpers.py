"""A cold start's graphs compiled in helper processes while the job's process loads the weights.

With nothing under engine.cache_dir for this model, library, torch and GPU, the warm-up compiles its graphs one after
another, after the weights are in: most of a cold start-up (bench/RESULTS.md). Each graph is one layer's, with the
layer's weights as inputs (`graph_key`), so a stand-in of the model's widths with 2 layers of each kind compiles the
same graphs. `ColdStart` runs one process per warm-up part (`WARM_PARTS`; where they fit, the prefill's two functions
in two: `SPLIT_PARTS`), each with its own stand-in, while the job's process loads the weights; each saves its graphs
(`Precompiled`), and the job's warm-up then loads them.
Helpers are an optimization only: one that fails costs time, and the warm-up compiles whatever it finds missing.
After a warm-up, a marker file says this model's graphs are saved, and later starts run no helper.

`python -m batchvl.model.compile_helpers PART PARENT_PID` is a helper: it reads its spec (JSON) on stdin, and dies
with the job's process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch

from batchvl.config import InternVLConfig, config_from_dict, config_to_dict, with_layers
from batchvl.job import EngineSpec
from batchvl.precompile import platform_key

log = logging.getLogger(__name__)
# two layers make the calls a job makes: the LLM's layer graph and its last layer's; the ViT's layer with the next's
# norm (with 1 layer the LLM's layer graph is never called: tests/test_compile_helpers.py fails)
STAND_IN_LAYERS = 2
HELPER_TIMEOUT_S = 600.0  # a helper still compiling then is killed: the warm-up compiles what it left
HELPER_CONTEXT_BYTES = 1 << 30  # a helper's CUDA context and allocator slack
WARM_PREFILL_TOKENS = 2048  # at least the warm-up's largest dummy admission
# the prefill part's functions, each in a helper of its own where they fit: one helper compiles the prefill's 2-3 graphs
# one after another, the longest part (bench/RESULTS.md); part -> (warm-up part, the function left eager)
SPLIT = {"prefill_layers": ("prefill", "compiled_last"), "prefill_last": ("prefill", "compiled_layer")}
SPLIT_PARTS = ("vit", *SPLIT, "decode_graphs")


def helpers_bytes(
    cfg: InternVLConfig, dtype: torch.dtype, quantization: str, settings: EngineSpec, parts: tuple[str, ...]
) -> int:
    """What helpers for `parts` hold at most on the GPU, together: each its stand-in's weights and its CUDA context,
    and the more of two passing peaks: the draw's fp32 copy of its largest tensor, or its part's activations (the
    ViT's: a ViT call at max_vit_tiles; a prefill part's: a warm-up prefill). Helpers draw and compile unsynchronized,
    so their peaks add up."""
    from batchvl.model.loader import build_empty
    from batchvl.model.memory import activation_bytes, memory_plan

    stand_in = with_layers(cfg, STAND_IN_LAYERS)
    weights = memory_plan(stand_in, dtype, quantization, WARM_PREFILL_TOKENS, settings.max_vit_tiles).weights
    # `init_random` draws each tensor in fp32, one at a time
    draw = 4 * max(p.numel() for p in build_empty(stand_in).parameters())
    work = {
        "vit": activation_bytes(stand_in, dtype, 0, settings.max_vit_tiles, quantization),
        "prefill": activation_bytes(stand_in, dtype, WARM_PREFILL_TOKENS, 0, quantization),
    }
    peaks = (max(draw, work.get(SPLIT.get(p, (p,))[0], 0)) for p in parts)
    return sum(weights + HELPER_CONTEXT_BYTES + peak for peak in peaks)


def _parts_that_fit(cfg: InternVLConfig, dtype: torch.dtype, quantization: str, settings: EngineSpec,
                    device: torch.device) -> tuple[str, ...] | None:  # fmt: skip
    """The helpers' parts that fit on the GPU beside the model's weights and its smallest working set
    (`check_fits`'s): `SPLIT_PARTS`, else `WARM_PARTS`, else None."""
    from batchvl.engine import WARM_PARTS
    from batchvl.model.memory import MIN_PREFILL_TOKENS, memory_plan

    budget = settings.max_prefill_tokens or MIN_PREFILL_TOKENS
    full = memory_plan(cfg, dtype, quantization, budget, settings.max_vit_tiles)
    need = full.weights + full.activations + budget * full.kv_per_token
    free = torch.cuda.mem_get_info(device)[0]
    for parts in (SPLIT_PARTS, WARM_PARTS):
        helpers = helpers_bytes(cfg, dtype, quantization, settings, parts)
        if need + helpers <= free:
            return parts
    log.info("compiling after the load: %.1f GiB free, the model needs %.1f and compile helpers %.1f",
             free / 2**30, need / 2**30, helpers / 2**30)  # fmt: skip
    return None


def _spec(cfg: InternVLConfig, quantization: str, settings: EngineSpec, device: torch.device, dtype: torch.dtype,
          max_seq_len: int) -> dict:  # fmt: skip
    return {"config": config_to_dict(cfg), "quantization": quantization, "engine": dataclasses.asdict(settings),
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "max_seq_len": max_seq_len}  # fmt: skip


# the engine settings that change which graphs a warm-up compiles (the prefix cache does not: its batches share the
# prefill graphs), or the sizes they are compiled for
GRAPH_SETTINGS = ("vit_fp8", "max_vit_tiles")


def marker(spec: dict) -> Path:
    """The file that says a warm-up of this model ran here with these graph settings: its graphs are saved."""
    # not the longest sequence: it sizes only the block table, and a graph that refused it would compile at warm-up
    what = {k: v for k, v in spec.items() if k not in ("engine", "max_seq_len")}
    what |= {k: spec["engine"][k] for k in GRAPH_SETTINGS}
    key = hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=8).hexdigest()
    root = Path(spec["engine"]["cache_dir"]).expanduser() / "precompiled"
    return root / platform_key(torch.device(spec["device"])) / f"warmed-{key}"


class Helpers:
    """The helper processes of one start: `wait()` once the weights are in, `kill()` if the start fails."""

    def __init__(self, spec: dict, parts: tuple[str, ...]) -> None:
        self.spec, self.t0 = spec, time.perf_counter()
        env = dict(os.environ)
        # Inductor's compile workers, shared out: each helper would otherwise start one per core
        threads = max(1, (os.cpu_count() or 1) // (len(parts) + 1))
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
        self.procs: dict[str, tuple[subprocess.Popen, IO[bytes]]] = {}
        for part in parts:
            out = tempfile.TemporaryFile()
            cmd = [sys.executable, "-m", __name__, part, str(os.getpid())]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env)
            try:
                p.stdin.write(json.dumps(spec).encode())
                p.stdin.close()
            except BrokenPipeError:  # it died at once: `wait` reports it
                pass
            self.procs[part] = (p, out)

    def wait(self) -> float:
        """Wait for every helper (a failure is logged, not raised); the seconds waited."""
        t = time.perf_counter()
        for part, (p, out) in self.procs.items():
            try:
                rc = p.wait(timeout=max(1.0, HELPER_TIMEOUT_S - (time.perf_counter() - self.t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            out.seek(0)
            text = out.read().decode(errors="replace")
            out.close()
            if rc != 0:
                tail = "\n".join(text.splitlines()[-20:])
                log.warning("compile helper for %s failed (exit %s); the warm-up compiles what it left:\n%s",
                            part, rc, tail)  # fmt: skip
            else:  # what it compiled and when it finished, for the start-up's log
                for line in text.splitlines():
                    if "ahead of time" in line or "part done" in line:
                        log.info("helper %s: %s", part, line.split(": ", 1)[-1])
        log.info("compile helpers (%s) done %.1f s after they started; waited %.1f s", ", ".join(self.procs),
                 time.perf_counter() - self.t0, time.perf_counter() - t)  # fmt: skip
        return time.perf_counter() - t

    def kill(self) -> None:
        for p, out in self.procs.values():
            p.kill()
            p.wait()
            out.close()


class ColdStart:
    """One start's helpers: started where this machine has not saved the model's graphs (no marker), on CUDA, compiled,
    without tensor parallelism (a rank's layers are shards), where they fit in the GPU's memory beside the model.
    `wait()` once the weights are in (before the KV pool is sized from the free memory: helpers hold some), `kill()`
    if the start fails, `warmed()` after the warm-up."""

    def __init__(self, cfg: InternVLConfig, quantization: str, settings: EngineSpec, device: torch.device,
                 dtype: torch.dtype, max_seq_len: int, tp: int = 1) -> None:  # fmt: skip
        self.waited_s = 0.0  # seconds the start waited for helpers after its weights were in
        self.marker, self.helpers = None, None
        if device.type != "cuda" or settings.eager:
            return
        try:  # helpers are an optimization: whatever fails here, the start goes on without them
            spec = _spec(cfg, quantization, settings, device, dtype, max_seq_len)
            self.marker = marker(spec)
            if tp > 1 or self.marker.exists():
                return
            parts = _parts_that_fit(cfg, dtype, quantization, settings, device)
            if parts is not None:
                self.helpers = Helpers(spec, parts)
        except Exception as e:  # noqa: BLE001
            log.warning("compile helpers not started (%s: %s); the warm-up compiles", type(e).__name__, e)

    def wait(self) -> None:
        if self.helpers is not None:
            self.waited_s = self.helpers.wait()
            self.helpers = None

    def kill(self) -> None:
        if self.helpers is not None:
            self.helpers.kill()
            self.helpers = None

    def warmed(self) -> None:
        """This model's graphs are saved here: later starts need no helper."""
        if self.marker is None:
            return
        try:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()
        except OSError as e:  # a read-only cache: every start runs helpers, nothing worse
            log.warning("could not write %s (%s)", self.marker, e)


def compile_part(spec: dict, part: str) -> Any:
    """Build a stand-in of the spec's model (`STAND_IN_LAYERS` layers, random weights) and run the warm-up's `part`
    (or a `SPLIT` part's) through it, which compiles and saves that part's graphs. Returns the engine (for tests)."""
    from batchvl.engine import Engine
    from batchvl.llm.kv_cache import blocks_for
    from batchvl.model.build import prepare_llm, use_compile_cache, vision_encoder
    from batchvl.model.loader import random_model

    settings = EngineSpec(**spec["engine"])
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    if device.type == "cuda" and device.index is not None:  # a bare "cuda" is the current device already
        torch.cuda.set_device(device)
    use_compile_cache(settings.cache_dir)
    cfg = with_layers(config_from_dict(spec["config"]), STAND_IN_LAYERS)
    model, _ = random_model(cfg, device, dtype, quantization=spec["quantization"])
    if device.type == "cuda":  # the draw's fp32 copy goes back before the part's activations come
        torch.cuda.empty_cache()
    # each part compiles its own graphs only: the others run eager here
    prepare_llm(model.llm, part != "vit", settings.cache_dir)
    warm, eager = SPLIT.get(part, (part, None))
    if eager:  # the other split part's helper compiles it
        setattr(model.llm, eager, None)
    encode = vision_encoder(model, settings) if part == "vit" else model.vision
    width = blocks_for(spec["max_seq_len"])
    engine = Engine(model, cfg, settings, device, dtype, encode_fn=encode, max_seq_len=spec["max_seq_len"],
                    pool_blocks=2 * width + 64)  # fmt: skip
    engine.warm_part(warm)
    return engine


def main() -> None:
    from batchvl.pipeline import die_with_parent

    t0 = time.perf_counter()
    die_with_parent(int(sys.argv[2]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s compile helper %(name)s: %(message)s")
    spec = json.loads(sys.stdin.read())
    try:  # Inductor's compile workers (Triton kernels: CUDA only) start now, while the stand-in is drawn
        from torch._inductor.async_compile import maybe_warm_pool

        if spec["device"].startswith("cuda"):
            maybe_warm_pool()
    except Exception as e:  # noqa: BLE001 - a private API: without it the workers start at the first compile
        log.info("compile workers not started early (%s: %s)", type(e).__name__, e)
    part = sys.argv[1]
    engine = compile_part(spec, part)
    if engine.device.type != "cuda":
        log.info("part done in %.1f s (after its imports)", time.perf_counter() - t0)
        return
    peak = torch.cuda.max_memory_reserved(engine.device)
    plan = helpers_bytes(engine.cfg, engine.dtype, spec["quantization"], engine.settings, (part,))
    plan -= HELPER_CONTEXT_BYTES  # what torch reserves: the context is not in it
    # the fit check trusts the plan: a helper that held more could crowd the job's own load
    (log.info if peak <= plan else log.warning)(
        "part done in %.1f s (after its imports), %.1f GiB reserved at most, of %.1f planned",
        time.perf_counter() - t0, peak / 2**30, plan / 2**30,
    )  # fmt: skip


if __name__ == "__main__":
    main()
