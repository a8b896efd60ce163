"""Compiled functions saved whole, so that a later start loads them instead of tracing them again.

`torch.compile` re-traces every graph with Dynamo at every process start, even when Inductor's on-disk cache holds
the compiled code: most of a warm start-up (bench/RESULTS.md). A `Precompiled` function compiles ahead of
time (`aot_compile`) the first time it meets inputs that none of its graphs accepts, saves the graph (code, guards and
Inductor's output) under the cache directory, and at a later start loads it: no tracing and no guard building. Each
graph's own guards, the ones Dynamo would check, decide which graph runs; a call no graph accepts compiles one more.

The artifacts are torch's own serialized graphs (pickles), written and read only under the job's compile cache
directory, never from job data.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# this process's graphs, for the summary: loaded from the cache directory, and compiled anew
COUNTS = {"loaded": 0, "compiled": 0}
FALLBACK = "use-torch-compile"  # a function's folder holds this file where it cannot be precompiled


def source_digest(repo: Path = Path(__file__).resolve().parents[1]) -> str:
    """A hash of the library's source files under `repo` (path and bytes): a saved graph holds the library's bytecode
    and constants (bench/e2e.py also prints it: it names the code that ran where the checkout's history is stale)."""
    h = hashlib.blake2b(digest_size=6)
    for f in sorted((repo / "batchvl").rglob("*.py")):
        h.update(f.relative_to(repo).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@functools.cache
def platform_key(device: torch.device) -> str:
    """What a saved graph depends on besides its function: torch and Triton builds, the library's source, the GPU
    (its index too: guards check a tensor's device, so each rank of a job loads only its own graphs)."""
    import triton

    parts = [torch.__version__, triton.__version__, source_digest(), str(device)]
    if device.type == "cuda":
        parts += [torch.cuda.get_device_name(device), str(torch.cuda.get_device_capability(device))]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


class Precompiled:
    """`torch.compile(fn, **opts)` whose graphs persist under `cache_dir` (None: in memory only).

    `tag` names what else the graphs depend on (the model's config), so that other models' graphs are not loaded.
    `mark(*args)` marks dynamic or unbacked dimensions on the inputs a graph is compiled for; calls pass their inputs
    unmarked (a loaded graph's guards refuse marks it was not saved with). Ahead-of-time graphs are whole; if
    compiling one fails (a graph break, an older torch), the function falls back to `torch.compile`, breaks allowed,
    with a warning, for the rest of the process and at later starts (a marker file in its folder; also written when
    a graph cannot be saved).
    """

    def __init__(
        self,
        fn: Callable,
        cache_dir: str | None = None,
        tag: str = "",
        mark: Callable[..., None] | None = None,
        **opts: Any,
    ) -> None:
        self.fn, self.cache_dir, self.tag, self.mark, self.opts = fn, cache_dir, tag, mark, opts
        self.graphs: list | None = None  # loaded at the first call: on the clock of what makes it (a warm-up)
        self.fallback: Callable | None = None
        self.dir: Path | None = None
        self.loaded = 0  # graphs read from disk

    def __call__(self, *args: Any) -> Any:
        if self.graphs is None:
            self.graphs = self._load(args)
            if self.graphs:  # a loaded graph's first call loads its kernels: part of a warm start-up, logged
                t0 = time.perf_counter()
                out = self._run(args)
                dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
                if dev is not None and dev.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                    torch.cuda.synchronize(dev)
                log.info(
                    "first call of %s (loaded graphs): %.2f s", self.fn.__qualname__, time.perf_counter() - t0
                )
                return out
        return self._run(args)

    def _run(self, args: tuple) -> Any:
        if self.fallback is not None:
            self._mark(args)
            return self.fallback(*args)
        for g in self.graphs:
            if g.guard_check(*args):
                return g.fn(*args)
        return self._compile(args)

    def _mark(self, args: tuple) -> None:
        if self.mark is not None:
            self.mark(*args)

    def _folder(self, args: tuple) -> Path | None:
        if self.cache_dir is None:
            return None
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        name = f"{self.fn.__module__}.{self.fn.__qualname__}"
        tag = hashlib.blake2b(f"{name}|{self.tag}|{self.opts}".encode(), digest_size=8).hexdigest()
        return Path(self.cache_dir) / "precompiled" / platform_key(dev) / f"{self.fn.__qualname__}-{tag}"

    def _load(self, args: tuple) -> list:
        self.dir = self._folder(args)
        graphs: list = []
        if torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
            self.fallback = self.fn  # eager, as torch.compile runs then
            return graphs
        if self.dir is None or not self.dir.is_dir():
            return graphs
        if (self.dir / FALLBACK).exists():  # an earlier start could not compile or save a graph of it
            log.info("%s: torch.compile, as %s says", self.fn.__qualname__, self.dir / FALLBACK)
            self.fallback = torch.compile(self.fn, **self.opts)
            return graphs
        t0 = time.perf_counter()
        for path in sorted(self.dir.glob("*.bin")):
            try:
                with path.open("rb") as f:
                    graphs.append(torch.compiler.load_compiled_function(f, f_globals=self.fn.__globals__))
            except Exception as e:  # noqa: BLE001 - a stale or torn file: compile again, and drop it
                log.warning("dropping unloadable precompiled graph %s (%s: %s)", path, type(e).__name__, e)
                path.unlink(missing_ok=True)
        COUNTS["loaded"] += len(graphs)
        log.info(
            "loaded %d graphs of %s in %.2f s", len(graphs), self.fn.__qualname__, time.perf_counter() - t0
        )
        self.loaded = len(graphs)
        return graphs

    def _compile(self, args: tuple) -> Any:
        # a saved graph that refused inputs it was made for points at a guard that does not survive a restart (read
        # before the marks, which the guards would refuse too)
        refused = (
            f"; the {self.loaded} loaded from disk refused these inputs: {self._refusal(args)}"
            if self.loaded
            else ""
        )
        t0 = time.perf_counter()
        self._mark(args)
        try:
            with torch._dynamo.config.patch(enable_aot_compile=True):
                g = torch.compile(self.fn, fullgraph=True, **self.opts).aot_compile((args, {}))
        except Exception as e:  # noqa: BLE001 - slower starts, not a failed job
            self._give_up("compile", e)
            self.fallback = torch.compile(self.fn, **self.opts)
            return self.fallback(*args)
        self.graphs.append(g)
        COUNTS["compiled"] += 1
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                path = self.dir / f"{time.time_ns()}-{os.getpid()}.bin"
                # written aside, then renamed: torch 2.11 writes in place, where another rank could read half
                g.save_compiled_function(f"{path}.tmp")
                os.replace(f"{path}.tmp", path)
            except Exception as e:  # noqa: BLE001 - the graph still serves this process
                self._give_up("save", e)
        log.info("compiled %s ahead of time in %.1f s (graph %d%s)", self.fn.__qualname__, time.perf_counter() - t0,
                 len(self.graphs), refused)  # fmt: skip
        return g(*args)

    def _refusal(self, args: tuple) -> str:
        """The first failing guard of the first loaded graph (Dynamo's own words), for the log."""
        try:
            g = self.graphs[0]
            info = g._artifacts.guard_manager.check_verbose(g.prepare_f_locals(*args))
            return "; ".join(info.verbose_code_parts) or "no guard named"
        except Exception as e:  # noqa: BLE001 - private API: a diagnostic only
            return f"guards not readable: {type(e).__name__}"

    def _give_up(self, what: str, e: Exception) -> None:
        """Later starts use torch.compile (a marker in the folder): it traces at every start, but then a start does
        not trace twice (an ahead-of-time compile that fails, then torch.compile)."""
        why = f"could not {what} {self.fn.__qualname__} ahead of time ({type(e).__name__}: {e})"
        now = "torch.compile from now on" if what == "compile" else "later starts use torch.compile"
        log.warning("%s; %s, traced at every start (graph breaks allowed)", why, now)
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                (self.dir / FALLBACK).write_text(why + "\n")
            except OSError:
                pass
