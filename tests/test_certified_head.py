"""The certified head (kernels_ampere/certified_head.py): the 16-bit head's greedy token, read
from the int8 head wherever a bound proves it. The kernel against its twin on fresh random
inputs (interpreted in CI, compiled on a GPU), the bound against the 16-bit logits, the fold of
the tiles, and every policy on the graph backend giving the 16-bit head's tokens."""

from __future__ import annotations

import json

import pytest
import torch

from bitmtp_edge.runtime.policies import POLICIES
from kernels_ampere import certified_head as ch
from kernels_ampere.heads import f16_head_argmax, f16_head_argmax_reference
from kernels_ampere.numerics import int_matmul, quantize_rows_int8
from kernels_ampere.tuning import HeadConfig
from tests.helpers import DEVICE, ON_GPU, fast_backend, needs_gpu, random_model, write_test_artifact
from tests.test_decoding import run

PROMPT = [5, 17, 3, 42, 8, 11, 29, 2]
CONFIG = HeadConfig(block_v=64, block_h=32)


def head_case(v: int, h: int, m: int, dtype, seed: int, winners: int):
    """A 16-bit head, its int8 rows and bounds, and ``m`` activation rows of which the first
    ``winners`` point along a head row (a clear argmax: certified), the rest random (near-ties)."""
    g = torch.Generator().manual_seed(seed)
    w16 = (torch.randn(v, h, generator=g) * 0.05).to(dtype)
    q, s = quantize_rows_int8(w16.float())
    x = torch.randn(m, h, generator=g)
    for i in range(winners):
        x[i] = w16[(37 * i + 11) % v].float() * 40 + 0.1 * x[i]
    x = x.to(dtype)
    w16, q, s, x = (t.to(DEVICE) for t in (w16, q, s, x))
    return w16, q, s, *ch.head_error_bounds(w16, q, s), x


def with_exact_tie(w16, q, s, err, mag, qn, x, *, row: int, a: int = 40, b: int = 150):
    """``head_case``'s tensors with head rows ``a`` and ``b`` equal (an exact tie for every h)
    and activation row ``row`` pointing at them: that row can never be certified."""
    w16 = w16.clone()
    w16[a] = (w16[a].float() * 1.5).to(w16.dtype)
    w16[b] = w16[a]
    x = x.clone()
    x[row] = (w16[a].float() * 40).to(x.dtype)
    q, s = quantize_rows_int8(w16.float())
    return w16, q, s, *ch.head_error_bounds(w16, q, s), x


def certify_with_kernels(k: int = ch.CANDIDATES):
    return lambda *args: ch.certify_tokens(*args, config=CONFIG, k=k)


def certify_with_twins(k: int = ch.CANDIDATES):
    return lambda *args: ch.certify_tokens_reference(*args, config=CONFIG, k=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v,h,m,winners", [(300, 96, 1, 1), (300, 96, 1, 0), (257, 64, 9, 5), (200, 160, 17, 9),
                                           (150, 64, 40, 20), (150, 64, 70, 30)])
