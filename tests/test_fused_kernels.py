"""The fused step's bookkeeping kernels (``backends/fused_kernels.py``) against their torch
twins (``fused_graph.*_reference``), exactly, on fresh random inputs: confidences with ties
and NaN, drafts that match the greedy tokens for a random prefix, non-finite hidden rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # the interpreter is set up by tests/__init__.py without CUDA

from bitmtp_edge.backends import fused_kernels as fk  # noqa: E402
from bitmtp_edge.backends.fused_graph import (  # noqa: E402
    FusedInputs, fused_accept_reference, fused_chain_reference, fused_prepare_reference,
)
from bitmtp_edge.runtime.decoding_rules import candidate_lengths  # noqa: E402
from tests.helpers import DEVICE, needs_gpu  # noqa: E402

D = 8
MASK = 3


def confidences(g: torch.Generator, m: int, kind: str) -> torch.Tensor:
    conf = torch.rand(m, generator=g)
    if kind == "ties":  # equal probabilities: the shorter length must win in both
        conf = torch.full((m,), 0.5)
    elif kind == "nan":
        conf[int(torch.randint(0, m, (1,), generator=g))] = float("nan")
    elif kind == "ones":
        conf = torch.ones(m)
    return conf


@pytest.mark.parametrize("kind", ["random", "ties", "nan", "ones"])
@pytest.mark.parametrize("pending", [0, 1])
def test_prepare_matches_the_twin(kind, pending):
    g = torch.Generator().manual_seed(hash((kind, pending)) % 1000)
    n = D if pending else D + 1
    for count in (1, 2, 3, D + 1):
        tokens = torch.randint(0, 500, (n,), generator=g).to(DEVICE)
        conf = confidences(g, n - 1, kind)
        for dtype in (torch.float32, torch.float64):  # io.conf, or the draft step's readback
            c = conf.to(dtype).to(DEVICE)
            hist = torch.tensor([40 + int(torch.randint(0, 30, (1,), generator=g))], device=DEVICE)
            ref = fused_prepare_reference(hist, tokens, c, MASK, 256, count, D, pending)
            out = fk.fused_prepare(hist, tokens, c, MASK, 256, count, D, pending)
            for name, a, b in zip(("chosen", "tokens", "positions", "slots", "spans", "attn_rows"), out, ref):
                assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu().reshape(a.shape)), (name, count, a, b)


def test_candidate_lengths_keep_the_shorter_length_on_ties_and_nan_first():
    assert candidate_lengths(torch.full((4,), 0.5), 2).tolist() == [0, 1]  # p = .5 .25 .125 .0625 .0625
    assert candidate_lengths(torch.tensor([1.0, 1.0, 0.5]), 2).tolist() == [2, 3]
    assert candidate_lengths(torch.tensor([0.9, float("nan"), 0.9]), 1).tolist() == [1]


def accept_case(g, n, pending, kind):
    """Inputs of fused_accept: the drafts equal the greedy tokens for a random prefix."""
    c = int(torch.randint(1, n + 1, (1,), generator=g))
    tokens = torch.randint(0, 50, (n,), generator=g)
    greedy = torch.randint(0, 50, (n,), generator=g)
    a = int(torch.randint(0, n, (1,), generator=g))
    greedy[:a] = tokens[1:a + 1]
    width = n + c * D
    x = torch.randn(width, 40, generator=g)
    gconf = torch.rand(n, generator=g)
    if kind == "nonfinite":
        x[int(torch.randint(0, n, (1,), generator=g)), 7] = float("inf")
        gconf[int(torch.randint(0, n, (1,), generator=g))] = float("nan")
    chosen = torch.sort(torch.randperm(n, generator=g)[:c]).values
    conf = torch.rand(n - 1, generator=g)
    drafts = tokens[1:].clone()
    return [t.to(DEVICE) for t in (x, greedy, gconf, tokens, chosen, drafts, conf)]


@pytest.mark.parametrize("kind", ["finite", "nonfinite"])
@pytest.mark.parametrize("pending", [0, 1])
def test_accept_matches_the_twin(kind, pending):
    g = torch.Generator().manual_seed(7 + pending + 10 * (kind == "nonfinite"))
    sl = FusedInputs.slices(D)
    n = D if pending else D + 1
    for _ in range(6):
        x, greedy, gconf, tokens, chosen, drafts, conf = accept_case(g, n, pending, kind)
        results = []
        for fn, draft_values in ((fused_accept_reference, drafts), (fk.fused_accept, drafts)):
            io = FusedInputs.allocate(D, DEVICE)
            io.readback.copy_(torch.randn(io.readback.shape, generator=g, dtype=torch.float64))  # stale values
            hist = torch.tensor([100], device=DEVICE)
            wanted = torch.empty(D - 1, dtype=torch.long, device=DEVICE)
            pending_out = torch.zeros(1, dtype=torch.long, device=DEVICE)
            fn(x, greedy, gconf, tokens, chosen, draft_values, conf, hist, io.readback, wanted, io.causal,
               pending_out, D, pending, sl)
            results.append((hist, wanted, io.causal[:1], pending_out,
                            *(io.readback[sl[k]] for k in ("accepted", "verifier", "hit", "candidates"))))
            results[-1] = results[-1] + (io.readback[sl["held_tokens"]][:n - 1], io.readback[sl["held_conf"]][:n - 1])
        for a, b in zip(*results):
            assert torch.equal(a.cpu(), b.cpu()), (a, b)


def chain_case(g, rows_all, blocks: int):
    """The head's draft rows of ``blocks`` candidate blocks, their tokens and confidences, and
    one block's rows as ``fused_accept`` names them (``wanted``)."""
    top = torch.randint(0, 500, (rows_all.shape[0],), generator=g)
    conf = torch.rand(rows_all.shape[0], generator=g)
    b = int(torch.randint(0, blocks, (1,), generator=g))
    wanted = b * (D - 1) + torch.arange(D - 1)
    return top, conf, wanted


