"""CUDA only (run on the GPU machine): decode graphs are captured safely while another thread pins host memory, as
the preprocessing pipeline's helper thread does for every batch of tiles: the largest at the warm-up, the others when
a job's steps first need them (while rows flow)."""

from __future__ import annotations

import threading

import pytest
import torch

from batchvl.engine import Engine
from batchvl.model.loader import random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_while_another_thread_pins_memory():
    model, cfg = random_model("tiny-qwen2", torch.device("cuda"), torch.bfloat16, seed=0)
    eng = Engine(model, cfg, device="cuda", dtype=torch.bfloat16, max_seq_len=4096, pool_blocks=64)
    stop, errors = threading.Event(), []

    def pin() -> None:
        while not stop.is_set():
            try:
                torch.empty(1 << 20).pin_memory()
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(e)
                return

    t = threading.Thread(target=pin)
    t.start()
    try:
        for _ in range(3):
            eng.decode_step.clear()  # capture every bucket again, each time under the other thread's pinning
            eng.warm_up()  # the largest bucket
            assert eng.decode_step.failed is None and eng.decode_step.captures == 1, eng.decode_step.failed
            warm_s = eng.decode_step.capture_s
            for rows in (256, 128, 64, 32, 16, 8):  # the others, as a job's steps first need them
                z = torch.zeros(rows, dtype=torch.long, device="cuda")
                eng.decode_step(z, z.clone(), eng.tables[:rows], eng.pool)
            assert eng.decode_step.failed is None and eng.decode_step.captures == 7, eng.decode_step.failed
            assert eng.decode_step.capture_s > warm_s > 0  # each capture's seconds counted
    finally:
        stop.set()
        t.join()
    assert not errors
