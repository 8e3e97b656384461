"""The ONNX graphs as an outside user drives them (onnxruntime, CPU), on tiny random models.

Every step is fed fresh random history K/V (not zeros) and compared with the reference
backend's model (``TernaryLM`` in float64, through a KV buffer laid out as the graphs' inputs:
P history rows then the step's S rows), for both families (BitNet per-tensor W1.58A8, Qwen3
per-tensor and group-128 weight-only with a padded K), tied and untied heads, GQA and MHA, odd
widths and positions up to the KV capacity (512). A full speculative decode (prefill, draft,
verify, AR) runs on the graphs' own KV and is held to the ``ReferenceBackend`` step by step.
Then the files: checker, versions, and ``--onnx-from`` / ``build_onnx`` on folders that
cannot be written, builds that fail or are interrupted half way.

int8 activations (every projection of a W1.58A8 model, the draft head of any model): where
torch and onnxruntime round an activation on a .5 tie differently (their float32 values an
ulp apart; see tests/test_onnx.py), that row and the rows after it may differ by an int8
step. ``assert_step_matches`` accepts a mismatch only when the first differing int8
activation is such a tie; without int8 activations it is held to the tolerance.
"""

from __future__ import annotations

import json
import os
import signal
import types
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the ONNX export needs onnx (pip install 'bitmtp-edge[onnx]')")
ort = pytest.importorskip("onnxruntime", reason="these tests run the graphs in onnxruntime (bitmtp-edge[onnx])")

from bitmtp_edge.format.config import QuantConfig
from bitmtp_edge.format.manifest import MANIFEST, read_manifest
from bitmtp_edge.runtime.calibration import calibrate_confidences
from bitmtp_edge.runtime.decoding_rules import accepted_prefix
from bitmtp_edge.runtime.engine import Engine
from bitmtp_edge.runtime.masks import causal_step_mask, draft_step_mask
from export import onnx_export
from export.onnx_export import (
    ARTIFACT_ONNX_FILES,
    DRAFT_OUTPUTS,
    INPUTS,
    IR_VERSION,
    OPSET,
    VERIFY_OUTPUTS,
    OnnxExportError,
    build_onnx,
)
from tests.export_fixtures import checkpoint, run_cli
from tests.test_onnx import capture_reference_quantisation

from .helpers import one_thread, random_model, write_test_artifact  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")

ATOL, RTOL = 1e-4, 1e-4
TIE_WINDOW = 1e-4
D = 4
CAPACITY = 512  # the artifacts' max_context
CALIBRATION = ((1.5, 0.3), (2.0, -0.5), (0.7, 0.1), (1.2, 1.0))
G128_WO = QuantConfig(weights="group128", activations="none")
MODELS = {  # kind -> random_model arguments
    "bitnet-i8": dict(seed=1),
    "bitnet-i8-tied-mha": dict(seed=2, tie=True, heads=(4, 4), hidden=64, intermediate=200),
    "bitnet-weight-only": dict(seed=5, quant=QuantConfig(activations="none")),
    "qwen3-i8": dict(seed=3, family="qwen3"),
    "qwen3-g128-k200": dict(seed=4, family="qwen3", quant=G128_WO, hidden=96, heads=(3, 1), intermediate=200),
    "qwen3-g128-calibrated": dict(seed=6, family="qwen3", quant=G128_WO),  # head scaled down: see below
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """kind -> (artifact folder with its ONNX graphs, reference Engine), built on first use."""
    root = tmp_path_factory.mktemp("onnx-rt")
    made = {}

    def get(kind: str):
        if kind not in made:
            out = root / kind
            model = random_model(**MODELS[kind])
            calibrated = kind.endswith("calibrated")
            if calibrated:  # a random head is so sharp that every confidence is 1.0, which calibration keeps
                with torch.no_grad():
                    model.lm_head.weight.mul_(0.05)
                model.attach_draft_head()
            write_test_artifact(model, out, block_size=D, max_context=CAPACITY,
                                calibration=CALIBRATION if calibrated else None)
            build_onnx(out)
            made[kind] = (out, Engine.load(out, backend="reference", device="cpu"))
        return made[kind]
    return get


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield


def session(model: Path | bytes):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(model) if isinstance(model, Path) else model, opts,
                                providers=["CPUExecutionProvider"])