def test_chain_matches_the_twin():
    g = torch.Generator().manual_seed(21)
    sl = FusedInputs.slices(D)
    for trial in range(4):
        blocks = 1 + trial
        rows = torch.randn(blocks * (D - 1), 40, generator=g)
        top, conf, wanted = chain_case(g, rows, blocks)
        if trial % 2:
            rows[wanted[2], 5] = float("nan")
            conf[wanted[4]] = float("inf")
            conf[(wanted[0] + D - 1) % rows.shape[0]] = float("nan")  # another block's: not read
        rows, conf, top, wanted = rows.to(DEVICE), conf.to(DEVICE), top.to(DEVICE), wanted.to(DEVICE)
        outs = []
        for fn in (fused_chain_reference, fk.fused_chain):
            io = FusedInputs.allocate(D, DEVICE)
            fn(rows, top, conf, wanted, io.readback, io.causal, io.conf, sl)
            outs.append((io.readback, io.causal, io.conf))
        for a, b in zip(*outs):
            assert torch.equal(a.cpu(), b.cpu()), (a, b)
        got = outs[1][0][sl["next_tokens"]].cpu().long()
        expect = top[wanted].cpu()
        if trial % 2:
            expect[2] = expect[4] = -1  # the bad row and the bad confidence are flagged
        assert torch.equal(got, expect)


def check_long_rows(bad: float, h: int, seed: int) -> None:
    """Rows of ``h`` values, one non-finite value in a later step of the finiteness check:
    fused_accept and fused_chain against their twins, exactly."""
    g = torch.Generator().manual_seed(seed)
    sl = FusedInputs.slices(D)
    for col in (fk.ROW_STEP + 3, h - 1):
        x, greedy, gconf, tokens, chosen, drafts, conf = accept_case(g, D + 1, 0, "finite")
        x = torch.randn(x.shape[0], h, generator=g).to(DEVICE)
        x[int(torch.randint(0, D + 1, (1,), generator=g)), col] = bad
        outs = []
        for fn in (fused_accept_reference, fk.fused_accept):
            io = FusedInputs.allocate(D, DEVICE)
            hist = torch.tensor([100], device=DEVICE)
            wanted = torch.empty(D - 1, dtype=torch.long, device=DEVICE)
            pending_out = torch.zeros(1, dtype=torch.long, device=DEVICE)
            fn(x, greedy, gconf, tokens, chosen, drafts, conf, hist, io.readback, wanted, io.causal, pending_out,
               D, 0, sl)
            outs.append((hist, wanted, io.readback, io.causal, pending_out))
        for a, b in zip(*outs):
            assert torch.equal(a.cpu(), b.cpu()), (a, b)
        rows = torch.randn(2 * (D - 1), h, generator=g)
        top, conf, wanted = chain_case(g, rows, 2)
        rows[wanted[3], col] = bad
        rows, top, conf, wanted = rows.to(DEVICE), top.to(DEVICE), conf.to(DEVICE), wanted.to(DEVICE)
        outs = []
        for fn in (fused_chain_reference, fk.fused_chain):
            io = FusedInputs.allocate(D, DEVICE)
            fn(rows, top, conf, wanted, io.readback, io.causal, io.conf, sl)
            outs.append((io.readback, io.causal, io.conf))
        for a, b in zip(*outs):
            assert torch.equal(a.cpu(), b.cpu()), (a, b)
        assert outs[1][0][sl["next_tokens"]][3].item() == -1  # the row with the bad value is flagged


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_accept_and_chain_find_a_non_finite_value_anywhere_in_a_long_row(bad):
    """Rows wider than one unrolled step of the finiteness check (fk.ROW_STEP): a value in a
    later step, or in the masked tail of the last one, flags its row exactly as the twins do."""
    check_long_rows(bad, 2 * fk.ROW_STEP + 37, seed=5)  # three steps, the last one partial


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_accept_and_chain_at_the_2b_hidden_size_on_gpu(bad):
    """Compiled, at BitNet-2B's hidden size (2560: ten unrolled steps)."""
    check_long_rows(bad, 2560, seed=6)
