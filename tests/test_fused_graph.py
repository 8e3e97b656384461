"""The fused step on the replayable runtime against the reference backend.

On the CPU the graph backend runs its fused graph bodies eagerly with the kernels' twins
(every device op of the body: candidate choice, rows, spans, accept, chaining); with
``kernels=True`` the Triton kernels themselves run under the interpreter. The GPU tests add
capture and replay, and check fused == AR token for token on ``ampere`` and ``server``.
"""

from __future__ import annotations

import pytest
import torch

from bitmtp_edge.backends.fused_graph import FusedInputs, fused_width
from bitmtp_edge.backends.graph import RuntimeOptions
from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, decode
from tests.helpers import DEVICE, fast_backend, needs_gpu, random_model, reference_backend, write_test_artifact
from tests.test_decoding import run

PROMPT = [3, 14, 15, 92, 65, 35]


def both(model, policy, n=40, block_size=4, **kw):
    options = kw.pop("options", None)
    ref_backend = reference_backend(model, max_context=256, smallest=16, block_size=block_size)
    ref, ref_stats = run(ref_backend, PROMPT, policy, n=n, block_size=block_size, **kw)
    fast = fast_backend(model, max_context=256, smallest=16, block_size=block_size, options=options)
    out, stats = run(fast, PROMPT, policy, n=n, block_size=block_size, **kw)
    return ref, ref_stats, out, stats, fast


@pytest.mark.parametrize("seed,candidates", [(0, 1), (0, 3), (1, 2), (1, 5)])
def test_fused_graph_body_matches_the_reference_and_reads_once_per_iteration(seed, candidates):
    model = random_model(seed)
    ar, _ = run(reference_backend(model, max_context=256), PROMPT, "ar", n=40, block_size=None)
    ref, ref_stats, out, stats, fast = both(model, "fused", candidates=candidates)
    assert out == ref == ar
    assert stats.forward_passes == ref_stats.forward_passes  # the same candidates, hits and misses
    assert stats.host_syncs == stats.iterations  # one read per iteration, draft step or not
    assert stats.segment_growths >= 2
    d = 4
    widths = {(s.width, s.role) for s in fast.log.states}
    # after a draft step as after a hit: one fused width (the anchor reopened, d_1..d_{D-1})
    assert widths == {(1 + d, "draft"), (fused_width(d, d, candidates), "fused")}


def test_a_draft_steps_drafts_come_back_whole_with_the_fused_steps_read():
    """After a draft step the fused pass verifies d_1..d_{D-1} only; the host still gets all D
    drafts and confidences of the draft step (the hybrid/flag checks read them), in the same
    single read, and they are the reference backend's."""
    model, d = random_model(7), 4
    ref = reference_backend(model, max_context=64, smallest=16, block_size=d)
    fast = fast_backend(model, max_context=64, smallest=16, block_size=d)
    for b in (ref, fast):
        b.prefill(PROMPT[:-1])
    want, got = ref.draft_step(PROMPT[-1:], d), fast.draft_step(PROMPT[-1:], d)
    assert not got.loaded  # lazy: nothing read yet
    syncs = fast.log.host_syncs
    fast.fused_step(PROMPT[-1], [], got, 2, d)
    assert fast.log.host_syncs == syncs + 1 and got.loaded
    assert got.tokens == want.tokens and len(got.confidences) == d
    torch.testing.assert_close(torch.tensor(got.confidences), torch.tensor(want.confidences), rtol=0, atol=1e-5)


def test_fused_graph_body_at_block_size_eight():
    model = random_model(2)
    ref, _, out, stats, _ = both(model, "fused", n=30, block_size=8, candidates=3)
    assert out == ref and stats.host_syncs == stats.iterations


def test_hybrid_with_fused_passes_matches_the_reference():
    model = random_model(3)
    ref, _, out, stats, _ = both(model, "hybrid", tau=0.6, min_prefix=2, candidates=2, hybrid_fused=True)
    assert out == ref
    assert stats.fused_calls > 0  # verified some blocks with fused passes
    assert stats.iterations > stats.fused_calls  # and committed some confident prefixes unverified


@pytest.mark.parametrize("preset", ["generic", "m1"])
def test_fused_without_hoisting_uploads_the_drafts_and_keeps_the_tokens(preset):
    base = RuntimeOptions.preset(preset)
    opts = RuntimeOptions(specialize=base.specialize, graphs=False, hoist_verify=base.hoist_verify,
                          kv_dtype=torch.float32)
    ref, _, out, _, _ = both(random_model(4), "fused", n=30, candidates=2, options=opts)
    assert out == ref


def test_fused_states_are_captured_at_load_for_the_configured_counts():
    model = random_model(5)
    fast = fast_backend(model, max_context=64, smallest=16,
                        options=RuntimeOptions(graphs=False, kv_dtype=torch.float32, fused_candidates=(1, 3)))
    fused = {(s.width, s.segment) for s in fast.states() if s.role == "fused"}
    segments = range(len(fast.plan.segments))
    assert fused == {(w, seg) for seg in segments for w in (4 + 4, 4 + 12)}  # D causal rows + c blocks
    assert fast.kv.allocated_workspace == 5 * 4  # up to D + 1 blocks of D rows
    assert fast.kv.view().workspace == fast.plan.workspace  # the other steps' views stay narrow


def test_readback_layout_holds_every_field_once():
    sl = FusedInputs.slices(8)
    covered = sorted(i for s in sl.values() for i in range(s.start, s.stop))
    assert covered == list(range(FusedInputs.allocate(8, "cpu").readback.numel()))


def test_fused_on_the_triton_kernels_chooses_the_twins_tokens():
    """The fused graph body on the Triton kernels (interpreted) against the twins: row spans
    in the attention kernel, the heads on their rows, same tokens as AR."""
    pytest.importorskip("triton")
    model = random_model(9, layers=1)
    outs = [run(fast_backend(model, max_context=64, smallest=16, kernels=k, head_dtype=torch.float16,
                             device=DEVICE if k else "cpu"),
                PROMPT, "fused", n=10, block_size=4, candidates=2)[0] for k in (False, True)]
    assert outs[0] == outs[1]


# --- on a GPU: capture and replay ---------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@needs_gpu
@pytest.mark.parametrize("runtime", ["generic", "full"])
def test_gpu_fused_equals_ar_token_for_token(tmp_path, runtime):
    """GQA group 4 and D = 8 as in BitNet-2B: a fused row shares every float with the AR row."""
    from bitmtp_edge import Engine

    model = random_model(6, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    eng = Engine.load(art, backend="ampere", device="cuda", runtime=runtime)
    ar = eng.generate(PROMPT, max_new_tokens=100, policy="ar")
    for c in (1, 3, 9):  # 1 and 3 are captured at load (AUTO_CANDIDATES), 9 at first use
        res = eng.generate(PROMPT, max_new_tokens=100, policy="fused", candidates=c)
        assert res.token_ids == ar.token_ids, c
        if runtime == "full":  # Generic prepares the verify rows on the host: it reads the drafts first
            assert res.stats.host_syncs == res.stats.iterations
    stats = DecodeStats()
    opts = DecodeOptions("hybrid", 100, block_size=8, tau=1.0, hybrid_fused=True, stop_token_ids=eng.eos_token_ids)
    hyb = [t for chunk in decode(eng.backend, PROMPT, opts, stats) for t in chunk]
    assert hyb == ar.token_ids and stats.fused_calls == stats.iterations
