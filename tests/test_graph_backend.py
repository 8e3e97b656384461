"""The replayable runtime's static-buffer logic against the reference backend.

On the CPU the graph backend runs eagerly with the kernels' PyTorch twins: every device
tensor op of its steps (positions, masks, KV boundary copies, accepted count, chaining)
runs exactly as it would inside a captured graph. The GPU tests add capture and replay.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from bitmtp_edge.backends.graph import RuntimeOptions
from bitmtp_edge.runtime.policies import POLICIES
from tests.helpers import DEVICE, fast_backend, needs_gpu, random_model, reference_backend, write_test_artifact
from tests.test_decoding import run

PROMPT = [3, 14, 15, 92, 65, 35]


def both(model, policy, n=40, **kw):
    bs = None if policy == "ar" else 4
    ref, _ = run(reference_backend(model, max_context=256, smallest=16), PROMPT, policy, n=n, block_size=bs,
                 tau=0.3, min_prefix=2)
    fast = fast_backend(model, max_context=256, smallest=16, **kw)
    out, stats = run(fast, PROMPT, policy, n=n, block_size=bs, tau=0.3, min_prefix=2)
    return ref, out, stats, fast


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", POLICIES)
def test_fast_backend_matches_reference(seed, policy):
    ref, out, stats, _ = both(random_model(seed), policy)
    assert out == ref
    assert stats.segment_growths >= 1


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", POLICIES)
def test_int8_verify_head_follows_the_reference_with_the_same_head(seed, policy):
    """``verify_head="int8"``: every role reads the int8 head; the graph backend (the kernels'
    twins) and the reference model after ``use_int8_verify_head`` give the same tokens under
    every policy, and the 16-bit head is not held on the device."""
    model = random_model(seed)
    ref_model = copy.deepcopy(model)
    ref_model.use_int8_verify_head()
    bs = None if policy == "ar" else 4
    ref, _ = run(reference_backend(ref_model, max_context=256, smallest=16), PROMPT, policy, n=40, block_size=bs,
                 tau=0.3, min_prefix=2)
    fast = fast_backend(model, max_context=256, smallest=16, verify_head="int8")
    out, _ = run(fast, PROMPT, policy, n=40, block_size=bs, tau=0.3, min_prefix=2)
    assert out == ref
    assert fast.fast.verify_head is None and fast.fast.int8_head is fast.fast.draft_head


def test_int8_verify_head_is_lossless_against_its_own_ar():
    """With the int8 head in the verify role, speculative and fused equal that head's AR token for
    token (and hybrid at tau = 1), on the graph backend."""
    fast = fast_backend(random_model(4), max_context=256, smallest=16, verify_head="int8")
    ar, _ = run(fast, PROMPT, "ar", n=48, block_size=None)
    for policy, kw in (("speculative", {}), ("fused", {}), ("hybrid", {"tau": 1.0, "min_prefix": 2})):
        out, _ = run(fast, PROMPT, policy, n=48, block_size=4, **kw)
        assert out == ar, policy


@pytest.mark.parametrize("verify_head", ["16bit", "int8"])
@pytest.mark.parametrize("policy", ["speculative", "hybrid", "fused"])
def test_int4_draft_head_follows_the_reference_with_the_same_head(policy, verify_head):
    """``draft_head="int4"``: the graph backend (the kernels' twins, packed int4 rows) and the
    reference model after ``attach_int4_draft_head`` draft the same tokens, so every policy
    (hybrid's unverified commits included) gives the same text; the int8 head is not held."""
    model = random_model(5)
    ref_model = copy.deepcopy(model)
    ref_model.attach_int4_draft_head()
    if verify_head == "int8":
        ref_model.use_int8_verify_head()
    ref, _ = run(reference_backend(ref_model, max_context=256, smallest=16), PROMPT, policy, n=40, block_size=4,
                 tau=0.3, min_prefix=2)
    fast = fast_backend(model, max_context=256, smallest=16, draft_head="int4", verify_head=verify_head)
    out, _ = run(fast, PROMPT, policy, n=40, block_size=4, tau=0.3, min_prefix=2)
    assert out == ref
    packed, scale = fast.fast.draft_head
    assert packed.dtype == torch.uint8 and packed.shape == (model.cfg.vocab_size, model.cfg.hidden_size // 2)
    if verify_head == "int8":  # the verify role still reads int8 rows, not the drafts' int4 ones
        assert fast.fast.int8_head[0].dtype == torch.int8 and fast.fast.int8_head is not fast.fast.draft_head


def test_int4_drafts_are_not_the_int8_heads_and_decoding_stays_lossless():
    """The int4 head drafts differently from the int8 head somewhere (so the tests above would
    notice a silent fallback), and speculative and fused still equal AR token for token."""
    model = random_model(6)
    int4 = fast_backend(model, max_context=256, smallest=16, draft_head="int4")
    int8 = fast_backend(model, max_context=256, smallest=16)
    x = torch.randn(64, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    (t4, c4), (t8, c8) = int4.fast.draft_top1(x), int8.fast.draft_top1(x)
    assert not torch.equal(c4, c8)
    assert (t4 == t8).float().mean() > 0.5  # the same head, coarser: mostly the same argmax
    ar, _ = run(int4, PROMPT, "ar", n=48, block_size=None)
    for policy in ("speculative", "fused"):
        out, _ = run(int4, PROMPT, policy, n=48, block_size=4)
        assert out == ar, policy
    logits = int4.fast.draft_sample_logits(x[:3])
    assert torch.equal(logits.argmax(-1), t4[:3])


def test_int8_verify_logits_are_the_draft_heads():
    """``use_int8_verify_head``: the verify logits are the int8 head's (also in the scoring shape
    [B, S, H]), not the 16-bit head's; the fast model without the artifact's int8 head (the
    server's FP8 draft head) quantises the 16-bit one as the exporter does."""
    from bitmtp_edge.backends.fast_model import FastModel
    from bitmtp_edge.backends.ops import twin_ops
    from tests.helpers import artifact_tensors, manifest_for

    model = random_model(3)
    h = torch.randn(5, model.cfg.hidden_size, dtype=torch.float64)
    l16 = model.verify_logits(h)
    model.use_int8_verify_head()
    l8 = model.verify_logits(h)
    assert torch.equal(l8, model.draft_logits(h)) and not torch.allclose(l8, l16)
    assert torch.equal(model.verify_logits(h.view(1, 5, -1)), l8.view(1, 5, -1))
    plan = reference_backend(model, max_context=256).plan
    fast = FastModel(manifest_for(model, 4, plan), artifact_tensors(model), twin_ops(True), "cpu",
                     draft_head="fp8", verify_head="int8")
    assert torch.equal(fast.int8_head[0], model.draft_head_int8) and fast.draft_head is not fast.int8_head
    with pytest.raises(ValueError, match="choose one of 16bit, int8"):
        FastModel(manifest_for(model, 4, plan), artifact_tensors(model), twin_ops(True), "cpu", verify_head="fp4")
    with pytest.raises(ValueError, match="draft head 'int2': choose one of int8, int4, fp8"):
        FastModel(manifest_for(model, 4, plan), artifact_tensors(model), twin_ops(True), "cpu", draft_head="int2")


@pytest.mark.parametrize("stored,head_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                               (torch.float32, None), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("verify_head", ["16bit", "int8"])
def test_a_tied_embedding_is_the_heads_values_widened(stored, head_dtype, verify_head):
    """The fast model's float32 embedding and 16-bit verify head of a tied checkpoint: the
    stored values, widened / kept / narrowed exactly as each alone would be, whichever of them
    crossed to the device first (a tied 16-bit head that keeps its type is sent once); two
    tensors, so writing one cannot change the other."""
    from bitmtp_edge.backends.fast_model import FastModel
    from bitmtp_edge.backends.ops import twin_ops
    from bitmtp_edge.format.tensors import EMBED
    from tests.helpers import artifact_tensors, manifest_for

    model = random_model(5, tie=True)
    plan = reference_backend(model, max_context=256).plan
    tensors = artifact_tensors(model)
    tensors[EMBED] = tensors[EMBED].to(stored)
    fast = FastModel(manifest_for(model, 4, plan), tensors, twin_ops(True), "cpu", head_dtype=head_dtype,
                     verify_head=verify_head)
    assert fast.embed.dtype == torch.float32 and torch.equal(fast.embed, tensors[EMBED].float())
    if verify_head == "int8":
        assert fast.verify_head is None and fast.int8_head is not None
        return
    kept = head_dtype or (stored if stored != torch.float32 else torch.float16)
    assert fast.verify_head.dtype == kept and torch.equal(fast.verify_head, tensors[EMBED].to(kept))
    assert fast.verify_head.data_ptr() != fast.embed.data_ptr()


# What the CPU can run of each ablation preset: everything but graph capture. "m1+m2" is
# "m1" plus graphs, so it is the GPU tests' business (test_gpu_backend_is_exact_..., and
# test_gpu_graphs_replay_the_eager_tokens); the three below differ in what they run.
CPU_PRESETS = {"generic": dict(specialize=False, hoist_verify=False),
               "m1": dict(specialize=True, hoist_verify=False),
               "full-eager": dict(specialize=True, hoist_verify=True)}


def test_the_cpu_presets_cover_every_ablation_flag_but_graphs():
    flags = {(o.specialize, o.hoist_verify) for o in map(RuntimeOptions.preset, RuntimeOptions.PRESETS)}
    assert flags == {(v["specialize"], v["hoist_verify"]) for v in CPU_PRESETS.values()}


@pytest.mark.parametrize("preset", CPU_PRESETS)
def test_every_ablation_configuration_gives_the_same_tokens(preset):
    flags = CPU_PRESETS[preset]
    opts = RuntimeOptions(graphs=False, kv_dtype=torch.float32, **flags)
    ref, out, stats, fast = both(random_model(2), "speculative", options=opts)
    assert out == ref
    # The configurations take different paths: a hoisted verify needs no read of the drafts
    # before it (one host read per iteration), and only the specialised model drafts with
    # the int8 head (Generic drafts with the verify head).
    assert stats.host_syncs == (1 if flags["hoist_verify"] else 2) * stats.iterations
    assert (fast.fast.draft_head is not None and fast.fast.ops.specialize_widths) == flags["specialize"]


def test_speculative_reads_the_device_once_per_iteration_when_hoisted():
    _, _, stats, _ = both(random_model(3), "speculative")
    assert stats.host_syncs == stats.iterations
    _, _, generic, _ = both(random_model(3), "speculative",
                            options=RuntimeOptions(specialize=False, graphs=False, hoist_verify=False,
                                                   kv_dtype=torch.float32))
    assert generic.host_syncs == 2 * generic.iterations  # drafts read back before the verify


def test_segment_growth_keeps_history_in_place_across_three_segments():
    model = random_model(4)
    ref, out, stats, fast = both(model, "speculative", n=100)
    assert out == ref
    assert len({s.segment for s in fast.log.states}) >= 3


def test_triton_kernels_choose_the_twins_tokens():
    """The fast model on the Triton kernels themselves (interpreted on the CPU) against the
    same model on their twins: every fused launch (norm+quant, W2A8 + residual, RoPE + KV
    store, attention, both heads) in place, same tokens for AR and speculative decoding."""
    pytest.importorskip("triton")  # interpreted without CUDA (tests/__init__.py)
    model = random_model(9, layers=1)
    for policy in ("ar", "speculative"):
        bs = None if policy == "ar" else 4
        outs = [run(fast_backend(model, max_context=64, smallest=16, kernels=k, head_dtype=torch.float16,
                                 device=DEVICE if k else "cpu"),
                    PROMPT, policy, n=12, block_size=bs)[0] for k in (False, True)]
        assert outs[0] == outs[1], policy


# --- the on-device accept, with hand-built verifier logits -----------------------------------

D, VOCAB = 4, 50


def scripted_logits(block: list[int], accept: int, gen: torch.Generator, vocab: int = VOCAB) -> torch.Tensor:
    """[D + 1, V] logits whose greedy tokens accept exactly ``accept`` drafts of ``block``
    ([anchor, d_1..d_D]): rows before the first rejection pick the next draft, row ``accept``
    picks something else, and the rows after it pick their drafts again (a later match
    must not count)."""
    logits = torch.randn(D + 1, vocab, generator=gen)
    for row in range(D):
        want = block[row + 1] if row != accept else (block[row + 1] + 1) % vocab
        logits[row, want] = logits[row].max() + 1.0 + torch.rand(1, generator=gen).item()
    return logits


def accept_cases(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for accept in range(D + 1):
        block = torch.randint(0, VOCAB, (D + 1,), generator=gen).tolist()
        yield block, accept, scripted_logits(block, accept, gen)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_device_accept_matches_the_host_rule_for_every_count(seed):
    from bitmtp_edge.backends.graph import accept_on_device
    from bitmtp_edge.runtime.decoding_rules import accepted_prefix

    for block, accept, logits in accept_cases(seed):
        greedy = logits.argmax(-1)
        a, v = accept_on_device(torch.tensor(block), greedy)
        assert a.tolist() == [accept] == [accepted_prefix(block[1:], greedy.tolist())]
        assert v.tolist() == [int(greedy[accept])]


def test_on_device_accept_stops_at_an_early_mismatch():
    from bitmtp_edge.backends.graph import accept_on_device

    block = [7, 11, 12, 13, 14]
    greedy = torch.tensor([11, 40, 13, 14, 9])  # d_1 accepted, d_2 rejected, d_3 and d_4 match again
    a, v = accept_on_device(torch.tensor(block), greedy)
    assert (int(a), int(v)) == (1, 40)
    a, v = accept_on_device(torch.tensor(block), torch.tensor([11, 12, 13, 14, 9]))
    assert (int(a), int(v)) == (4, 9)  # every draft, and the bonus token of the last row
    a, v = accept_on_device(torch.tensor(block), torch.tensor([5, 12, 13, 14, 9]))
    assert (int(a), int(v)) == (0, 5)


@pytest.mark.parametrize("accept", range(D + 1))
def test_verify_step_commits_what_scripted_verifier_logits_force(accept):
    """The whole verify graph body on the CPU with the verifier's logits replaced: the
    accepted count, the verifier token, the device and host history lengths and the
    chained input of the next draft follow the script."""
    model = random_model(11)
    backend = fast_backend(model, block_size=D, max_context=64)
    prompt = PROMPT
    backend.prefill(prompt[:-1])
    draft = backend.draft_step(prompt[-1:], D)
    block = [prompt[-1]] + list(draft.tokens)
    logits = scripted_logits(block, accept, torch.Generator().manual_seed(accept), vocab=model.cfg.vocab_size)
    greedy = logits.argmax(-1)
    backend.fast.verify_top1 = lambda x: (greedy.to(x.device), logits.softmax(-1).amax(-1))
    res = backend.verify_step(prompt[-1], draft)
    assert (res.accepted, res.verifier_token) == (accept, int(greedy[accept]))
    assert backend.history_length == len(prompt) + accept
    assert int(backend.static.history_len) == len(prompt) + accept
    assert int(backend.static.pending[0]) == res.verifier_token  # the next draft's p_1, already on the device
    assert backend.static.readback[:2].tolist() == [accept, res.verifier_token]


def test_fast_logits_match_reference():
    model = random_model(5)
    ids = torch.tensor(PROMPT * 3)
    ref = reference_backend(model).logits(ids)
    fast = fast_backend(model).logits(ids)
    torch.testing.assert_close(fast.double(), ref.double(), rtol=0, atol=2e-3)


# --- on a GPU: Triton kernels, capture and replay ------------------------------------------

gpu = pytest.mark.gpu


def assert_greedy_under_reference(ref_engine, prompt, tokens, slack=0.05):
    """Every token the GPU chose is a greedy choice of the float64 reference given the same
    prefix, up to ``slack`` in logits (fp16 KV and head vs float64 may reorder near-ties)."""
    logits = ref_engine.logits(list(prompt) + list(tokens))
    for i, tok in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        assert row[tok] >= row.max() - slack, f"token {i}: {tok} is {float(row.max() - row[tok]):.3f} below greedy"


@gpu
@needs_gpu
@pytest.mark.parametrize("runtime", RuntimeOptions.PRESETS)
def test_gpu_backend_is_exact_and_follows_the_reference(tmp_path, runtime):
    """GQA group 4 and D = 8 as in BitNet-2B: a verify has 36 query rows per KV head, an AR
    step 4; random weights give near-tied logits, so any width-dependent rounding shows."""
    from bitmtp_edge import Engine

    model = random_model(6, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    ref = Engine.load(art, backend="reference", device="cpu")
    fast = Engine.load(art, backend="ampere", device="cuda", runtime=runtime)
    ar = fast.generate(PROMPT, max_new_tokens=100, policy="ar")
    assert ar.stats.segment_growths >= 2  # 16 -> 32 -> 64 -> 128: three segments or more
    assert_greedy_under_reference(ref, PROMPT, ar.token_ids)
    # Kept rows sit at their own slots, so verify rows equal AR rows bit for bit.
    spec = fast.generate(PROMPT, max_new_tokens=100, policy="speculative")
    assert spec.token_ids == ar.token_ids
    assert fast.generate(PROMPT, max_new_tokens=100, policy="hybrid", tau=1.0).token_ids == ar.token_ids
    for policy in ("confidence", "hybrid"):
        res = fast.generate(PROMPT, max_new_tokens=60, policy=policy, tau=0.3, min_prefix=2)
        # a random model may draft its EOS early (the tokens after it are dropped): what must
        # hold is that a run ends by length or EOS and that some step committed a block
        assert len(res.token_ids) == 60 or res.stats.finish_reason == "stop"
        assert max(res.stats.accepted_histogram) >= 2


@gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["ampere", "server"])
def test_gpu_int8_head_is_lossless_against_its_own_ar(tmp_path, backend):
    """``head="int8"`` on the GPU (captured graphs, D = 8, GQA group 4): speculative, fused and
    hybrid at tau = 1 equal the int8 head's AR token for token, and the 16-bit head is not on
    the device. (That the int8 head's tokens are the reference's is the CPU test's,
    ``test_int8_verify_head_follows_the_reference_with_the_same_head``, exact on the twins: on
    the GPU the fp16 KV shifts the final hidden state by rounding, and re-quantising it to int8
    moves near-tied logits by more than the 16-bit head's slack, measured 0.48 at token 71 of
    this model, so a float64 reference bound is not the check here.)"""
    from bitmtp_edge import Engine
    from bitmtp_edge.backends.fp8_head import fp8_supported

    if backend == "server" and not fp8_supported(torch.device("cuda")):
        pytest.skip("the server backend needs FP8 (sm_89+)")
    model = random_model(6, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    fast = Engine.load(art, backend=backend, device="cuda", head="int8")
    assert fast.backend.fast.verify_head is None and fast.backend.fast.int8_head is not None
    ar = fast.generate(PROMPT, max_new_tokens=100, policy="ar")
    assert ar.stats.segment_growths >= 2
    for policy, kw in (("speculative", {}), ("fused", {}), ("hybrid", {"tau": 1.0})):
        assert fast.generate(PROMPT, max_new_tokens=100, policy=policy, **kw).token_ids == ar.token_ids, policy


@gpu
@needs_gpu
def test_gpu_int4_draft_head_drafts_as_its_twin_and_decodes_losslessly(tmp_path):
    """``draft_head="int4"`` on the GPU (the compiled kernel, captured graphs, D = 8): the draft
    step's tokens are the twin's on the same hidden states, and speculative and fused equal AR."""
    from bitmtp_edge import Engine
    from kernels_ampere.heads import int4_head_argmax_reference

    model = random_model(7, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    eng = Engine.load(art, backend="ampere", device="cuda", draft_head="int4")
    fast = eng.backend.fast
    assert eng.draft_head == "int4" and fast.draft_head[0].dtype == torch.uint8
    x = torch.randn(9, model.cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    a, s = fast.ops.rmsnorm_quant(x, fast.final_norm, fast.cfg.rms_norm_eps)
    top1, conf = fast.draft_top1(x)
    ref_top1, ref_conf = int4_head_argmax_reference(a, s, *fast.draft_head)
    assert torch.equal(top1, ref_top1)
    torch.testing.assert_close(conf, ref_conf, rtol=1e-5, atol=0)
    ar = eng.generate(PROMPT, max_new_tokens=100, policy="ar")
    for policy in ("speculative", "fused"):
        assert eng.generate(PROMPT, max_new_tokens=100, policy=policy).token_ids == ar.token_ids, policy


@gpu
@needs_gpu
def test_gpu_graphs_replay_the_eager_tokens(tmp_path):
    from bitmtp_edge import Engine

    model = random_model(8, vocab=256, hidden=256)
    art = write_test_artifact(model, tmp_path / "art", max_context=256, smallest=16)
    runs = {}
    for runtime in ("m1", "full"):  # same kernels; eager launches vs captured graphs
        eng = Engine.load(art, backend="ampere", device="cuda", runtime=runtime)
        runs[runtime] = [eng.generate(PROMPT, max_new_tokens=80, policy=p, tau=0.3, min_prefix=2).token_ids
                         for p in POLICIES]
    assert runs["m1"] == runs["full"]


@gpu
@needs_gpu
def test_gpu_server_backend_speculative_and_fused_equal_ar(tmp_path):
    from bitmtp_edge import Engine
    from bitmtp_edge.backends.fp8_head import fp8_supported

    if not fp8_supported(torch.device("cuda")):
        pytest.skip("no FP8 tensor cores")
    model = random_model(7, vocab=256, hidden=256)
    art = write_test_artifact(model, tmp_path / "art", max_context=256, smallest=16)
    eng = Engine.load(art, backend="server", device="cuda")
    ar = eng.generate(PROMPT, max_new_tokens=64, policy="ar")
    for policy in ("speculative", "fused"):
        assert eng.generate(PROMPT, max_new_tokens=64, policy=policy).token_ids == ar.token_ids, policy


@contextlib.contextmanager
def _a_first_launch_at_the_fifth():
    """Stands in for ``first_launches_refused`` when a variant's first launch comes mid-body:
    the fifth Triton launch raises ``FirstLaunch`` (four already entered the capture)."""
    from triton.runtime.jit import JITFunction

    from bitmtp_edge.backends.precompile import FirstLaunch

    run, count = JITFunction.__dict__["run"], [0]

    def refusing(self, *args, **kwargs):
        count[0] += 1
        if count[0] == 5:
            raise FirstLaunch("the fifth launch (test)")
        return run(self, *args, **kwargs)

    JITFunction.run = refusing
    try:
        yield
    finally:
        JITFunction.run = run


@gpu
@needs_gpu
def test_gpu_a_graph_captured_after_one_or_no_warm_up_run_replays_what_two_give(tmp_path, monkeypatch):
    """A precompiled load captures each state after one warm-up run instead of two, and
    after none where an earlier state launched its every variant (guarded: a first launch
    aborts the capture, which then warms up and captures again): every replay state's graph
    writes the same outputs, chained inputs and KV, bit for bit, all four ways."""
    from bitmtp_edge import Engine
    from bitmtp_edge.backends import precompile as pc

    model = random_model(11, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    eng = Engine.load(art, backend="ampere", device="cuda", runtime=RuntimeOptions(capture="lazy"))
    eng.generate(PROMPT, max_new_tokens=24, policy="fused")  # real values in every chained input and the KV
    b = eng.backend
    st, kv = b.static, b.kv

    def snapshot():
        return [t.clone() for t in (*st.mutable(), st.attn_rows, kv.k, kv.v)]

    def restore(saved):
        for t, s in zip((*st.mutable(), st.attn_rows, kv.k, kv.v), saved):
            t.copy_(s)

    start = snapshot()
    last = len(b.plan.segments) - 1  # room after the history for every width
    states = [s for s in b.states() if s.segment == last]
    assert {s.role for s in states} == {"verify", "draft", "fused"} and kv.length > len(PROMPT)
    for state in states:
        after = {}
        for warmups in (2, 1, 0, "aborted"):  # two first: the variants are loaded for none
            restore(start)
            fallbacks = b.capture_fallbacks
            if warmups == "aborted":
                monkeypatch.setattr(pc, "first_launches_refused", _a_first_launch_at_the_fifth)
            b._capture(state, warmups=0 if warmups == "aborted" else warmups)
            monkeypatch.undo()
            assert b.capture_fallbacks - fallbacks == (warmups == "aborted"), (state, warmups)
            graph = b.graphs.pop(state)
            restore(start)
            graph.replay()
            torch.cuda.synchronize()
            after[warmups] = snapshot()
        for warmups in (1, 0, "aborted"):
            assert all(torch.equal(x, y) for x, y in zip(after[warmups], after[2])), (state, warmups)
        assert not all(torch.equal(x, y) for x, y in zip(after[1], start)), state  # the step wrote something
    restore(start)


@gpu
@needs_gpu
def test_gpu_graphs_captured_on_a_given_stream_replay_the_same_tokens(tmp_path):
    """``capture_stream`` (what a benchmark confined to a green context uses) moves where the
    graphs are warmed up and captured, nothing else: the same tokens as torch's own stream."""
    from bitmtp_edge import Engine
    from bitmtp_edge.backends.graph import capture_stream

    model = random_model(9, vocab=256, hidden=256)
    art = write_test_artifact(model, tmp_path / "art", max_context=256, smallest=16)
    plain = Engine.load(art, backend="ampere", device="cuda", runtime="full")
    want = [plain.generate(PROMPT, max_new_tokens=64, policy=p).token_ids for p in ("ar", "fused")]
    side = torch.cuda.Stream()
    with capture_stream(side), torch.cuda.stream(side):
        eng = Engine.load(art, backend="ampere", device="cuda", runtime="full")
        got = [eng.generate(PROMPT, max_new_tokens=64, policy=p).token_ids for p in ("ar", "fused")]
    assert got == want and want[0] == want[1]


# --- the torch launches a step makes around the model ------------------------------------------

def _ops_around_the_model(backend, state) -> list[str]:
    """The torch ops (each a kernel launch on a GPU; views and allocations excluded) one eager
    run of ``state``'s body issues outside the model's forward and heads, which are stubbed
    with fixed outputs here: the step's own bookkeeping."""
    from torch.utils._python_dispatch import TorchDispatchMode

    fast, d = backend.fast, backend.block_size
    x = torch.randn(state.width, fast.cfg.hidden_size)
    rows = d if state.role == "draft" else state.width  # a draft's head reads its block's D rows
    top, conf = torch.randint(0, 9, (rows,)), torch.rand(rows)
    stubs = {"forward": lambda *a, **k: x, "verify_greedy": lambda *a, **k: (top, conf),
             "draft_top1": lambda *a, **k: (top, conf)}
    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # (scalar_tensor: a Python number wrapped for an op, on the host: no launch)
            if not func.is_view and func.__name__.split(".")[0] not in ("empty", "empty_like", "empty_strided",
                                                                           "scalar_tensor"):
                ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    saved = [t.clone() for t in backend.static.mutable()]
    for name, stub in stubs.items():
        setattr(fast, name, stub)
    try:
        backend.static.history_len.fill_(20)
        with Count():
            backend._body(state)()
    finally:
        for name in stubs:
            delattr(fast, name)  # the class's methods again
        for t, s in zip(backend.static.mutable(), saved):
            t.copy_(s)
    return ops


def test_a_step_makes_few_torch_launches_around_the_model():
    """Each torch op between the kernels is a launch of its own (1-2 µs on an H200, more on a
    board): a step's spans, slots and bookkeeping take one op each (``masks.LengthAffine``,
    adds and clamps into their outputs, the finiteness flag in six), not the 5-12 of building
    them. Counted with the model stubbed out: the AR step 11 ops, the verify 18 (five of them the
    accept), a draft step 16 (session 21's code: 24, 32, 39)."""
    from bitmtp_edge.runtime.replay import ReplayState

    backend = fast_backend(random_model(4, layers=1), block_size=4, max_context=64, smallest=32)
    d = backend.block_size
    budget = {ReplayState(1, 0, "verify"): 11, ReplayState(d + 1, 0, "verify"): 18}
    budget.update({ReplayState(k + d, 0, "draft"): 16 for k in (1, d)})
    for state, most in budget.items():
        ops = _ops_around_the_model(backend, state)
        assert len(ops) <= most, (state, ops)


@pytest.mark.parametrize("seed", range(4))
def test_flag_non_finite_marks_exactly_the_rows_isfinite_marks(seed):
    """``flag_non_finite`` (a row times zero sums to zero exactly when it is finite) against
    ``isfinite(...).all()``: NaN, +inf and -inf anywhere in a row or its confidence, and finite
    rows near the float32 limit whose plain sum would overflow."""
    from bitmtp_edge.backends.base import NON_FINITE_TOKEN, flag_non_finite

    gen = torch.Generator().manual_seed(seed)
    m, h = 12, 64
    hidden = torch.randn(m, h, generator=gen) * 3e37  # sums overflow; every value finite
    conf = torch.rand(m, generator=gen)
    for bad in (float("nan"), float("inf"), float("-inf")):
        hidden[torch.randint(0, m, (2,), generator=gen), torch.randint(0, h, (2,), generator=gen)] = bad
        conf[torch.randint(0, m, (1,), generator=gen)] = bad
    tokens = torch.randint(0, 100, (m,), generator=gen)
    for c in (conf, None):
        ok = torch.isfinite(hidden).all(-1) & (torch.isfinite(c) if c is not None else True)
        want = torch.where(ok, tokens, torch.full_like(tokens, NON_FINITE_TOKEN))
        got = flag_non_finite(hidden, tokens, c)
        assert torch.equal(got, want) and 0 < int(ok.sum()) < m