def feed(tokens, positions, past_k, past_v, mask) -> dict[str, np.ndarray]:
    return {"input_ids": np.asarray([tokens], np.int64), "positions": np.asarray([positions], np.int64),
            "past_key": past_k, "past_value": past_v, "attention_mask": np.asarray(mask, bool)}


def reference_step(model, tokens, positions, past_k, past_v, mask):
    """The reference model over the graphs' KV layout: (hidden [S, H] float64, present K, V)."""
    layers, hkv, p, hd = past_k.shape
    s = len(tokens)
    k = torch.zeros(layers, hkv, p + s, hd, dtype=torch.float64)
    v = torch.zeros_like(k)
    k[:, :, :p], v[:, :, :p] = torch.from_numpy(past_k), torch.from_numpy(past_v)
    hidden = model(torch.tensor([tokens]), torch.tensor([positions]), torch.as_tensor(mask).unsqueeze(0),
                   kv=types.SimpleNamespace(k=k, v=v), write_slots=torch.arange(p, p + s))[0]
    return hidden, k.float().numpy(), v.float().numpy()


def int8_activations(path: Path, inputs) -> list[np.ndarray]:
    """Every int8 activation tensor the graph computes, in graph (= the reference's call) order."""
    model = onnx.load(str(path))
    names = [n.output[0] for n in model.graph.node if n.op_type == "Cast" and n.output[0].startswith("x_int8")]
    for name in names:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return session(model.SerializeToString()).run(names, inputs)


def assert_step_matches(eng, path: Path, inputs, got: dict, ref: dict, seen: list) -> None:
    """``got`` (onnxruntime) == ``ref`` (reference) within tolerance, or a documented int8 tie."""
    bad = [k for k in ref if not np.allclose(got[k], ref[k], atol=ATOL, rtol=RTOL)]
    if not bad:
        return
    ours = int8_activations(path, inputs)  # weight-only models: the draft head's input only
    assert len(ours) == len(seen)
    first = next((i for i, (o, (_, r)) in enumerate(zip(ours, seen)) if (o != r.numpy()).any()), None)
    assert first is not None, f"{bad} deviate with identical int8 activations"
    x, r = seen[first]
    rows, cols = np.nonzero(ours[first] != r.numpy())
    q = 127.0 / x.abs().amax(-1).clamp(min=1e-5)
    frac = (x[rows, cols] * q[rows]).abs().numpy() % 1.0
    assert np.all(np.abs(frac - 0.5) < TIE_WINDOW), f"int8 activations differ off a rounding tie: {frac}"


def random_kv(cfg, p: int, rng) -> tuple[np.ndarray, np.ndarray]:
    shape = (cfg.num_layers, cfg.num_kv_heads, p, cfg.head_dim)
    return rng.randn(*shape).astype(np.float32), rng.randn(*shape).astype(np.float32)


# --- single steps over random history ----------------------------------------------------

@pytest.mark.parametrize("kind", list(MODELS))
def test_verify_graph_steps_over_random_history_match_the_reference(artifact, kind, monkeypatch):
    out, eng = artifact(kind)
    model, cfg = eng.backend.model, eng.manifest.model
    sess, rng = session(out / "model.onnx"), np.random.RandomState(11)
    # (P, S): prefill, odd widths, a verify-width step, the last slots below the capacity.
    for p, s in [(0, 1), (0, 7), (5, 1), (9, 11), (23, D + 1), (CAPACITY - 7, 3), (CAPACITY - 1, 1)]:
        pk, pv = random_kv(cfg, p, rng)
        tokens = rng.randint(0, cfg.vocab_size, s).tolist()
        hidden_slot = p - 1 if s == D + 1 else None  # the verify's repeated anchor
        mask = causal_step_mask(p, s, p, s, hidden_slot=hidden_slot)
        positions = list(range(p - 1, p - 1 + s)) if hidden_slot is not None else list(range(p, p + s))
        inputs = feed(tokens, positions, pk, pv, mask)
        seen = capture_reference_quantisation(monkeypatch)
        hidden, rk, rv = reference_step(model, tokens, positions, pk, pv, mask)
        ref = {"logits": model.verify_logits(hidden).numpy(), "present_key": rk, "present_value": rv}
        got = dict(zip(VERIFY_OUTPUTS, sess.run(list(VERIFY_OUTPUTS), inputs)))
        assert got["present_key"].shape == (cfg.num_layers, cfg.num_kv_heads, p + s, cfg.head_dim)
        np.testing.assert_array_equal(got["present_key"][:, :, :p], pk)  # the history passes through as given
        assert_step_matches(eng, out / "model.onnx", inputs, got, ref, seen)


