"""Sampling: the pure functions, seeded reproducibility on every policy and backend, and the
statistical proof that speculative sampling draws exactly AR sampling's distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from bitmtp_edge.backends.base import DraftResult, StepLog, VerifyResult
from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, DecodingError, decode
from bitmtp_edge.runtime.sampling import (
    SamplingError, SamplingParams, filtered_probs, inverse_cdf, penalize, speculative_accept,
)
from tests.helpers import fast_backend, needs_gpu, random_model, reference_backend

PROMPT = [1, 5, 7, 9, 11]


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of ops on tiny tensors: intra-op threads only add synchronisation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(backend, prompt, policy, n=24, block_size=4, sampling=None, **kw):
    stats = DecodeStats()
    opts = DecodeOptions(policy, n, block_size=None if policy == "ar" else block_size, sampling=sampling, **kw)
    return [t for chunk in decode(backend, prompt, opts, stats) for t in chunk], stats


# --- pure functions ---------------------------------------------------------------------------

def test_temperature_zero_is_the_argmax_one_hot():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    probs = filtered_probs(logits, 0.0, 50, 1.0)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(3))
    assert int((probs > 0).sum()) == 3


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.equal(filtered_probs(logits, 1.0, 2, 1.0) > 0, torch.tensor([[True, True, False, False]]))
    # Mass before token 3 is 0.9 >= 0.85: it goes; token 2 (mass before 0.75 < 0.85) stays.
    p = filtered_probs(logits, 1.0, 4, 0.85)
    assert torch.equal(p > 0, torch.tensor([[True, True, True, False]]))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.25, 0.15, 0.0]]) / 0.9)
    # top_p smaller than the first token's mass keeps exactly that token.
    assert int((filtered_probs(logits, 1.0, 4, 0.1) > 0).sum()) == 1


def test_neutral_penalties_leave_logits_bit_for_bit_and_active_ones_push_down():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 30, generator=g)
    counts = torch.randint(0, 3, (2, 30), generator=g).float()
    assert torch.equal(penalize(logits, counts, counts, 1.0, 0.0, 0.0), logits)
    out = penalize(logits, counts, counts, 1.5, 0.5, 0.25)
    seen = counts > 0
    assert (out[seen] < logits[seen]).all() and torch.equal(out[~seen], logits[~seen])


def test_inverse_cdf_matches_the_weights_and_never_picks_zero_weight():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0]])
    u = torch.rand(20000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    picks = inverse_cdf(weights.expand(20000, -1), u)
    freq = torch.bincount(picks, minlength=6).double() / 20000
    assert freq[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(freq[[1, 3, 4]], torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), atol=0.02, rtol=0)


def test_speculative_accept_rule_and_residual():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])  # D = 1: rows for d_1 and the bonus
    q = torch.tensor([[0.5, 0.25, 0.25]])
    drafts = torch.tensor([0])  # p/q = 0.2
    a, nxt = speculative_accept(p, q, drafts, torch.tensor([0.19]), torch.tensor([0.0]))
    assert int(a) == 1 and int(nxt) == 0  # accepted; bonus from p[1] with u = 0 -> token 0
    a, nxt = speculative_accept(p, q, drafts, torch.tensor([0.21]), torch.tensor([0.5]))
    # Rejected: residual max(0, p - q) = [0, 0.35, 0.05] -> u = 0.5 picks token 1.
    assert int(a) == 0 and int(nxt) == 1
    a, nxt = speculative_accept(p, q, drafts, torch.tensor([0.21]), torch.tensor([0.95]))
    assert int(a) == 0 and int(nxt) == 2


@pytest.mark.parametrize("bad, match", [
    ({"temperature": -0.5}, "temperature must be"), ({"top_p": 0.0}, "top_p must be in"),
    ({"top_k": -1}, "top_k must be"), ({"repetition_penalty": 0.0}, "repetition_penalty must be"),
    ({"frequency_penalty": 3.0}, "frequency_penalty must be"), ({"seed": -1}, "seed must be"),
    ({"seed": True}, "seed must be"), ({"top_k": True}, "top_k must be"),
])
def test_bad_sampling_parameters_are_refused(bad, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**bad)
    assert issubclass(SamplingError, ValueError) and not issubclass(DecodingError, SamplingError)


# --- the decode loop on real backends ---------------------------------------------------------

@pytest.mark.parametrize("policy", ["ar", "confidence", "speculative", "hybrid"])
def test_temperature_zero_is_todays_greedy_path(policy):
    model = random_model(2)
    greedy, _ = run(reference_backend(model), PROMPT, policy, tau=0.3, min_prefix=2)
    zero, stats = run(reference_backend(model), PROMPT, policy, tau=0.3, min_prefix=2,
                      sampling=SamplingParams(temperature=0.0, top_p=0.5, seed=3))
    assert zero == greedy and stats.seed is None


@pytest.mark.parametrize("policy", ["ar", "confidence", "speculative", "hybrid"])
def test_same_seed_same_tokens_other_seed_other_tokens(policy):
    model = random_model(3)
    backend = reference_backend(model)
    params = dict(temperature=1.5, top_k=40, repetition_penalty=1.2, presence_penalty=0.3)
    runs = {seed: run(backend, PROMPT, policy, n=20, tau=0.3, min_prefix=2,
                      sampling=SamplingParams(**params, seed=seed))[0] for seed in (0, 0, 1, 2)}
    again, stats = run(backend, PROMPT, policy, n=20, tau=0.3, min_prefix=2, sampling=SamplingParams(**params, seed=0))
    assert again == runs[0] and stats.seed == 0
    assert len({tuple(v) for v in runs.values()}) > 1  # the seed matters


def test_greedy_with_penalties_takes_the_argmax_of_penalised_logits():
    model = random_model(4)
    backend = reference_backend(model)
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    ar, _ = run(backend, PROMPT, "ar", n=16, sampling=params)
    spec, _ = run(backend, PROMPT, "speculative", n=16, sampling=params)
    assert spec == ar  # greedy speculative sampling is greedy speculative decoding: lossless
    # Confidences stay softmax values (not the one-hot 1.0): at τ = 1 hybrid always verifies.
    hybrid, stats = run(backend, PROMPT, "hybrid", n=16, tau=1.0, min_prefix=1, sampling=params)
    assert hybrid == ar and stats.verifier_calls == stats.iterations
    # By hand: argmax of logits minus 2 x (count of the token among generated ones).
    ids = list(PROMPT)
    for tok in ar:
        logits = backend.logits(torch.tensor(ids))[-1].clone()
        for t in ids[len(PROMPT):]:
            logits[t] -= 2.0
        assert int(logits.argmax()) == tok
        ids.append(tok)


@pytest.mark.parametrize("penalties", [{}, {"frequency_penalty": 0.5}], ids=["plain", "penalised"])
@pytest.mark.parametrize("calibrated", [False, True])
def test_sharpened_sampling_cannot_skip_hybrids_verify(penalties, calibrated):
    """top_k = 1 makes every q_j one-hot; read from q, each draft's confidence was 1 and hybrid
    committed whole blocks unverified. Capped by the (calibrated) softmax, hybrid at top_k = 1
    is the greedy hybrid, token for token (its verifies accept exactly the greedy way)."""
    from bitmtp_edge.runtime.calibration import ConfidenceCalibration

    model = random_model(12)
    cal = ConfidenceCalibration([(1.2, -0.7)] * 4, "cpu") if calibrated else None
    greedy, g_stats = run(reference_backend(model, calibration=cal), PROMPT, "hybrid", n=24, tau=0.6, min_prefix=2,
                          sampling=SamplingParams(temperature=0.0, **penalties) if penalties else None)
    for seed in range(3):
        top1, stats = run(reference_backend(model, calibration=cal), PROMPT, "hybrid", n=24, tau=0.6, min_prefix=2,
                          sampling=SamplingParams(temperature=1.0, top_k=1, seed=seed, **penalties))
        assert top1 == greedy and stats.verifier_calls == g_stats.verifier_calls > 0
    # at a low temperature the confidences are at most the softmax's, never q's near-1 values
    from bitmtp_edge.runtime.sampling import sample_drafts
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    zeros = torch.zeros(50, dtype=torch.float64)
    params = (0.1, 50, 1.0, 1.0, 0.0, 0.0)
    drafts, q, conf = sample_drafts(logits, zeros, zeros, params, torch.rand(4, dtype=torch.float64), False)
    plain = torch.softmax(logits, -1).gather(1, drafts.unsqueeze(1)).squeeze(1)
    sharp = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
    assert torch.equal(conf, torch.minimum(plain, sharp)) and bool((conf < sharp).any())


@pytest.mark.parametrize("policy", ["ar", "confidence", "speculative", "hybrid"])
def test_graph_backend_twin_samples_what_the_reference_samples(policy):
    """The graph backend's static-buffer sampling bodies (torch twins, eager on the CPU)
    against the reference backend, with the same seeds: the same tokens."""
    model = random_model(5, dtype=torch.float32)
    params = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    for seed in range(3):
        sampling = SamplingParams(**params, seed=seed)
        ref, _ = run(reference_backend(model, dtype=torch.float32), PROMPT, policy, n=20, tau=0.3, min_prefix=2,
                     sampling=sampling)
        fast, _ = run(fast_backend(model), PROMPT, policy, n=20, tau=0.3, min_prefix=2, sampling=sampling)
        assert fast == ref


def test_cancellation_stops_at_the_next_iteration():
    model = random_model(6)
    calls = []

    def cancelled():
        calls.append(1)
        return len(calls) > 3

    stats = DecodeStats()
    out = list(decode(reference_backend(model), PROMPT, DecodeOptions("ar", 50, should_stop=cancelled), stats))
    assert len(out) == 3 and stats.finish_reason == "cancelled" and stats.iterations == 3


# --- the statistical proof -----------------------------------------------------------------------

class TableBackend:
    """A Backend over fixed conditionals, for thousands of cheap seeded runs:

    p(· | context) = a real tiny model's verify logits of the context (cached per context);
    q_j(· | context) = a flattened, shifted variant of them (any draft distribution works:
    speculative sampling must correct it to p). State mirrors the real backends: history
    = materialised tokens; pending tokens join it at the next draft (or AR) step."""

    name = "table"
    device = torch.device("cpu")

    def __init__(self, model):
        self.model, self.reference = model, reference_backend(model)
        self.cache: dict[tuple, torch.Tensor] = {}
        self.context: list[int] = []
        self.log = StepLog()

    history_length = property(lambda self: len(self.context))
    max_context = property(lambda self: 1000)
    vocab_size = property(lambda self: self.model.cfg.vocab_size)

    def p_logits(self, ctx) -> torch.Tensor:
        key = tuple(ctx)
        if key not in self.cache:
            self.cache[key] = self.reference.logits(torch.tensor(ctx))[-1]
        return self.cache[key]

    def q_logits(self, ctx, j) -> torch.Tensor:
        return 0.5 * self.p_logits(list(ctx) + [j])  # depends on the context only

    def reset(self):
        self.context = []

    def prefill(self, ids):
        self.context = list(ids)

    def ar_step(self, token, sampler=None):
        self.context.append(token)
        logits = self.p_logits(self.context).unsqueeze(0)
        return int(logits.argmax()) if sampler is None else sampler.next_token(logits)

    def draft_step(self, pending, block_size, sampler=None):
        self.context += pending
        logits = torch.stack([self.q_logits(self.context, j) for j in range(block_size)])
        drafts, q, conf = sampler.draft(logits)
        return DraftResult(drafts.tolist(), conf.tolist(), probs=q)

    def verify_step(self, anchor, draft, sampler=None):
        d = draft.tokens
        logits = torch.stack([self.p_logits(self.context + d[:r]) for r in range(len(d) + 1)])
        a, v = sampler.verify(logits, torch.tensor(d), draft.probs)
        self.context += d[:a]
        return VerifyResult(a, v)


def exact_pair_distribution(backend: TableBackend, prompt, params: SamplingParams) -> dict[tuple, float]:
    """The exact law of AR sampling's first two tokens (t1, t2), from the model's logits."""
    vocab = backend.vocab_size
    top_k = params.top_k or vocab

    def probs(ctx, generated):
        logits = backend.p_logits(ctx).unsqueeze(0)
        seen = torch.zeros(vocab)
        gen = torch.zeros(vocab)
        for t in (ctx if params.repetition_penalty != 1.0 else []):
            seen[t] += 1
        for t in generated:
            gen[t] += 1
        logits = penalize(logits, seen, gen, params.repetition_penalty, params.frequency_penalty,
                          params.presence_penalty)
        return filtered_probs(logits, params.temperature, top_k, params.top_p)[0].double()

    law = {}
    p1 = probs(prompt, [])
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs(prompt + [t1], [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            law[(t1, t2)] = float(p1[t1] * p2[t2])
    return law


def chi_square_p_value(observed: Counter, law: dict, n: int) -> tuple[float, float]:
    """Pearson's test of observed pairs against the exact law (cells with < 5 expected
    pooled into one); returns (p-value by the Wilson-Hilferty approximation, TV distance)."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, prob in law.items():
        if prob * n >= 5:
            cells.append((observed.get(key, 0), prob * n))
        else:
            pooled_obs += observed.get(key, 0)
            pooled_exp += prob * n
    outside = sum(c for k, c in observed.items() if k not in law)  # impossible outcomes
    cells.append((pooled_obs + outside, pooled_exp))
    chi2 = sum((o - e) ** 2 / e for o, e in cells if e > 0) + (outside * 1e9 if pooled_exp == 0 else 0)
    k = len(cells) - 1
    z = ((chi2 / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    tv = 0.5 * (sum(abs(observed.get(key, 0) / n - prob) for key, prob in law.items()) + outside / n)
    return 0.5 * math.erfc(z / math.sqrt(2)), tv


SAMPLES = 2000
CASES = [SamplingParams(temperature=3.0), SamplingParams(temperature=4.0, top_k=12, top_p=0.95,
                                                         repetition_penalty=1.5, presence_penalty=0.5)]


@pytest.mark.parametrize("params", CASES, ids=["plain", "filtered+penalised"])
def test_speculative_sampling_draws_ar_samplings_distribution(params):
    """Over a fixed set of seeds, the first two tokens of speculative sampling (drafts from
    q ≠ p, corrected by accept/resample) follow the exact AR law; so do AR sampling's.
    Committing the drafts unverified (confidence policy) follows q instead, and the same
    test rejects it: the test can fail."""
    model = random_model(8, vocab=24)
    backend = TableBackend(model)
    prompt = [3, 1, 4]
    law = exact_pair_distribution(backend, prompt, params)
    assert 10 < len(law) < 600  # a law spread over many pairs, and a test with power

    def pairs(policy, samples=SAMPLES, **kw):
        seen = Counter()
        for seed in range(samples):
            sampling = SamplingParams(**{**params.__dict__, "seed": seed})
            out, _ = run(backend, prompt, policy, n=2, sampling=sampling, **kw)
            seen[tuple(out)] += 1
        return seen

    for policy in ("ar", "speculative"):
        p_value, tv = chi_square_p_value(pairs(policy), law, SAMPLES)
        assert p_value > 1e-3 and tv < 0.1, (policy, p_value, tv)
    p_value, tv = chi_square_p_value(pairs("confidence", SAMPLES // 2, tau=0.01, min_prefix=1), law, SAMPLES // 2)
    assert p_value < 1e-6, (p_value, tv)


# --- on a GPU: sampled graphs (captured on first use) ----------------------------------------------

gpu = pytest.mark.gpu


@gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["ampere", "server"])
def test_gpu_sampled_graphs_replay_the_eager_samples_and_leave_greedy_alone(tmp_path, backend):
    """The captured sampled graphs draw what eager launches of the same bodies draw (same
    seeds, same uniforms), on every policy, across segment growth; and a greedy run after
    sampled ones still gives the greedy tokens from before (the load-time graphs are
    untouched)."""
    from bitmtp_edge import Engine
    from bitmtp_edge.backends.fp8_head import fp8_supported
    from tests.helpers import write_test_artifact

    if backend == "server" and not fp8_supported(torch.device("cuda")):
        pytest.skip("no FP8 tensor cores")
    model = random_model(9, vocab=256, hidden=256)
    art = write_test_artifact(model, tmp_path / "art", max_context=256, smallest=16)
    sampled = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    sampled.append(SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2,
                                  frequency_penalty=0.3, seed=4))
    runs = {}
    for runtime in ("m1", "full"):  # same kernels and bodies; eager launches vs captured graphs
        eng = Engine.load(art, backend=backend, device="cuda", runtime=runtime)
        greedy = eng.generate(PROMPT, max_new_tokens=80, policy="speculative").token_ids
        runs[runtime] = [eng.generate(PROMPT, max_new_tokens=80, policy=p, tau=0.3, min_prefix=2,
                                      sampling=s).token_ids for p in ("ar", "confidence", "speculative", "hybrid")
                         for s in sampled]
        assert eng.generate(PROMPT, max_new_tokens=80, policy="speculative").token_ids == greedy
        assert eng.generate(PROMPT, max_new_tokens=80, policy="ar").token_ids == greedy
    assert runs["m1"] == runs["full"]
    assert len({tuple(r) for r in runs["full"]}) > 4  # the seeds and parameters matter
