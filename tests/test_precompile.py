"""`Precompiled`: graphs compiled ahead of time, saved, and loaded by a later start; each graph's guards pick it."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import Tensor, nn

from batchvl.precompile import COUNTS, Precompiled

TIGHT = dict(atol=1e-6, rtol=1e-6)  # fp32, compiled vs eager: a few ulps


def scaled_relu(lin: nn.Linear, x: Tensor) -> Tensor:
    return torch.relu(lin(x)) * 2


def _rows_dynamic(lin: nn.Linear, x: Tensor) -> None:
    torch._dynamo.mark_dynamic(x, 0)


def _precompiled(cache: str | None) -> Precompiled:
    return Precompiled(scaled_relu, cache, "test", mark=_rows_dynamic, dynamic=False)


def _counts() -> tuple[int, int]:
    return COUNTS["loaded"], COUNTS["compiled"]


def _delta(before: tuple[int, int]) -> tuple[int, int]:
    return COUNTS["loaded"] - before[0], COUNTS["compiled"] - before[1]


@pytest.mark.slow
def test_graphs_are_saved_loaded_by_a_later_start_and_picked_by_their_guards(tmp_path) -> None:
    """One graph per input dtype (the guards refuse the other), marked rows dynamic; a second `Precompiled` on the
    same folder, as at a later start, loads both, compiles none, and each input runs its own graph, unmarked."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 16)
    lin64 = copy.deepcopy(lin).double()
    c0 = _counts()
    first = _precompiled(str(tmp_path))
    for n in (5, 7, 2):  # rows are dynamic (2 or more: a backed size of 1 is specialized): one graph
        x = torch.randn(n, 8)
        torch.testing.assert_close(first(lin, x), scaled_relu(lin, x), **TIGHT)
    assert _delta(c0) == (0, 1)
    x64 = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(first(lin64, x64), scaled_relu(lin64, x64), **TIGHT)
    assert _delta(c0) == (0, 2) and len(list(tmp_path.rglob("*.bin"))) == 2

    c1 = _counts()
    later = _precompiled(str(tmp_path))
    calls = [
        (lin, torch.randn(4, 8)),
        (lin64, torch.randn(9, 8, dtype=torch.float64)),
        (lin, x64[:2].float()),
    ]
    for layer, x in calls:
        torch.testing.assert_close(later(layer, x), scaled_relu(layer, x), **TIGHT)
    assert _delta(c1) == (2, 0)
    other = Precompiled(scaled_relu, str(tmp_path), "another model", mark=_rows_dynamic, dynamic=False)
    other(lin, torch.randn(2, 8))  # another tag: another folder, nothing loaded
    assert _delta(c1) == (2, 1) and len(list(tmp_path.rglob("*.bin"))) == 3


@pytest.mark.slow
def test_a_loaded_graph_that_refuses_its_inputs_is_logged_with_the_guard_that_failed(
    tmp_path, caplog
) -> None:
    """Weights made in inference mode (inference tensors) fail a saved graph's guards on their dispatch keys: the
    start compiles again and says which guard refused (the way gpu_parity found its own harness's mistake)."""
    lin, x = nn.Linear(8, 16).requires_grad_(False), torch.randn(3, 8)
    _precompiled(str(tmp_path))(lin, torch.randn(3, 8))  # (a tensor of its own: the compile marks it)
    with torch.inference_mode():
        lin_inf = copy.deepcopy(lin)
    c0 = _counts()
    with caplog.at_level(logging.INFO, logger="batchvl.precompile"):
        out = _precompiled(str(tmp_path))(lin_inf, x)
    torch.testing.assert_close(out, scaled_relu(lin, x), **TIGHT)
    assert _delta(c0) == (1, 1)
    assert "the 1 loaded from disk refused these inputs: tensor" in caplog.text
    assert "dispatch key set mismatch" in caplog.text


@pytest.mark.slow
def test_an_unloadable_graph_is_dropped_and_compiled_again(tmp_path, caplog) -> None:
    lin, x = nn.Linear(8, 16), torch.randn(3, 8)
    _precompiled(str(tmp_path))(lin, x)
    (saved,) = tmp_path.rglob("*.bin")
    saved.write_bytes(b"torn")
    c0 = _counts()
    with caplog.at_level(logging.WARNING, logger="batchvl.precompile"):
        out = _precompiled(str(tmp_path))(lin, x)
    torch.testing.assert_close(out, scaled_relu(lin, x), **TIGHT)
    assert _delta(c0) == (0, 1) and "dropping unloadable precompiled graph" in caplog.text
    assert not saved.exists() and len(list(tmp_path.rglob("*.bin"))) == 1


@pytest.mark.slow
def test_falls_back_to_torch_compile_when_aot_compile_fails(tmp_path, caplog) -> None:
    """A torch that cannot compile ahead of time (here: Inductor's caches forced off) still runs compiled, through
    `torch.compile` with the marks applied at every call, and saves nothing; a later start on the same folder goes
    to torch.compile at once (it would otherwise trace twice at every start)."""
    lin = nn.Linear(8, 16)
    p = _precompiled(str(tmp_path))
    # the config's own patch: a monkeypatch of this setting does not undo cleanly on torch 2.11 (later tests fail)
    with torch._inductor.config.patch(force_disable_caches=True):
        with caplog.at_level(logging.WARNING, logger="batchvl.precompile"):
            for n in (3, 6):
                x = torch.randn(n, 8)
                torch.testing.assert_close(p(lin, x), scaled_relu(lin, x), **TIGHT)
    assert p.fallback is not None and "could not compile scaled_relu ahead of time" in caplog.text
    assert not list(tmp_path.rglob("*.bin"))

    caplog.clear()
    c0 = _counts()
    later = _precompiled(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="batchvl.precompile"):
        torch.testing.assert_close(later(lin, x), scaled_relu(lin, x), **TIGHT)
    assert later.fallback is not None and not caplog.text and _delta(c0) == (0, 0)


@pytest.mark.slow
def test_a_graph_that_cannot_be_saved_serves_this_process_and_later_starts_use_torch_compile(
    tmp_path, monkeypatch, caplog
) -> None:
    from torch._dynamo.aot_compile import AOTCompiledFunction

    def refuse(self, path, *a, **k):
        raise RuntimeError("Failed to serialize")

    monkeypatch.setattr(AOTCompiledFunction, "save_compiled_function", refuse)
    lin, x = nn.Linear(8, 16), torch.randn(3, 8)
    c0 = _counts()
    p = _precompiled(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="batchvl.precompile"):
        torch.testing.assert_close(p(lin, x), scaled_relu(lin, x), **TIGHT)
        torch.testing.assert_close(p(lin, x[:2]), scaled_relu(lin, x[:2]), **TIGHT)
    assert (
        "could not save scaled_relu ahead of time" in caplog.text
        and "later starts use torch.compile" in caplog.text
    )
    assert p.fallback is None and _delta(c0) == (0, 1) and not list(tmp_path.rglob("*.bin*"))
    later = _precompiled(str(tmp_path))
    torch.testing.assert_close(later(lin, x), scaled_relu(lin, x), **TIGHT)
    assert later.fallback is not None and _delta(c0) == (0, 1)