@pytest.mark.parametrize("kind", list(MODELS))
def test_draft_graph_steps_over_random_history_match_the_reference(artifact, kind, monkeypatch):
    out, eng = artifact(kind)
    model, cfg, mask_id = eng.backend.model, eng.manifest.model, eng.manifest.mtp.mask_token_id
    sess, rng = session(out / "model_draft.onnx"), np.random.RandomState(12)
    for p, k in [(0, 1), (1, 2), (6, 1), (13, 3), (CAPACITY - D - 4, D)]:
        pk, pv = random_kv(cfg, p, rng)
        pending = rng.randint(0, cfg.vocab_size, k).tolist()
        tokens = pending + [pending[-1]] + [mask_id] * (D - 1)
        positions = list(range(p, p + k)) + list(range(p + k - 1, p + k - 1 + D))
        mask = draft_step_mask(p, k + D, p, k, D)
        inputs = feed(tokens, positions, pk, pv, mask)
        seen = capture_reference_quantisation(monkeypatch)
        hidden, rk, rv = reference_step(model, tokens, positions, pk, pv, mask)
        logits = model.draft_logits(hidden[k:])
        conf, top = torch.softmax(logits, dim=-1).max(dim=-1)
        if eng.backend.calibration is not None:
            conf = eng.backend.calibration(conf, 0)
        got = dict(zip(DRAFT_OUTPUTS, sess.run(list(DRAFT_OUTPUTS), inputs)))
        ref = {"draft_logits": logits.numpy(), "draft_confidences": conf.numpy(), "present_key": rk,
               "present_value": rv}
        assert_step_matches(eng, out / "model_draft.onnx", inputs, got, ref, seen)
        if np.allclose(got["draft_logits"], ref["draft_logits"], atol=ATOL, rtol=RTOL):
            assert got["draft_tokens"].tolist() == top.tolist()


def test_draft_confidences_are_the_calibrated_ones_the_runtime_reports(artifact):
    # The hybrid policy's tau test reads the calibrated confidence: a graph that returned the
    # raw max-softmax of a calibrated model would make different accept decisions.
    out, eng = artifact("qwen3-g128-calibrated")
    cfg, mask_id = eng.manifest.model, eng.manifest.mtp.mask_token_id
    rng = np.random.RandomState(13)
    p, k = 9, 2
    pk, pv = random_kv(cfg, p, rng)
    pending = rng.randint(0, cfg.vocab_size, k).tolist()
    tokens = pending + [pending[-1]] + [mask_id] * (D - 1)
    positions = list(range(p, p + k)) + list(range(p + k - 1, p + k - 1 + D))
    _, conf, logits, _, _ = session(out / "model_draft.onnx").run(
        list(DRAFT_OUTPUTS), feed(tokens, positions, pk, pv, draft_step_mask(p, k + D, p, k, D)))
    raw = torch.softmax(torch.from_numpy(logits), dim=-1).max(dim=-1).values
    expected = calibrate_confidences(raw, torch.tensor(CALIBRATION, dtype=torch.float32))
    assert not np.allclose(raw.numpy(), expected.numpy(), atol=1e-3)  # the calibration matters here
    np.testing.assert_allclose(conf, expected.numpy(), atol=1e-6, rtol=1e-5)


# --- a whole decode on the graphs' own KV ---------------------------------------------------

@pytest.mark.parametrize("kind, prompt_len", [("qwen3-g128-calibrated", 13), ("qwen3-g128-k200", CAPACITY - 24),
                                              ("bitnet-weight-only", 7)])
