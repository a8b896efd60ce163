"""Decode attention (`llm/decode_attention.py`): the reference against a plain per-row softmax, and the split-key
Triton kernel through Triton's interpreter on CPU against the reference (fp32 tightly, fp16 within its rounding)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from test_bench import _run_interpreted

from batchvl.ops.decode_attention import (
    decode_attention,
    decode_attention_reference,
    kernel_ok,
    kernel_runs,
    num_chunks,
)
from batchvl.llm.kv_cache import KVArena


def _plain(q, k, v, lens):
    """Row by row, head by head: softmax(q . k[:len] / sqrt(D)) @ v[:len]."""
    B, H, D = q.shape
    rep = H // k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(H):
            kk, vv = k[b, h // rep, : lens[b]], v[b, h // rep, : lens[b]]
            out[b, h] = torch.softmax(kk @ q[b, h] / D**0.5, dim=0) @ vv
    return out


@pytest.mark.parametrize("rep", [1, 4, 5])
def test_reference_and_cpu_op_are_plain_softmax(rep) -> None:
    """The masked-SDPA reference (and the op, which runs it on CPU) = a per-row softmax over the valid keys only;
    what the padded slots hold does not matter."""
    torch.manual_seed(0)
    B, Hkv, S, D = 3, 2, 40, 16
    q = torch.randn(B, Hkv * rep, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    lens = torch.tensor([1, 17, 40])
    want = _plain(q, k, v, lens)
    k[0, :, 1:], v[1, :, 17:] = 1e4, -1e4  # garbage past the lengths
    assert not kernel_ok(q, k)  # CPU, fp32: never the kernel
    torch.testing.assert_close(decode_attention_reference(q, k, v, lens), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_attention(q, k, v, lens), want, atol=1e-5, rtol=1e-5)


def test_kernel_runs_and_the_arena_clears_only_for_the_reference() -> None:
    """The Triton path's shape rule, and the KV arena's per-batch clear: on by default (the masked-SDPA reference
    reads every slot), off where the kernel runs (then a batch sees the previous batch's values, never read)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not kernel_runs(cpu, torch.float32, 8, 2, 32)  # CPU without the interpreter: the reference
    if kernel_runs.__globals__["triton"] is not None:
        assert kernel_runs(cuda, torch.bfloat16, 32, 8, 128) and kernel_runs(cuda, torch.float16, 40, 8, 128)
    for args in ((torch.float32, 32, 8, 128), (torch.bfloat16, 32, 8, 96), (torch.bfloat16, 34, 2, 128)):
        assert not kernel_runs(cuda, *args)  # fp32; head_dim not a power of two; 17 query heads per kv head
    for clear in (True, False):
        arena = KVArena(2, 2, 16, "cpu", torch.float32, clear=clear)
        arena.cache(3, 40).k.fill_(7.0)
        again = arena.cache(2, 40)  # the same buffers, a smaller batch
        assert bool((again.k == 0).all()) == clear and bool((again.k == 7.0).all()) == (not clear)
    assert bool(
        (KVArena(2, 2, 16, "cpu", torch.float32, clear=False).cache(3, 40).k == 0).all()
    )  # new: zeroed


def test_engine_clears_its_arena_only_without_the_kernel() -> None:
    from batchvl.engine import Engine, EngineConfig
    from batchvl.config import from_preset
    from batchvl.model.loader import random_model

    model, cfg = random_model(from_preset("tiny-qwen2"))
    assert Engine(model, cfg, EngineConfig()).arena.clear  # CPU fp32: the reference decode reads every slot


def test_engine_through_the_kernel_with_an_uncleared_arena() -> None:
    """The whole engine with the decode kernel (TRITON_INTERPRET=1, text-only requests): its arena is not cleared
    between batches, the slots a previous batch left (here overwritten with NaN) are never read, and the tokens equal
    an engine whose decode attention is the reference (masked SDPA over a cleared cache)."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        import batchvl.llm.decoder as decoder
        from batchvl.engine import Engine, EngineConfig, Request, Sampling
        from batchvl.ops.decode_attention import decode_attention_reference
        from batchvl.config import from_preset
        from batchvl.model.loader import random_model
        model, cfg = random_model(from_preset("tiny-qwen2"), seed=3)
        g = torch.Generator().manual_seed(0)
        reqs = [Request(torch.randint(0, 150000, (n,), generator=g)) for n in (40, 7, 25, 3, 60)]
        s = Sampling(max_new_tokens=4, ignore_eos=True)
        eng = Engine(model, cfg, EngineConfig())
        eng.row_multiple, eng.len_multiple = 8, 128  # the decode graphs' padded layout (run eagerly here)
        assert not eng.arena.clear
        eng.run_batch(reqs, s)
        with torch.inference_mode():  # what a previous batch might leave
            eng.arena.k.fill_(float("nan")), eng.arena.v.fill_(float("nan"))
        got = eng.run_batch(reqs[1:4], s).output_ids
        assert eng.arena.k.isnan().any()  # not cleared
        decoder.decode_attention = decode_attention_reference  # the reference, on a cleared cache
        ref = Engine(model, cfg, EngineConfig())
        ref.arena.clear = True
        assert got == ref.run_batch(reqs[1:4], s).output_ids, got
        print("ok")
        """
    )
    _run_interpreted(code)


