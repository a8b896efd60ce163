"""The seed job as a user runs it: `python -m batchvl.runner JOB --set ...` (a subprocess), its _summary.json and
_manifest.json read back (req/s, output tok/s, TTFT, load time, peak memory) and its rows for MFU against a bf16
matmul ceiling timed here; then transformers' generate on the same random weights and the runner's own prompts,
in this process on the same machine start, and greedy-token agreement between the two.

    python bench/e2e.py --preset internvl2_5-38b --n 500 --runs 2   # one H200; run2 has a warm compile cache
    python bench/e2e.py --runs 2 --variant caches:engine.image_cache=true,engine.prefix_cache=true --variant plain:
                                                                    # two configurations, one transformers baseline
    python bench/e2e.py --preset internvl2_5-4b --new-tokens 512 --new-tokens-range 16,512 --hf-batches ""
                                                                    # each row its own max_new_tokens, no transformers
    python bench/e2e.py --smoke                                     # tiny model on CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from common import hf_sharing_weights, matmul_ceiling, request_flops, same_tokens, sync_time  # noqa: E402

from batchvl.engine import WARM_PARTS  # noqa: E402
from batchvl.job import load_job  # noqa: E402
from batchvl.model.loader import random_model  # noqa: E402
from batchvl.output import read_rows  # noqa: E402
from batchvl.precompile import source_digest  # noqa: E402
from batchvl.preprocess import Preprocessor, pixel_input  # noqa: E402
from batchvl.runner import preprocess_config, resolve_dtype  # noqa: E402

try:
    from batchvl.config import from_preset
except ImportError:  # before the config module moved up
    from batchvl.model.config import from_preset

ROOT = Path(__file__).resolve().parents[1]
SMOKE_SETS = ["model.device=cpu", "preprocess.workers=0", "preprocess.max_tiles=2", "engine.eager=true"]


def data_sets() -> list[str]:
    """--set data.path / data.image to the ShareGPT sample and tiger.jpeg (repo .data/, else ../shared/data/)."""
    for d in (ROOT / ".data", ROOT.parent / "shared" / "data"):
        if (d / "tiger.jpeg").is_file():
            return [f"data.path={d / 'ShareGPT_V3_filtered_1000.json'}", f"data.image={d / 'tiger.jpeg'}"]
    print("tiger.jpeg not in .data/ or ../shared/data/: the job file's data paths are used", flush=True)
    return []


def with_row_lengths(sets: list[str], lo: int, hi: int, tmp: Path) -> list[str]:
    """The job's ShareGPT file copied with a `max_new_tokens` column drawn uniformly from [lo, hi] (seed 0)."""
    job_data = next(s.split("=", 1)[1] for s in reversed(sets) if s.startswith("data.path="))
    rows = json.loads(Path(job_data).read_text())
    rng = random.Random(0)
    for r in rows:
        r["max_new_tokens"] = rng.randint(lo, hi)
    path = tmp / "sharegpt_row_lengths.json"
    path.write_text(json.dumps(rows))
    return [*sets, f"data.path={path}"]


def git_commit(repo: Path) -> str:
    git = ["git", "-C", str(repo)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    digest = f"source {source_digest(repo)}"
    if head.returncode:
        return digest
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True).stdout
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.strip() else "") + f", {digest}"


def run_runner(repo: Path, job: str, sets: list[str], out: Path) -> dict:
    """One run of `python -m batchvl.runner` importing batchvl from `repo`; its summary, manifest and rows."""
    cmd = [sys.executable, "-m", "batchvl.runner", job, *(x for s in sets for x in ("--set", s))]
    cmd += ["--set", f"output.dir={out}", "--overwrite"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
    }
    print("$ " + shlex.join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=repo, env=env)  # cwd: `-m` puts it first on sys.path
    if p.returncode:
        raise SystemExit(f"the runner failed (exit {p.returncode})")
    run = json.loads((out / "_manifest.json").read_text())["runs"][-1]
    rows = read_rows(out)
    rows = rows.filter(pc.is_null(rows.column("error"))).to_pylist()
    return {"summary": json.loads((out / "_summary.json").read_text()), "run": run, "rows": rows}


def run_hf(hf, prompts: list[list[int]], tiles: torch.Tensor, batch: int, new_tokens: int):
    """Seconds for transformers' generate over `prompts` in left-padded batches (every row the same image), and
    its tokens."""
    outs, dev = [], tiles.device
    t0 = sync_time()
    for i in range(0, len(prompts), batch):
        part = prompts[i : i + batch]
        width = max(map(len, part))
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for j, p in enumerate(part):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), pixel_values=tiles.repeat(len(part), 1, 1, 1),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        outs += gen[:, width:].tolist()
    return sync_time() - t0, outs