def test_speculative_decode_through_onnxruntime_matches_the_reference_backend(artifact, kind, prompt_len):
    """Prefill, then draft (k = 1) / verify rounds and an AR step, as the docs say to drive
    them, the KV kept as they say; each step against ``ReferenceBackend`` on its own KV."""
    out, eng = artifact(kind)
    cfg, mask_id, ref = eng.manifest.model, eng.manifest.mtp.mask_token_id, eng.backend
    verify, draft = session(out / "model.onnx"), session(out / "model_draft.onnx")
    prompt = np.random.RandomState(prompt_len).randint(0, cfg.vocab_size - 2, prompt_len).tolist()
    ref.reset()
    ref.prefill(prompt[:-1])
    empty = np.zeros((cfg.num_layers, cfg.num_kv_heads, 0, cfg.head_dim), np.float32)
    p = len(prompt) - 1
    _, pk, pv = verify.run(list(VERIFY_OUTPUTS),
                           feed(prompt[:-1], range(p), empty, empty, causal_step_mask(0, p, 0, p)))
    anchor, accepted_total = prompt[-1], 0
    while p + 1 + 2 * D <= CAPACITY - 1:
        # Draft: k = 1 pending token (the anchor); keep rows 0..P+k-1.
        expected = ref.draft_step([anchor], D)
        tokens, positions = [anchor, anchor] + [mask_id] * (D - 1), [p] + list(range(p, p + D))
        drafts, conf, _, dk, dv = draft.run(list(DRAFT_OUTPUTS),
                                            feed(tokens, positions, pk, pv, draft_step_mask(p, 1 + D, p, 1, D)))
        assert drafts.tolist() == expected.tokens
        # The draft head quantises its input to int8 even in a weight-only model, and the two KVs
        # (float32 here, float64 there) drift ~1e-6 apart over the decode: now and then an input
        # lands an int8 step apart, moving a confidence by up to ~1e-2 (the exact comparison is
        # the single-step tests' job).
        np.testing.assert_allclose(conf, expected.confidences, atol=2e-2)
        pk, pv, p = dk[:, :, :p + 1], dv[:, :, :p + 1], p + 1
        # Verify [anchor, d_1..d_D] at positions P-1..P+D-1, the anchor's history row hidden.
        result = ref.verify_step(anchor, expected)
        s = D + 1
        logits, vk, vv = verify.run(list(VERIFY_OUTPUTS), feed([anchor] + drafts.tolist(), range(p - 1, p - 1 + s),
                                                             pk, pv, causal_step_mask(p, s, p, s, hidden_slot=p - 1)))
        greedy = logits.argmax(-1).tolist()
        a = accepted_prefix(drafts.tolist(), greedy)
        assert (a, greedy[a]) == (result.accepted, result.verifier_token)
        keep = list(range(p)) + list(range(p + 1, p + 1 + a))  # row P repeats the anchor's history row
        pk, pv, p = vk[:, :, keep], vv[:, :, keep], p + a
        np.testing.assert_allclose(pk, ref.kv.history()[0].float().numpy(), atol=ATOL, rtol=RTOL)
        anchor, accepted_total = greedy[a], accepted_total + a
        # An AR step on the verifier's token.
        token = ref.ar_step(anchor)
        logits, pk, pv = verify.run(list(VERIFY_OUTPUTS), feed([anchor], [p], pk, pv, causal_step_mask(p, 1, p, 1)))
        assert int(logits[0].argmax()) == token
        anchor, p = token, p + 1
    assert p == ref.history_length and p >= min(prompt_len, CAPACITY - 2 * D - 1)
    assert accepted_total > 0  # the rows kept after a verify include accepted drafts


# --- the files ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen3-g128-calibrated", "bitnet-i8"])
def test_graphs_pass_the_full_checker_with_the_documented_versions(artifact, kind):
    out, _ = artifact(kind)
    for name, outputs in (("model.onnx", VERIFY_OUTPUTS), ("model_draft.onnx", DRAFT_OUTPUTS)):
        onnx.checker.check_model(str(out / name), full_check=True)
        model = onnx.load(str(out / name), load_external_data=False)
        assert (model.ir_version, [(o.domain, o.version) for o in model.opset_import]) == (IR_VERSION, [("", OPSET)])
        sess = session(out / name)
        assert [i.name for i in sess.get_inputs()] == list(INPUTS)
        assert [o.name for o in sess.get_outputs()] == list(outputs)
    assert f"opset {OPSET}, IR version {IR_VERSION}" in onnx_export.__doc__