def test_num_chunks() -> None:
    assert num_chunks(40, 8, 2048, 64) == 4  # 320 (row, kv head) pairs -> 1280 programs
    assert num_chunks(1, 8, 2048, 64) == 32  # capped at one block per chunk
    assert num_chunks(1, 1, 50, 64) == 1
    assert num_chunks(4096, 8, 2048, 64) == 1


def test_kernel_in_the_interpreter() -> None:
    """`_decode_attention_triton` (TRITON_INTERPRET=1) = the reference: GQA groups of 1, 4 and 5 (padded to 16 rows),
    lengths 1, mid-chunk and full, one chunk or many (some empty), garbage past the lengths; fp32 below 1e-6 by norm,
    fp16 below 2e-3 against fp32 sums. Then the op's own dispatch, and a cache view with strided rows (one layer of
    a [layers, rows, ...] arena)."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.decode_attention import (
            _decode_attention_triton, decode_attention, decode_attention_reference, kernel_ok)
        torch.manual_seed(0)
        worst = {}
        B, Hkv, S, D = 3, 2, 100, 32
        lens = torch.tensor([1, 37, 100])
        for rep in (1, 4, 5):
            for chunks in (1, 3, 7):
                for dt in (torch.float32, torch.float16):
                    q = torch.randn(B, Hkv * rep, D).to(dt)
                    k, v = (torch.randn(B, Hkv, S, D) * 1.5).to(dt), torch.randn(B, Hkv, S, D).to(dt)
                    for b, n in enumerate(lens.tolist()):
                        k[b, :, n:], v[b, :, n:] = 300.0, float("nan")  # never read
                    got = _decode_attention_triton(q, k, v, lens, block_n=16, chunks=chunks).float()
                    ref = decode_attention_reference(q.float(), k.float(), v.float().nan_to_num(), lens)
                    err = float((got - ref).norm() / ref.norm())
                    worst[dt] = max(worst.get(dt, 0.0), err)
        assert worst[torch.float32] < 1e-6 and worst[torch.float16] < 2e-3, worst
        arena = torch.randn(2, B, Hkv, S, D)  # [layers, rows, kv heads, S, D]
        q = torch.randn(B, Hkv * 4, D)
        assert kernel_ok(q, arena[1])
        got = decode_attention(q, arena[1], arena[0], lens)
        ref = decode_attention_reference(q, arena[1], arena[0], lens)
        assert float((got - ref).norm() / ref.norm()) < 1e-6
        assert not kernel_ok(torch.randn(B, 8, 24), torch.randn(B, 2, S, 24))  # head_dim not a power of two
        assert not kernel_ok(torch.randn(B, 34, 32), torch.randn(B, 2, S, 32))  # 17 query heads per kv head
        print("ok", worst)
        """
    )
    _run_interpreted(code)
