"""Decode attention over the paged KV pool (`ops/decode_attention.py`): the reference against a plain per-sequence
softmax over its blocks, and the split-key Triton kernel through Triton's interpreter on CPU against the reference
(fp32 tightly, fp16 within its rounding)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import run_interpreted

from batchvl.llm.kv_cache import KVPool
from batchvl.ops.decode_attention import (
    BLOCK,
    decode_attention,
    decode_attention_reference,
    kernel_ok,
    kernel_runs,
    num_chunks,
)


def _plain(q, k_pool, v_pool, lens, table):
    """Sequence by sequence, head by head: softmax(q . k / sqrt(D)) @ v over the keys its blocks hold below len."""
    B, H, D = q.shape
    rep = H // k_pool.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(lens[b])
        blocks = [int(x) for x in table[b, : -(-n // BLOCK)]]
        for h in range(H):
            kk = torch.cat([k_pool[x, h // rep] for x in blocks])[:n]
            vv = torch.cat([v_pool[x, h // rep] for x in blocks])[:n]
            out[b, h] = torch.softmax(kk @ q[b, h] / D**0.5, dim=0) @ vv
    return out


@pytest.mark.parametrize("rep", [1, 4, 5])
def test_reference_and_cpu_op_are_plain_softmax(rep) -> None:
    """The reference (and the op, which runs it on CPU) = a per-sequence softmax over its valid keys, found through
    its row of the block table; what other slots and blocks hold does not matter."""
    torch.manual_seed(0)
    N, Hkv, D = 12, 2, 16
    q = torch.randn(3, Hkv * rep, D)
    k, v = torch.randn(N, Hkv, BLOCK, D), torch.randn(N, Hkv, BLOCK, D)
    table = torch.tensor([[5, 0, 0], [2, 9, 0], [11, 3, 7]], dtype=torch.int32)  # blocks in any order
    lens = torch.tensor([1, 70, 3 * BLOCK])
    want = _plain(q, k, v, lens, table)
    k[5, :, 1:], v[9, :, 70 - BLOCK :], k[0], v[1] = (
        1e4,
        -1e4,
        1e4,
        1e4,
    )  # garbage past the lengths, unused blocks
    assert not kernel_ok(q, k)  # CPU, fp32: never the kernel
    torch.testing.assert_close(decode_attention_reference(q, k, v, lens, table), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_attention(q, k, v, lens, table), want, atol=1e-5, rtol=1e-5)


def test_kernel_runs_on_these_shapes() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not kernel_runs(cpu, torch.float32, 8, 2, 32)  # CPU without the interpreter: the reference
    if kernel_runs.__globals__["triton"] is not None:
        assert kernel_runs(cuda, torch.bfloat16, 32, 8, 128) and kernel_runs(cuda, torch.float16, 40, 8, 128)
    for args in ((torch.float32, 32, 8, 128), (torch.bfloat16, 32, 8, 96), (torch.bfloat16, 34, 2, 128)):
        assert not kernel_runs(cuda, *args)  # fp32; head_dim not a power of two; 17 query heads per kv head


def test_pool_hands_out_blocks_with_reference_counts() -> None:
    pool = KVPool(2, 6, 2, 16, "cpu", torch.float32)
    assert pool.free == 5  # block 0 is scratch
    a = pool.allocate(3)
    assert 0 not in a and pool.free == 2
    pool.retain(a[:2])  # shared by a second sequence
    pool.release(a)
    assert pool.free == 3 and [pool.refs[b] for b in a[:2]] == [1, 1]
    pool.release(a[:2])
    assert pool.free == 5
    with pytest.raises(MemoryError):
        pool.allocate(6)


def test_num_chunks() -> None:
    assert num_chunks(40, 8, 2048, 64) == 4  # 320 (sequence, kv head) pairs -> 1280 programs
    assert num_chunks(1, 8, 2048, 64) == 32  # capped at one block per chunk
    assert num_chunks(1, 1, 50, 64) == 1
    assert num_chunks(4096, 8, 2048, 64) == 1
    assert num_chunks(23, 2, 2304, 64) == 32  # 23 chunks wanted: a power of two, so few merge kernels compile
    assert num_chunks(1, 2, 36 * 64, 64) == 32  # 36 blocks: rounded down
    assert {num_chunks(r, 2, 2304, 64) for r in range(1, 513)} == {1, 2, 4, 8, 16, 32}


def test_kernel_in_the_interpreter() -> None:
    """`_decode_attention_triton` (TRITON_INTERPRET=1) = the reference: GQA groups of 1, 4 and 5 (padded to 16 rows),
    lengths 1, mid-block and whole blocks, one chunk or many (some empty), blocks shuffled in the pool, garbage past
    the lengths; fp32 below 1e-6 by norm, fp16 below 2e-3 against fp32 sums. Then the op's own dispatch on one layer
    of a [layers, blocks, ...] pool (strided blocks)."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.decode_attention import (
            BLOCK, _decode_attention_triton, decode_attention, decode_attention_reference, kernel_ok)
        torch.manual_seed(0)
        worst = {}
        N, Hkv, D, W = 20, 2, 32, 4
        lens = torch.tensor([1, 100, 4 * BLOCK])
        table = torch.stack([torch.randperm(N - 1)[:W] + 1 for _ in range(3)]).int()
        for rep in (1, 4, 5):
            for chunks in (1, 3, 7):
                for dt in (torch.float32, torch.float16):
                    q = torch.randn(3, Hkv * rep, D).to(dt)
                    k, v = (torch.randn(N, Hkv, BLOCK, D) * 1.5).to(dt), torch.randn(N, Hkv, BLOCK, D).to(dt)
                    k[0], v[0] = 300.0, float("nan")  # block 0 is in no table: never read
                    got = _decode_attention_triton(q, k, v, lens, table, chunks=chunks).float()
                    ref = decode_attention_reference(q.float(), k.float(), v.float().nan_to_num(), lens, table)
                    err = float((got - ref).norm() / ref.norm())
                    worst[dt] = max(worst.get(dt, 0.0), err)
        assert worst[torch.float32] < 1e-6 and worst[torch.float16] < 2e-3, worst
        pool = torch.randn(2, N, Hkv, BLOCK, D)  # [layers, blocks, kv heads, BLOCK, D]
        q = torch.randn(3, Hkv * 4, D)
        assert kernel_ok(q, pool[1])
        got = decode_attention(q, pool[1], pool[0], lens, table)
        ref = decode_attention_reference(q, pool[1], pool[0], lens, table)
        assert float((got - ref).norm() / ref.norm()) < 1e-6
        assert not kernel_ok(torch.randn(3, 8, 24), torch.randn(N, 2, BLOCK, 24))  # head_dim not a power of two
        assert not kernel_ok(torch.randn(3, 34, 32), torch.randn(N, 2, BLOCK, 32))  # 17 query heads per kv head
        print("ok", worst)
        """
    )
    run_interpreted(code)


def test_engine_through_the_kernel() -> None:
    """The whole engine with the decode kernel (TRITON_INTERPRET=1, text-only requests, rows admitted while others
    decode) gives the tokens of an engine whose decode attention is the reference."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        import batchvl.llm.decoder as decoder
        from batchvl.engine import Engine, Request, Sampling
        from batchvl.ops.decode_attention import decode_attention_reference
        from batchvl.model.loader import random_model
        model, cfg = random_model("tiny-qwen2", seed=3)
        g = torch.Generator().manual_seed(0)
        s = Sampling(max_new_tokens=4, ignore_eos=True)
        reqs = lambda: [Request(torch.randint(0, 150000, (n,), generator=torch.Generator().manual_seed(n)), sampling=s)
                        for n in (40, 7, 25, 3, 60)]
        got = [f.output_ids for f in Engine(model, cfg, max_seq_len=512, pool_blocks=40).generate(reqs())]
        decoder.decode_attention = decode_attention_reference
        want = [f.output_ids for f in Engine(model, cfg, max_seq_len=512, pool_blocks=40).generate(reqs())]
        assert got == want, (got, want)
        print("ok")
        """
    )
    run_interpreted(code)
