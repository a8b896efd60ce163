"""Tensor/data-parallel ViT on gloo (CPU, fp32) vs one process; and the TP/DP cost model."""

from __future__ import annotations

import socket

import pytest
import torch

from batchvl.config import from_preset
from batchvl.encoder.internvit import VisionEncoder
from batchvl.encoder.split_overlap import choose_vit_mode, split_sizes, vit_flops_per_tile, vit_mode_costs

ATOL, RTOL = 1e-5, 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    import dist_vit_worker as w

    d = tmp_path_factory.mktemp("dist_vit")
    w.make_inputs(d)
    refs = {}
    for kind in w.KINDS:
        enc = VisionEncoder(w.tp_cfg(kind)).eval()
        enc.load_state_dict(torch.load(d / f"{kind}.pt"))
        with torch.no_grad():
            for n in (7, 3):
                refs[f"{kind}/{n}"] = enc(torch.load(d / f"px{n}.pt"))
    return d, refs


def test_split_sizes() -> None:
    assert split_sizes(25, 4) == [7, 6, 6, 6]
    assert split_sizes(7, 4) == [2, 2, 2, 1]
    assert split_sizes(3, 4) == [1, 1, 1, 0]
    assert split_sizes(12800, 8) == [1600] * 8


def test_cost_model() -> None:
    six, three = from_preset("internvl2_5-26b"), from_preset("internvl2_5-1b")
    assert sum(vit_flops_per_tile(six.vision)) == pytest.approx(11.94e12, rel=2e-3)
    assert sum(vit_flops_per_tile(three.vision)) == pytest.approx(0.72e12, rel=5e-3)
    # a single tile on 4 GPUs: only TP uses them all; many tiles: DP has no communication
    assert choose_vit_mode(1, six, 4) == "tp"
    assert choose_vit_mode(64, six, 4) == "dp"
    assert choose_vit_mode(64, six, 1) == "dp"
    # slow links make TP lose even for one tile
    assert choose_vit_mode(1, six, 4, {"bus_bw": 1e9}) == "dp"
    c = vit_mode_costs(8, six, 4, {"t_tile": 0.02})
    assert c["dp"] == pytest.approx(2 * 0.02, rel=0.05)


@pytest.mark.slow
@pytest.mark.multiproc
def test_tp_dp_match_one_process(inputs, monkeypatch) -> None:
    """On 2 and 4 ranks: TP (1, 2, 3 micro-batches, and hook-driven) and DP (7 and 3 tiles) equal one process; on 2
    ranks also TP with its stages compiled (the builder's TP unless eager)."""
    import dist_vit_worker as w
    import torch.multiprocessing as mp

    d, refs = inputs
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(w.worker, args=(4, _free_port(), str(d)), nprocs=4)  # one spawn: a 2-rank subgroup, then all 4
    for world, rank in [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]:
        heads = split_sizes(5, world)
        res = torch.load(d / f"out_{world}_{rank}.pt")
        for kind in w.KINDS:
            assert int(res[f"{kind}/qkv_rows"]) == 3 * 16 * heads[rank]  # uneven heads: 3/2 or 2/1/1/1
            for n in (7, 3):
                torch.testing.assert_close(res[f"{kind}/dp{n}"], refs[f"{kind}/{n}"], atol=ATOL, rtol=RTOL)
            for key in ("tp_mb1", "tp_mb2", "tp_mb3", "tp_hooks"):
                torch.testing.assert_close(res[f"{kind}/{key}"], refs[f"{kind}/7"], atol=ATOL, rtol=RTOL)
            if world == 2:  # 6 of the 7 tiles
                torch.testing.assert_close(
                    res[f"{kind}/tp_compiled"], refs[f"{kind}/7"][:6], atol=ATOL, rtol=RTOL
                )
            # micro-batch splits give the same result as no split
            torch.testing.assert_close(res[f"{kind}/tp_mb2"], res[f"{kind}/tp_mb1"], atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_compiled_tp_takes_any_tile_count(tmp_path) -> None:
    """The compiled TP stages see a new micro-batch size with every new tile count (no buckets): more sizes than
    Dynamo's recompile limit must still run, and equal the eager encoder (one rank of gloo, in a subprocess)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    code = textwrap.dedent(
        f"""
        import copy, os, sys, torch, torch.distributed as dist
        sys.path.insert(0, {str(repo / "tests")!r})
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{_free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from test_internvit import build_pair
        from batchvl.encoder.split_overlap import TPVisionEncoder
        enc, _ = build_pair("300m")
        ref = copy.deepcopy(enc)
        tp = TPVisionEncoder(enc, None, 2, compile=True)
        for n in range(1, 21):  # micro-batches of 1..10 tiles: 10 sizes
            px = torch.randn(n, 3, 112, 112)
            with torch.no_grad():
                torch.testing.assert_close(tp(px), ref(px), atol=1e-5, rtol=1e-4)
        print("ok")
        """
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