def run_transformers(spec, preset: str, dev, hf_rows: list[dict], batches: list[int], new_tokens: int,
                     table: list[dict]) -> dict[int, list]:  # fmt: skip
    """transformers' generate at each batch size over the runner's first rows (same weights, same prompts, the
    image's tiles as the runner's preprocessing makes them); appends a table row per batch size; tokens by batch."""
    dtype = resolve_dtype(spec, dev)  # the runner's: bfloat16 on GPU, float32 on CPU
    cfg = from_preset(preset)
    pre = Preprocessor(preprocess_config(spec, cfg), llm_arch=cfg.llm.arch)
    tiles = pixel_input(pre("x", spec.data.image).pixel_values.to(dev), dtype)
    assert all(x["num_tiles"] == tiles.shape[0] for x in hf_rows), "rows with another tiling than the image's"
    prompts = [x["prompt_token_ids"] for x in hf_rows]
    hf_flops = sum(request_flops(cfg, tiles.shape[0], len(p), new_tokens) for p in prompts)
    t = time.perf_counter()
    model, _ = random_model(preset, dev, dtype, seed=spec.model.seed)  # the runner's weights: same draw
    hf = hf_sharing_weights(model, cfg)
    print(f"transformers: {preset} ({dtype}, {dev}) built in {time.perf_counter() - t:.1f}s", flush=True)
    tokens = {}
    for b in batches:
        run_hf(hf, prompts[:b], tiles, b, new_tokens)  # warm-up, untimed
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        secs, tokens[b] = run_hf(hf, prompts, tiles, b, new_tokens)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
        table.append(dict(run=f"transformers b={b}", req_s=len(prompts) / secs, secs=secs, load_s=None,
                          out_tok_s=len(prompts) * new_tokens / secs, ttft_ms=None, peak_gib=peak,
                          tflops=hf_flops / secs / 1e12))  # fmt: skip
        print(f"transformers b={b}: {len(prompts) / secs:.3f} req/s over {len(prompts)} rows", flush=True)
    del hf, model
    gc.collect()
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(ROOT / "jobs" / "sharegpt_tiger.yaml"))
    ap.add_argument("--preset", default="internvl2_5-38b")
    ap.add_argument("--n", type=int, default=500, help="data.limit")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="to the runner"
    )
    ap.add_argument(
        "--runs", type=int, default=1, help="runs of the same job (later ones: warm compile cache)"
    )
    ap.add_argument("--repo", action="append", type=Path, metavar="PATH",
                    help="run the runner of this checkout (labelled by its folder name); repeat to compare")  # fmt: skip
    ap.add_argument(
        "--new-tokens-range",
        metavar="LO,HI",
        help="each row's own max_new_tokens, uniform in [LO, HI] (a dataset column; HI <= --new-tokens)",
    )
    ap.add_argument(
        "--hf-batches", default="16,32", help='transformers\' batch sizes ("": no transformers rows)'
    )
    ap.add_argument("--hf-n", type=int, default=64, help="rows for transformers (the runner's first)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                    help="run the job (--runs times) with these --set values added, labelled; repeat: each variant "
                         "in turn, and transformers once, on the first's rows (keep the prompts and new tokens)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny-qwen2 on CPU, 8 rows")
    a = ap.parse_args()
    if a.smoke:
        a.preset, a.n, a.new_tokens, a.hf_batches = "tiny-qwen2", 8, 4, "2"
    print("command: " + shlex.join(["python", "bench/e2e.py", *sys.argv[1:]]), flush=True)
    sets = [f"model.preset={a.preset}", "model.tp=1", f"data.limit={a.n}"]
    sets += [
        f"generation.max_new_tokens={a.new_tokens}",
        *data_sets(),
        *(SMOKE_SETS if a.smoke else []),
        *a.sets,
    ]
    job = str(Path(a.job).resolve())
    repos = [r.resolve() for r in a.repo or [ROOT]]

    variants = [(v.partition(":")[0], [x for x in v.partition(":")[2].split(",") if x]) for v in a.variant]
    table, runs, commits = [], [], []  # runs: (label, rows)
    with tempfile.TemporaryDirectory(prefix="e2e-") as tmp:
        if a.new_tokens_range:
            sets = with_row_lengths(sets, *map(int, a.new_tokens_range.split(",")), Path(tmp))
        spec = load_job(job, sets)
        for repo in repos:
            name = "batchvl" if repo == ROOT else repo.name
            commits.append(f"{name} {repo} at {git_commit(repo)}")
            for (vlabel, vsets), i in itertools.product(variants or [("", [])], range(1, a.runs + 1)):
                label = " ".join(filter(None, [name, vlabel, f"run{i}"]))
                out = Path(tmp) / label.replace(" ", "-")
                r = run_runner(repo, job, sets + vsets, out)
                # the device's result folder ($OUT): rows and manifest come back for study (few files return)
                if os.environ.get("OUT"):
                    keep = Path(os.environ["OUT"], "runs", out.name)
                    keep.mkdir(parents=True, exist_ok=True)
                    for f in [out / "_manifest.json", *out.glob("*.parquet")]:
                        shutil.copy(f, keep)
                s, m = r["summary"], r["run"]
                peaks = [c["peak_gpu_memory_gib"] for c in m["counts"] if "peak_gpu_memory_gib" in c]
                for c in m[
                    "counts"
                ]:  # the KV pool's margin: what the allocator held at most, of the GPU's memory
                    if "peak_gpu_reserved_gib" in c:
                        print(f"{label}: peak {c['peak_gpu_memory_gib']:.1f} GiB allocated, "
                              f"{c['peak_gpu_reserved_gib']:.1f} reserved, of {c['gpu_memory_gib']:.1f}")  # fmt: skip
                flops = sum(request_flops(from_preset(a.preset), x["num_tiles"], len(x["prompt_token_ids"]),
                                          len(x["output_token_ids"])) for x in r["rows"])  # fmt: skip
                table.append(dict(run=label, req_s=s["request_throughput"], out_tok_s=s["output_token_throughput"],
                                  secs=m["duration_s"], load_s=m["load_s"], ttft_ms=s["mean_ttft_ms"],
                                  tflops=flops / m["duration_s"] / 1e12, peak_gib=max(peaks, default=None),
                                  startup_s=s.get("warm_up_s", 0.0) + s.get("vit_compile_s", 0.0) + s.get("decode_capture_s", 0.0),
                                  startup_parts=m["counts"][0].get("warm_up_parts_s", {}) if m["counts"] else {},
                                  graphs=(s.get("precompiled_loaded"), s.get("dynamo_graphs"), s.get("graph_breaks")),
                                  active=s.get("mean_active_rows")))  # fmt: skip
                runs.append((label, r["rows"]))

    # transformers, in this process now that the runners have exited (their GPU memory is free)
    dev = torch.device("cuda" if spec.model.device != "cpu" and torch.cuda.is_available() else "cpu")
    ceiling = matmul_ceiling()["events_b2b"] if dev.type == "cuda" else None
    batches = [int(x) for x in a.hf_batches.split(",") if x]
    hf_rows, hf_tokens = runs[0][1][: a.hf_n], {}
    if batches:
        hf_tokens = run_transformers(spec, a.preset, dev, hf_rows, batches, a.new_tokens, table)
    hf = [r for r in table if r["run"].startswith("transformers")]
    hf_best = max(hf, key=lambda r: r["out_tok_s"]) if hf else None
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\ncommand: {shlex.join(['python', 'bench/e2e.py', *sys.argv[1:]])}")
    print(f"torch {torch.__version__}, {gpu}; runner: {'; '.join(commits)}")
    print(f"MFU: every row's full model FLOPs (work the caches skip included) / duration / {ceiling:.0f} TFLOP/s "
          "(8192^3 bf16 matmul timed in this run)" if ceiling else "MFU: n/a on CPU")  # fmt: skip
    print("start-up s: the summary's warm-up + ViT compiles and decode captures during the job (rank 0's warm-up: [waiting for compile "
          "helpers /] vit / prefill / decode graphs); graphs: loaded precompiled / traced by Dynamo / "
          "graph breaks; "
          "active: mean rows per decode step")  # fmt: skip
    if hf_best:
        print(f"transformers best: {hf_best['run']}, {hf_best['req_s']:.3f} req/s, "
              f"{hf_best['out_tok_s']:.1f} output tok/s")  # fmt: skip
    print("| run | req/s | output tok/s | duration s | load s | start-up s | graphs | mean TTFT ms | active | MFU "
          "| peak GiB | x best transformers (output tok/s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    def startup(r):
        parts = r.get("startup_parts") or {}
        split = " / ".join(f"{parts[k]:.1f}" for k in ("compile_helpers", *WARM_PARTS) if k in parts)
        return f(r.get("startup_s"), ".1f") + (f" ({split})" if split else "")

    def graphs(g):
        return "n/a" if not g or g[1] is None else " / ".join(str(x or 0) for x in g)

    for r in table:
        mfu = r["tflops"] / ceiling if ceiling else None
        ratio = r["out_tok_s"] / hf_best["out_tok_s"] if hf_best else None
        print(f"| {r['run']} | {r['req_s']:.3f} | {r['out_tok_s']:.1f} | {r['secs']:.1f} | {f(r['load_s'], '.1f')} | "
              f"{startup(r)} | {graphs(r.get('graphs'))} | {f(r['ttft_ms'], '.0f')} | "
              f"{f(r.get('active'), '.1f')} | "
              f"{f(mfu, '.3f')} | {f(r['peak_gib'], '.1f')} | {f(ratio, '.2f')} |")  # fmt: skip
    if hf_best:
        best_b = int(hf_best["run"].split("=")[1])
        n = sum(map(len, hf_tokens[best_b]))
        for label, rows in runs:
            by_id = {x["id"]: x["output_token_ids"] for x in rows}
            mine = [by_id.get(x["id"], []) for x in hf_rows]
            print(
                f"greedy tokens {label} == transformers b={best_b}: {same_tokens(mine, hf_tokens[best_b])}/{n}"
            )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "e2e.json").write_text(
            json.dumps({"argv": sys.argv, "ceiling": ceiling, "rows": table})
        )


if __name__ == "__main__":
    main()