def _onnx_left(folder: Path) -> list[str]:
    """ONNX files and temporary files of any kind in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name in ARTIFACT_ONNX_FILES or ".tmp-" in p.name)


def _assert_loads_without_onnx(folder: Path) -> None:
    Engine.load(folder, backend="reference", device="cpu")  # every listed checksum holds
    assert _onnx_left(folder) == []  # nothing half-written, no mix of old and new graphs
    assert not set(ARTIFACT_ONNX_FILES) & set(read_manifest(folder).files)


@pytest.fixture
def exported(tmp_path) -> Path:
    out = tmp_path / "art"
    assert run_cli(checkpoint("bitmtp"), out, "-q").exit_code == 0
    return out


def test_onnx_from_a_plain_folder_is_refused_and_nothing_written(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    result = run_cli("--onnx-from", plain)
    assert result.exit_code == 2 and "not an artifact" in result.stderr, result.output
    assert sorted(p.name for p in plain.iterdir()) == ["notes.txt"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_onnx_from_a_read_only_folder_is_a_clear_error(exported):
    os.chmod(exported, 0o555)
    try:
        result = run_cli("--onnx-from", exported)
    finally:
        os.chmod(exported, 0o755)
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.output
    _assert_loads_without_onnx(exported)


@pytest.mark.parametrize("flags, code", [(("--onnx-from",), 2), (("--onnx",), 3)])
def test_an_unwritable_folder_is_a_clear_error_with_nothing_left(exported, tmp_path, monkeypatch, flags, code):
    # As a read-only folder or a full disk answers (the skip above covers root, which ignores modes).
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(onnx_export, "open", refuse, raising=False)
    if flags == ("--onnx",):
        exported = tmp_path / "fresh"
        result = run_cli(checkpoint("bitmtp"), exported, "--onnx", "-q")
    else:
        result = run_cli("--onnx-from", exported)
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("error: ") and "cannot write the ONNX files (Permission denied)" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    _assert_loads_without_onnx(exported)


@pytest.mark.parametrize("fail_on", ["model.onnx", "model_draft.onnx", "manifest.json"])
def test_a_rebuild_failing_half_way_leaves_the_artifact_loadable(exported, monkeypatch, fail_on):
    """Graphs of an earlier exporter version are replaced; the disk fills while the new files
    are renamed into place (or the manifest is rewritten after them)."""
    build_onnx(exported)
    monkeypatch.setattr(onnx_export, "EXPORTER_VERSION", "99.0.0")  # the new graphs' bytes differ
    real_replace, renamed = os.replace, []

    def replace(src, dst, *args, **kwargs):
        name = Path(dst).name
        if name == fail_on and (name != MANIFEST or "model_draft.onnx" in renamed):
            raise OSError(28, "No space left on device", str(src))
        renamed.append(name)
        return real_replace(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OnnxExportError, match="No space left on device"):
        build_onnx(exported)
    monkeypatch.setattr(os, "replace", real_replace)
    _assert_loads_without_onnx(exported)
    build_onnx(exported)  # and a later run writes them
    Engine.load(exported, backend="reference", device="cpu")
    assert set(ARTIFACT_ONNX_FILES) <= set(read_manifest(exported).files)


def test_a_failure_before_any_rename_keeps_the_earlier_graphs(exported, monkeypatch):
    build_onnx(exported)
    before = {n: (exported / n).read_bytes() for n in ARTIFACT_ONNX_FILES}
    manifest = (exported / MANIFEST).read_text()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(onnx_export, "build_step_model", fail)
    with pytest.raises(OnnxExportError, match="No space left"):
        build_onnx(exported)
    assert {n: (exported / n).read_bytes() for n in ARTIFACT_ONNX_FILES} == before
    assert (exported / MANIFEST).read_text() == manifest and not [p for p in exported.iterdir() if ".tmp-" in p.name]


def test_sigterm_while_writing_the_graphs_removes_the_partial_files(exported, monkeypatch):
    def stray_signal(signum, frame):  # without the CLI's own handler, the test fails here instead of dying
        raise RuntimeError("SIGTERM reached the default handler: the partial files would stay behind")
    previous = signal.signal(signal.SIGTERM, stray_signal)
    real_build = onnx_export.build_step_model

    def build_then_signal(*args, **kwargs):
        model = real_build(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the data file is half written
        return model
    monkeypatch.setattr(onnx_export, "build_step_model", build_then_signal)
    try:
        result = run_cli("--onnx-from", exported)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 143, result.output
    assert "SIGTERM" in result.stderr and "Traceback" not in result.output
    _assert_loads_without_onnx(exported)
    assert json.loads((exported / MANIFEST).read_text())["files"]