def test_each_launch_matches_its_twin_and_certified_tokens_are_the_16bit_heads(dtype, v, h, m, winners):
    """The int8 pass's bounds equal the twin's bit for bit (exact integer sums, then the same
    float32 operations); the selection finds the twin's candidates (as a set: the kernel appends
    them in any order) and count; the resolution gives the twin's tokens and verdicts; and every
    certified row's token is the 16-bit head's."""
    w16, q, s, err, mag, qn, x = head_case(v, h, m, dtype, seed=v + h + m, winners=winners)
    plane = ch.activation_plane(x)
    kernel = ch.certify_bounds(plane, q, s, err, mag, qn, config=CONFIG)
    twin = ch.certify_bounds_reference(plane, q, s, err, mag, qn, config=CONFIG)
    for a, b, name in zip(kernel, twin, ("up", "low", "count")):
        assert torch.equal(a, b), name
    assert twin[0].shape == (m, v) and twin[1].shape == (-(-v // CONFIG.block_v), m)
    (k_cand, k_count), (t_cand, t_count) = ch.select_candidates(*kernel), ch.select_candidates_reference(*twin)
    assert torch.equal(k_count, t_count) and bool((t_count >= 1).all())
    for row in range(m):
        n = int(t_count[row])
        assert sorted(k_cand[row, :n].tolist()) == t_cand[row, :n].tolist()
        assert t_cand[row, :n].tolist() == torch.nonzero(twin[0][row] >= twin[1][:, row].max()).flatten().tolist()
    (k_token, k_ok), (t_token, t_ok) = ch.resolve_candidates(x, w16, k_cand, k_count), \
        ch.resolve_candidates_reference(x, w16, t_cand, t_count)
    assert torch.equal(k_ok, t_ok) and torch.equal(k_token[k_ok], t_token[t_ok])
    expected, _ = f16_head_argmax_reference(x, w16)
    assert torch.equal(t_token[t_ok], expected[t_ok])  # every certified row: the 16-bit head's token
    assert bool(t_ok[:winners].all())
    for certify, head in ((certify_with_kernels(), f16_head_argmax), (certify_with_twins(), f16_head_argmax_reference)):
        top, check, every = ch.certified_head_argmax(x, w16, q, s, err, mag, qn, certify=certify, f16_head=head)
        assert bool(every) == bool(t_ok.all()) and torch.isfinite(check).all()
        if ON_GPU and head is f16_head_argmax:  # the compiled 16-bit head's own near-tie order
            assert torch.equal(top, f16_head_argmax(x, w16)[0])
        else:
            assert torch.equal(top, expected)


def test_near_ties_are_certified_only_with_their_margin():
    """Random activations against a head with many close rows: a row is certified only when its
    token is the 16-bit head's; an exact tie (a duplicated head row) never is; a row with more
    candidates than slots is not; and over 64 rows most are, from a few candidates each."""
    g = torch.Generator().manual_seed(5)
    v, h, m = 400, 128, 64
    base = torch.randn(8, h, generator=g) * 0.05
    w16 = (base[torch.arange(v) % 8] + 0.002 * torch.randn(v, h, generator=g)).to(torch.bfloat16)  # 8 clusters
    w16[45] = (w16[45].float() * 1.5).to(torch.bfloat16)  # the clear winner along itself ...
    w16[123] = w16[45]  # ... and an exact tie: rows 45 and 123 give the same logit for every h
    q, s = quantize_rows_int8(w16.float())
    err, mag, qn = ch.head_error_bounds(w16, q, s)
    x = torch.randn(m, h, generator=g)
    x[0] = w16[45].float() * 60  # row 0 points at the tie
    x = x.to(torch.bfloat16)
    w16, q, s, err, mag, qn, x = (t.to(DEVICE) for t in (w16, q, s, err, mag, qn, x))
    expected, _ = f16_head_argmax_reference(x, w16)
    for certify in (certify_with_twins(), certify_with_kernels()):
        token, ok = certify(x, w16, q, s, err, mag, qn)
        assert torch.equal(token[ok], expected[ok])
        assert not bool(ok[0]) and int(expected[0]) == 45
        assert int(ok.sum()) >= m // 2
    up, low, count = ch.certify_bounds_reference(ch.activation_plane(x), q, s, err, mag, qn)
    _, count = ch.select_candidates_reference(up, low, count)
    crowded = count > 1
    assert bool(crowded.any())
    for certify in (certify_with_twins(k=1), certify_with_kernels(k=1)):  # one slot: crowded rows fail
        token, ok = certify(x, w16, q, s, err, mag, qn)
        assert not bool(ok[crowded].any()) and torch.equal(token[ok], expected[ok])


def test_a_row_that_is_not_finite_is_never_certified():
    w16, q, s, err, mag, qn, x = head_case(200, 64, 4, torch.bfloat16, seed=13, winners=4)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, 5] = float("-inf")
    for certify in (certify_with_twins(), certify_with_kernels()):
        _, ok = certify(x, w16, q, s, err, mag, qn)
        assert ok.tolist() == [True, False, False, False]


def test_the_plane_kernel_matches_its_twin():
    """``activation_plane_kernel`` against the torch twin: g (round half to even: a row of exact
    ties) and a bit for bit, the norms upper bounds within a float32 ulp of the twin's; rows
    with NaN or inf get NaN norms; an all-zero row a zero plane."""
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(6, 300, generator=g) * 3
        x[1] = torch.arange(300) * 0.5 - 75  # max|x| = 75: a = 75/127, and not one tie ...
        x[1, 0] = 127  # ... but with max|x| = 127, a = 1 and every odd multiple of 0.5 is a tie
        x[5] = 0
        x = x.to(dtype)
        x[2, 7], x[3, 1], x[4, 9] = float("nan"), float("inf"), float("-inf")
        x = x.to(DEVICE)
        twin, kernel = ch.activation_plane(x), ch.activation_plane_kernel(x)
        assert torch.equal(twin[0], kernel[0])
        assert torch.allclose(twin[1], kernel[1], rtol=0, atol=0, equal_nan=True)
        finite = torch.tensor([True, True, False, False, False, True], device=x.device)
        exact = (x.double().abs().sum(dim=1), x.double().norm(dim=1),
                 (x.double() - twin[1].double()[:, None] * twin[0].double()).norm(dim=1))
        for t, k, e in zip(twin[2:], kernel[2:], exact):
            assert torch.allclose(t[finite], k[finite], rtol=2.0**-23, atol=0)
            assert bool((k[finite].double() >= e[finite]).all())
            assert bool(k[~finite].isnan().all())
        assert not bool(kernel[0][5].any())


def test_the_bound_holds_for_every_row_and_logit():
    """|16-bit logit - l| <= B on random heads and activations (both 16-bit types): l from the
    activation plane, B the Cauchy-Schwarz bounds of the head's and the plane's quantisation
    (exact sums here; the float32 rounding terms come on top)."""
    for dtype in (torch.bfloat16, torch.float16):
        w16, q, s, err, mag, qn, x = head_case(500, 128, 12, dtype, seed=3, winners=4)
        g, a, n1, n2, r = ch.activation_plane(x)
        residual = x.double() - a.double()[:, None] * g.double()
        assert bool((residual.abs() <= a.double()[:, None] / 2).all())
        assert bool((r.double() >= residual.norm(dim=1)).all())
        assert bool((n1.double() >= x.double().abs().sum(dim=1)).all() and (n2.double() >= x.double().norm(dim=1)).all())
        logits16 = x.double() @ w16.double().t()
        l = g.double() @ q.double().t() * a.double()[:, None] * s.double()[None, :]
        bound = err.double()[None, :] * n2.double()[:, None] + s.double()[None, :] * qn.double()[None, :] * r.double()[:, None]
        assert bool(((logits16 - l).abs() <= bound).all())
        assert bool((err.double() >= (w16.double() - s.double()[:, None] * q.double()).norm(dim=1)).all())
        assert bool((mag.double() >= w16.double().abs().amax(dim=1) + s.double()).all())
        assert bool((qn.double() >= q.double().norm(dim=1)).all())


def test_a_verify_needs_its_rows_proven_only_up_to_the_first_rejection():
    t, f = True, False
    cases = [  # (tokens, certified, drafts) -> the 16-bit head can be skipped
        (([5, 6, 7], [t, t, t], [5, 9]), 1),  # row 1 rejects its draft, certified: decided
        (([5, 8, 0], [t, t, f], [5, 6]), 1),  # row 1 rejects; row 2 unproven but never read
        (([5, 0, 7], [t, f, t], [5, 6]), 0),  # row 0 accepts, row 1 unproven: it decides
        (([0, 6, 7], [f, t, t], [5, 6]), 0),  # row 0 unproven
        (([5, 6, 7], [t, t, t], [5, 6]), 1),  # all accepted: the last row gives the verifier token
        (([5, 6, 0], [t, t, f], [5, 6]), 0),  # ... unproven
        (([4], [t], []), 1),  # no drafts (one row)
    ]
    for (tokens, ok, drafts), want in cases:
        got = ch.decisive_rows_certified(torch.tensor(tokens), torch.tensor(ok), torch.tensor(drafts, dtype=torch.long))
        assert got.dtype == torch.int32 and got.tolist() == [want], (tokens, ok, drafts)
    with pytest.raises(ValueError, match="drafts must be \\[M - 1\\]=2"):
        ch.decisive_rows_certified(torch.tensor([1, 2, 3]), torch.tensor([t, t, t]), torch.tensor([1]))


def test_a_verify_call_skips_the_16bit_head_after_a_proven_rejection():
    """Row 0 proven and rejecting its draft, the rows after it near-ties: the call is answered
    without the 16-bit head, and the accept reads the 16-bit head's accepted prefix and token."""
    from bitmtp_edge.backends.graph import accept_on_device

    w16, q, s, err, mag, qn, x = with_exact_tie(*head_case(300, 96, 5, torch.bfloat16, seed=21, winners=1), row=3)
    expected, _ = f16_head_argmax_reference(x, w16)
    token, ok = ch.certify_tokens_reference(x, w16, q, s, err, mag, qn)
    assert bool(ok[0]) and not bool(ok.all())  # row 0 proven, some later row not
    drafts = torch.tensor([int(expected[0]) + 1, 3, 4, 5], device=x.device)  # d_1 rejected by row 0
    for certify, head in ((certify_with_kernels(), f16_head_argmax), (certify_with_twins(), f16_head_argmax_reference)):
        top, _, every = ch.certified_head_argmax(x, w16, q, s, err, mag, qn, certify=certify, f16_head=head,
                                                 drafts=drafts)
        assert every.tolist() == [1]
        block = torch.cat([torch.tensor([7], device=x.device), drafts])
        assert [t.tolist() for t in accept_on_device(block, top)] == [t.tolist() for t in accept_on_device(block, expected)]


def test_a_fused_steps_rows_in_one_int8_pass():
    """The fused step's head with the certified head: the draft rows' argmax and confidence of
    the int8 logits (kernel = twin: tokens exact, confidences to float32 rounding; the tokens
    are the argmax of l), and the verify rows accepted and verified as the 16-bit head's —
    one verify row an exact tie (never certified: the 16-bit head runs on the verify rows)."""
    from bitmtp_edge.backends.graph import accept_on_device

    for tie in (None, 2):
        case = head_case(300, 96, 11, torch.bfloat16, seed=31, winners=4)
        w16, q, s, err, mag, qn, x = case if tie is None else with_exact_tie(*case, row=tie)
        n = 5  # verify rows [anchor, d_1..d_4], then six draft rows
        expected, _ = f16_head_argmax_reference(x[:n], w16)
        plane = ch.activation_plane(x)
        logit = (int_matmul(plane[0], q).float() * plane[1][:, None]) * s[None, :]
        kernel = ch.certify_bounds(plane, q, s, err, mag, qn, config=CONFIG, drafts=True)
        twin = ch.certify_bounds_reference(plane, q, s, err, mag, qn, config=CONFIG, drafts=True)
        assert torch.equal(kernel[3], twin[3]) and torch.equal(twin[3], logit.argmax(dim=1))
        assert torch.allclose(kernel[4], twin[4], rtol=1e-5, atol=0)
        drafts = expected[:n - 1].clone()
        drafts[2] += 1  # d_3 is rejected: rows 0..3 decide
        block = torch.cat([torch.tensor([7], device=x.device), drafts])
        for rows, head in ((ch.certify_fused_rows, f16_head_argmax), (ch.certify_fused_rows_reference,
                                                                       f16_head_argmax_reference)):
            top, conf, every = ch.certified_fused_head(
                x, w16, q, s, err, mag, qn, n=n, drafts=drafts, f16_head=head,
                certify_rows=lambda *a, n, rows=rows: rows(*a, n=n, config=CONFIG))
            assert top.shape == conf.shape == (11,)
            assert torch.equal(top[n:], twin[3][n:]) and torch.allclose(conf[n:], twin[4][n:], rtol=1e-5, atol=0)
            assert [t.tolist() for t in accept_on_device(block, top[:n])] == \
                [t.tolist() for t in accept_on_device(block, expected)]
            assert every.tolist() == ([1] if tie is None else [0]) and torch.isfinite(conf).all()


def test_skip_and_bad_arguments_are_named():
    w16, q, s, err, mag, qn, x = head_case(100, 64, 2, torch.bfloat16, seed=9, winners=2)
    with pytest.raises(ValueError, match="skip must be a \\[1\\] int32"):
        f16_head_argmax(x, w16, skip=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="err_norm must be \\[V\\]=100"):
        ch.certify_bounds(ch.activation_plane(x), q, s, err[:5], mag, qn)
    with pytest.raises(TypeError, match="certified head: h"):
        ch.certified_head_argmax(x.float(), w16, q, s, err, mag, qn, certify=certify_with_twins(),
                                 f16_head=f16_head_argmax_reference)
    with pytest.raises(ValueError, match="too wide"):
        ch.rounding_gamma(1 << 21)
    off = f16_head_argmax(x, w16, skip=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    assert torch.equal(off[0], f16_head_argmax(x, w16)[0])


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_16bit_heads_tokens(policy):
    """On the graph backend (twins, and the kernels interpreted): ``verify_head="certified"``
    decodes exactly as the 16-bit head, and most of AR's head calls were certified."""
    bs = None if policy == "ar" else 4
    model = random_model(2)
    ref = fast_backend(model, max_context=256, smallest=16, head_dtype=torch.bfloat16)
    expected, _ = run(ref, PROMPT, policy, n=40, block_size=bs, tau=0.3, min_prefix=2)
    # the kernels on CPU tensors run interpreted (no GPU here), for the policies whose greedy steps
    # go through the certified head (hybrid's sampled steps read the 16-bit head's logits)
    interpreted = not ON_GPU and policy in ("ar", "speculative", "fused")
    for kernels in (False, True) if interpreted else (False,):
        fast = fast_backend(model, max_context=256, smallest=16, head_dtype=torch.bfloat16, kernels=kernels,
                            verify_head="certified")
        out, _ = run(fast, PROMPT, policy, n=40, block_size=bs, tau=0.3, min_prefix=2)
        assert out == expected, kernels
        assert fast.fast.verify_head_kind == "certified"
        calls, certified = fast.fast.certified_counts()
        if policy in ("ar", "speculative", "fused"):  # their greedy AR / verify / fused steps go through it
            assert calls > 0
        if policy == "ar":  # one row a call: most certify (a verify call certifies only with all its rows)
            assert certified > calls // 2
        assert certified <= calls


def test_a_certified_head_needs_a_16bit_head():
    with pytest.raises(ValueError, match="answers for a 16-bit head"):
        fast_backend(random_model(1), max_context=128, verify_head="certified")  # float32 head


def test_the_benchmark_report_and_its_argument_errors(tmp_path):
    from tools import bench_certified_head as bench

    report = {"device": "NVIDIA H200", "date": "2026-12-03", "commit": "abc1234", "command": "python x", "vocab": 128256,
              "hidden": 2560, "reps": 8, "artifact": "embedded", "tokens": 128,
              "heads": [{"sms": 8, "M": 1, "head": "16-bit", "us": 1000.0},
                        {"sms": 8, "M": 1, "head": "certified, random rows", "us": 560.0, "rows_certified": 1}],
              "decode": {"prompts": 11, "equal_prompts": 11,
                         "16bit": {"tok_s": 4000.0, "head_calls": 0, "certified_calls": 0, "certified_share": None},
                         "certified": {"tok_s": 3900.0, "head_calls": 1400, "certified_calls": 1232,
                                       "certified_share": 0.88}}}
    text = bench.markdown(report)
    assert "| 8 | 1 | certified, random rows | 560.0 | 0.56 | 1 of 1 |" in text
    assert "11 of 11 completions equal" in text and "| certified | 3900.0 | 1400 | 1232 (88.0%) |" in text
    with pytest.raises(SystemExit, match="comma-separated integers"):
        bench.main(["--sms", "0,x", "--out", str(tmp_path)])


def test_the_candidates_report_on_held_out_text(tmp_path):
    """``tools/certified_candidates.py`` on the embedded model (a few windows): its rows, their
    candidates and certified share (every certified token is checked against the 16-bit head's
    argmax inside), and a bad model argument named."""
    from tools import certified_candidates as tool

    assert tool.main(["--model", "d8=tools/checkpoints/bitmtp-d8-27m", "--window", "64", "--max-windows", "2",
                      "--stride", "4", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "certified_candidates.json").read_text())
    r = report["models"]["d8"]
    assert r["rows"] == 2 * 64 // 4 and 1 <= r["candidates_p50"] <= r["candidates_max"]
    assert 0.5 < r["certified"] <= r["fit_slots"] <= 1.0
    assert "| d8 | 32 |" in (tmp_path / "certified_candidates.md").read_text()
    with pytest.raises(SystemExit, match="NAME=CHECKPOINT_FOLDER"):
        tool.main(["--model", "nowhere", "--out", str(tmp_path)])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["ampere", "server"])
def test_gpu_certified_head_decodes_as_the_16bit_head(tmp_path, backend):
    """Captured graphs, compiled kernels, D = 8, GQA group 4: ``head="certified"`` decodes every
    policy's tokens as the 16-bit head does, and its greedy AR steps were counted."""
    from bitmtp_edge import Engine
    from bitmtp_edge.backends.fp8_head import fp8_supported

    if backend == "server" and not fp8_supported(torch.device("cuda")):
        pytest.skip("the server backend needs FP8 (sm_89+)")
    model = random_model(6, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    base = Engine.load(art, backend=backend, device="cuda")
    cert = Engine.load(art, backend=backend, device="cuda", head="certified")
    assert cert.head == "certified" and base.head == "16bit"
    start = cert.backend.fast.certified_counts()
    for policy, kw in (("ar", {}), ("speculative", {}), ("fused", {}), ("hybrid", {"tau": 1.0})):
        want = base.generate(PROMPT, max_new_tokens=100, policy=policy, **kw).token_ids
        assert cert.generate(PROMPT, max_new_tokens=100, policy=policy, **kw).token_ids == want, policy
    calls, certified = (a - b for a, b in zip(cert.backend.fast.certified_counts(), start))
    assert calls > 0 and 0 <= certified <= calls  # a random model may end on EOS early


def test_a_generation_counts_its_certified_head_calls():
    """``Engine`` puts the greedy head calls a generation made with the certified head (and those
    the int8 rows answered) in its DecodeStats, from the device counters before and after; the
    serving metrics add them up by the head that answered."""
    import types

    from bitmtp_edge.app.http_server import Metrics
    from bitmtp_edge.runtime.decoding import DecodeStats
    from bitmtp_edge.runtime.engine import Engine

    counts = iter([(10, 7), (50, 40)])  # before the generation, after it
    eng = object.__new__(Engine)
    eng.backend = types.SimpleNamespace(fast=types.SimpleNamespace(certified_head=(), certified_counts=lambda: next(counts)))
    stats = DecodeStats()
    chunks = eng.count_head_calls(iter([[1, 2], [3]]), stats)
    assert next(chunks) == [1, 2] and stats.certified_head_calls == 0
    assert list(chunks) == [[3]]
    assert (stats.certified_head_calls, stats.certified_head_int8) == (40, 33)
    assert stats.to_dict()["certified_head_calls"] == 40 and stats.to_dict()["certified_head_int8"] == 33
    closed = iter([(0, 0), (5, 5)])  # a stream closed early still records what ran
    eng.backend.fast.certified_counts = lambda: next(closed)
    early = DecodeStats()
    chunks = eng.count_head_calls(iter([[1], [2], [3]]), early)
    next(chunks)
    chunks.close()
    assert (early.certified_head_calls, early.certified_head_int8) == (5, 5)
    eng.backend.fast.certified_head = None  # another head: nothing read, nothing counted
    eng.backend.fast.certified_counts = lambda: pytest.fail("read without a certified head")
    plain = DecodeStats()
    assert list(eng.count_head_calls(iter([[1]]), plain)) == [[1]] and plain.certified_head_calls == 0

    metrics = Metrics()
    job = types.SimpleNamespace()
    metrics.finished(job, stats, None)
    metrics.finished(job, early, None)
    text = metrics.render()
    assert 'bitmtp_certified_head_calls_total{answered="int8"} 38' in text
    assert 'bitmtp_certified_head_calls_total{answered="16bit"} 7' in text
    quiet = Metrics()
    quiet.finished(job, plain, None)
    assert "certified_head" not in quiet.render()
