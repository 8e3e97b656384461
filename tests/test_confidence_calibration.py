"""Per-slot confidence calibration (``runtime.calibration``, ``MTPConfig.confidence_calibration``):
the map itself against an independent float64 formula, the config's checks and its absence
(old artifacts), and the backends: reference and graph backend (torch twins and Triton
kernels) map the same slots, the fused step's next drafts as slots 1..D-1, and a
calibration changes what hybrid commits while the drafts stay the same."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bitmtp_edge.format.config import ConfigError, MTPConfig
from bitmtp_edge.runtime.calibration import ConfidenceCalibration, calibrate_confidences
from bitmtp_edge.runtime.policies import POLICIES
from tests.helpers import DEVICE, fast_backend, needs_gpu, random_model, reference_backend, write_test_artifact
from tests.test_decoding import run

pytestmark = pytest.mark.usefixtures("one_thread")
from tests.helpers import one_thread  # noqa: E402,F401  (the fixture, by name)

PROMPT = [3, 14, 15, 92, 65, 35]
D = 4


def random_pairs(seed: int, d: int = D) -> tuple[tuple[float, float], ...]:
    g = torch.Generator().manual_seed(seed)
    a = 0.5 + 1.5 * torch.rand(d, generator=g, dtype=torch.float64)
    b = 4.0 * torch.rand(d, generator=g, dtype=torch.float64) - 1.0
    return tuple((float(x), float(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("first_slot", [0, 1, 3])
def test_the_map_is_platt_scaling_of_each_slot(seed, first_slot):
    pairs = random_pairs(seed, 8)
    g = torch.Generator().manual_seed(100 + seed)
    m = 8 - first_slot
    conf = torch.rand(m, generator=g, dtype=torch.float64) * 0.98 + 0.01
    out = ConfidenceCalibration(pairs, "cpu")(conf, first_slot)
    for i in range(m):
        a, b = pairs[first_slot + i]
        c = float(conf[i])
        want = 1.0 / (1.0 + math.exp(-(a * math.log(c / (1.0 - c)) + b)))
        assert out[i].item() == pytest.approx(want, rel=1e-6)  # the pairs are held in float32
    assert out.dtype == conf.dtype


def test_the_map_keeps_order_within_a_slot_and_flags_and_bounds():
    params = torch.tensor([[1.3, 2.0]], dtype=torch.float32)
    c = torch.sort(torch.rand(50, generator=torch.Generator().manual_seed(5))).values
    mapped = torch.stack([calibrate_confidences(x.view(1), params) for x in c]).view(-1)
    assert bool((mapped[1:] >= mapped[:-1]).all())  # increasing: never reorders a slot's drafts
    assert mapped.mean() > c.mean()  # b > 0 raises them: what an underconfident slot needs
    special = calibrate_confidences(torch.tensor([float("nan")]), params)
    assert math.isnan(special.item())  # a non-finite row stays flagged
    assert calibrate_confidences(torch.tensor([1.0]), params).item() == 1.0
    assert calibrate_confidences(torch.tensor([0.0]), params).item() == 0.0
    with pytest.raises(ValueError, match="slots 0..1"):
        calibrate_confidences(torch.rand(2), params)


def test_the_config_round_trips_and_old_manifests_have_none():
    old = {"block_size": 4, "mask_token_id": 1, "tau": 0.9, "min_prefix": 3}
    cfg = MTPConfig.from_dict(old)
    assert cfg.confidence_calibration is None
    assert cfg.to_dict() == old  # written back exactly as before: older runtimes read it
    assert ConfidenceCalibration.for_model(cfg, "cpu") is None
    assert ConfidenceCalibration.for_model(None, "cpu") is None
    pairs = random_pairs(3)
    new = MTPConfig.from_dict(json.loads(json.dumps({**old, "confidence_calibration": [list(p) for p in pairs]})))
    assert new.confidence_calibration == pairs
    assert MTPConfig.from_dict(new.to_dict()) == new


@pytest.mark.parametrize("bad, what", [([[1.0, 0.0]] * 3, "one \\[a, b\\] pair per block slot"),
                                       ([[1.0, 0.0]] * 3 + [[0.0, 1.0]], "must be > 0"),
                                       ([[1.0, 0.0]] * 3 + [[1.0, float("inf")]], "two finite numbers"),
                                       ([[1.0, 0.0]] * 3 + [[1.0]], "two finite numbers"),
                                       ("1,0", "one \\[a, b\\] pair")])
def test_a_bad_calibration_is_refused_with_what_is_wrong(bad, what):
    with pytest.raises(ConfigError, match=what):
        MTPConfig(block_size=4, mask_token_id=1, confidence_calibration=bad)


def test_a_hand_edited_manifest_calibration_is_an_artifact_error(tmp_path):
    from bitmtp_edge.format.manifest import ArtifactError, read_manifest

    art = write_test_artifact(random_model(0), tmp_path / "art", calibration=random_pairs(0))
    path = tmp_path / "art" / "manifest.json"
    d = json.loads(path.read_text())
    d["mtp"]["confidence_calibration"][1] = [-1.0, 0.0]
    path.write_text(json.dumps(d))
    with pytest.raises(ArtifactError, match="confidence_calibration\\[1\\]"):
        read_manifest(tmp_path / "art")


def _draft(backend):
    """Prefill PROMPT but its last token, then one draft step anchored at it."""
    backend.prefill(PROMPT[:-1])
    return backend.draft_step([PROMPT[-1]], D)


@pytest.mark.parametrize("seed", [0, 1])
def test_each_backend_maps_the_draft_steps_confidences_and_keeps_the_drafts(seed):
    model = random_model(seed)
    pairs = random_pairs(seed)
    cal = ConfidenceCalibration(pairs, "cpu")
    for make in (reference_backend, fast_backend):
        raw = _draft(make(model, block_size=D))
        mapped = _draft(make(model, block_size=D, calibration=cal))
        assert mapped.tokens == raw.tokens
        want = cal(torch.tensor(raw.confidences, dtype=torch.float64)).tolist()
        assert mapped.confidences == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert mapped.confidences != pytest.approx(raw.confidences, rel=1e-3)


def both(model, policy, calibration, **kw):
    bs = None if policy == "ar" else D
    common = dict(n=40, block_size=bs, tau=0.6, min_prefix=2)
    ref = run(reference_backend(model, max_context=256, smallest=16, calibration=calibration), PROMPT, policy, **common)
    fast = run(fast_backend(model, max_context=256, smallest=16, calibration=calibration, **kw), PROMPT, policy,
               **common)
    return ref, fast


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", POLICIES)
def test_graph_backend_commits_what_the_reference_commits_with_a_calibration(seed, policy):
    """Same tokens *and* the same iterations: a slot mapped with another slot's pair (the fused
    step's next drafts are slots 1..D-1) would change which lengths the fused step verifies
    and where hybrid skips the verifier."""
    cal = ConfidenceCalibration(random_pairs(10 + seed), "cpu")
    (ref, rs), (out, fs) = both(random_model(seed), policy, cal)
    assert out == ref
    assert (fs.iterations, fs.verifier_calls, fs.forward_passes) == (rs.iterations, rs.verifier_calls, rs.forward_passes)
    assert fs.accepted_histogram == rs.accepted_histogram


def test_the_triton_kernels_path_maps_like_the_twins():
    """The graph backend on the Triton kernels (interpreted on the CPU) against its twins, both
    calibrated: hybrid skips the verifier where the twins do, fused verifies the same lengths."""
    pytest.importorskip("triton")
    model = random_model(9, layers=1)
    for policy in ("hybrid", "fused"):
        outs = []
        for k, device in ((False, "cpu"), (True, DEVICE)):  # the kernels compiled where there is a GPU
            cal = ConfidenceCalibration(random_pairs(4), device)
            outs.append(run(fast_backend(model, max_context=64, smallest=16, kernels=k, head_dtype=torch.float16,
                                         calibration=cal, device=device), PROMPT, policy, n=12, block_size=D,
                            tau=0.6, min_prefix=2))
        (twin, ts), (kern, ks) = outs
        assert kern == twin and (ks.iterations, ks.verifier_calls) == (ts.iterations, ts.verifier_calls), policy


def test_the_fused_steps_next_drafts_are_mapped_as_slots_one_on():
    """Only slot 0 raised: a draft step's first confidence moves, a fused hit's (slot 1 first)
    do not, on both backends."""
    pairs = ((1.0, 6.0),) + ((1.0, 0.0),) * (D - 1)
    cal = ConfidenceCalibration(pairs, "cpu")
    model = random_model(1)
    for make in (reference_backend, fast_backend):
        raw_b, cal_b = make(model, block_size=D), make(model, block_size=D, calibration=cal)
        raw_d, cal_d = _draft(raw_b), _draft(cal_b)
        assert cal_d.confidences[0] > raw_d.confidences[0]
        assert cal_d.confidences[1:] == pytest.approx(raw_d.confidences[1:], rel=1e-6)
        # a fused step over every draft with every candidate: its next drafts come from a's block
        raw_f = raw_b.fused_step(PROMPT[-1], [], raw_d, D + 1, D)
        cal_f = cal_b.fused_step(PROMPT[-1], [], cal_d, D + 1, D)
        assert raw_f.next_draft is not None and cal_f.next_draft is not None
        assert cal_f.next_draft.tokens == raw_f.next_draft.tokens
        assert cal_f.next_draft.confidences == pytest.approx(raw_f.next_draft.confidences, rel=1e-6)


def test_an_underconfident_model_skips_more_verifies_once_calibrated():
    model = random_model(2)
    lift = ConfidenceCalibration(((1.0, 8.0),) * D, "cpu")  # every draft very confident
    plain, ps = run(reference_backend(model), PROMPT, "hybrid", block_size=D, tau=0.9, min_prefix=2)
    lifted, ls = run(reference_backend(model, calibration=lift), PROMPT, "hybrid", block_size=D, tau=0.9, min_prefix=2)
    assert ps.verifier_calls > ps.iterations // 2  # as trained, hybrid verifies most blocks
    assert ls.verifier_calls == 0  # lifted, it commits every block unverified
    spec, _ = run(reference_backend(model, calibration=lift), PROMPT, "speculative", block_size=D)
    ar, _ = run(reference_backend(model), PROMPT, "ar", block_size=None)
    assert spec == ar  # speculative reads no confidence: still the AR text


def test_engine_loads_the_calibration_from_the_artifact(tmp_path):
    from bitmtp_edge import Engine

    model = random_model(0)
    pairs = random_pairs(7)
    with_cal = Engine.load(write_test_artifact(model, tmp_path / "a", calibration=pairs), backend="reference", device="cpu")
    without = Engine.load(write_test_artifact(model, tmp_path / "b"), backend="reference", device="cpu")
    assert without.backend.calibration is None
    assert torch.allclose(with_cal.backend.calibration.params, torch.tensor(pairs, dtype=torch.float32))


@pytest.mark.gpu
@needs_gpu
def test_gpu_ampere_backend_applies_the_artifacts_calibration(tmp_path):
    from bitmtp_edge import Engine

    model = random_model(6, vocab=256, hidden=256)
    lift = ((1.0, 8.0),) * 8
    kw = dict(block_size=8, max_context=256, smallest=16)
    plain = Engine.load(write_test_artifact(model, tmp_path / "plain", **kw), backend="ampere", device="cuda")
    lifted = Engine.load(write_test_artifact(model, tmp_path / "lift", calibration=lift, **kw), backend="ampere",
                         device="cuda")
    assert plain.backend.calibration is None and lifted.backend.calibration is not None
    ar = lifted.generate(PROMPT, max_new_tokens=64, policy="ar").token_ids
    for policy in ("speculative", "fused"):  # lossless whatever the confidences
        assert lifted.generate(PROMPT, max_new_tokens=64, policy=policy).token_ids == ar, policy
    p = plain.generate(PROMPT, max_new_tokens=64, policy="hybrid", tau=0.9, min_prefix=2).stats
    q = lifted.generate(PROMPT, max_new_tokens=64, policy="hybrid", tau=0.9, min_prefix=2).stats
    assert p.verifier_calls > 0 and q.verifier_calls == 0  # lifted: every block committed unverified


def test_export_carries_the_checkpoints_calibration_into_the_manifest(tmp_path):
    from bitmtp_edge.format.manifest import read_manifest
    from export import ExportOptions, export_checkpoint
    from export.errors import ExportError
    from tests.export_fixtures import copy_ckpt
    from tools.calibrate import write_config

    ckpt = copy_ckpt("bitmtp", tmp_path / "ckpt")
    d = json.loads((ckpt / "bitmtp.json").read_text())["block_size"]
    pairs = random_pairs(5, d)
    write_config(ckpt, [list(p) for p in pairs])
    export_checkpoint(ckpt, tmp_path / "out", ExportOptions())
    got = read_manifest(tmp_path / "out").mtp.confidence_calibration
    assert got == tuple((round(a, 6), round(b, 6)) for a, b in pairs)
    with pytest.raises(ValueError, match="one \\[a, b\\] pair per block slot"):
        write_config(ckpt, [list(p) for p in pairs[:-1]])  # refused before anything is written
    bad = json.loads((ckpt / "bitmtp.json").read_text())
    bad["confidence_calibration"][0] = [0.0, 1.0]
    (ckpt / "bitmtp.json").write_text(json.dumps(bad))
    with pytest.raises(ExportError, match="bitmtp.json.*confidence_calibration\\[0\\]"):
        export_checkpoint(ckpt, tmp_path / "out2", ExportOptions())
