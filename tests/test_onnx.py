"""The ONNX decode-step graphs (export/onnx_export.py) against the reference backend, via onnxruntime.

Tolerance: verify-role logits agree with the reference backend (float64 on the CPU) to
``|Δ| ≤ ATOL + RTOL·|ref|`` (measured ≤ 1.5e-6 on logits of magnitude ~1.3), *up to the
first int8 rounding tie*: an activation whose float32 ``x·127/max|x|`` lands on a .5
boundary (about one in 1e5 activations) rounds one way in torch and the other way in
onnxruntime whenever their float32 values differ by an ulp (RMSNorm and attention reduce in
different orders; neither is wrong). That row and every later one then differ by about one
int8 step (measured up to 4e-2 on these checkpoints). ``assert_logits_match`` checks
exactly that: rows before the earliest flipped row within tolerance, the first flip in that
row a tie, the rest within a sanity bound. Greedy tokens (64 AR steps) and drafts must be
identical on these fixed checkpoints; on a flat random model a tie can also flip a greedy
choice, so such equality is a property of the checkpoint, not a guarantee.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from bitmtp_edge.backends.base import DraftResult
from bitmtp_edge.format.manifest import MANIFEST, read_manifest, sha256_file
from bitmtp_edge.runtime.decoding_rules import accepted_prefix
from bitmtp_edge.runtime.engine import Engine, embedded_artifact_path
from bitmtp_edge.runtime.masks import causal_step_mask, draft_step_mask
import bitmtp_edge.runtime.model as model_module
from export import export_checkpoint
from export.onnx_export import (
    DRAFT_OUTPUTS,
    INPUTS,
    OPSET,
    VERIFY_OUTPUTS,
    OnnxExportError,
    build_onnx,
    build_onnx_files,
)
from tests.export_fixtures import checkpoint, run_cli

ATOL, RTOL = 1e-4, 1e-4
TIE_WINDOW = 1e-4  # |x·q - (n + 0.5)| below this is a tie at float32 precision (ulp of 127 is 7.6e-6)
KINDS = ["bitnet-online", "bitnet-packed-autobitlinear", "bitnet-online-bf16", "bitnet-online-untied",
         "qwen3-fp16", "bitmtp", "bitnet-online-k200", "qwen3-fp32-k200"]
PROMPT = "def forward(x, weight, scale):"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """kind -> an exported artifact folder with its ONNX graphs (built on first use)."""
    root = tmp_path_factory.mktemp("onnx")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            out = root / kind
            export_checkpoint(checkpoint(kind), out)
            build_onnx(out)
            made[kind] = out
        return made[kind]
    return get


# --- driving the graphs ------------------------------------------------------------------

def session(path: Path | bytes):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # tiny graphs: threads only add contention
    return ort.InferenceSession(str(path) if isinstance(path, Path) else path, opts,
                                providers=["CPUExecutionProvider"])


def empty_kv(eng: Engine) -> np.ndarray:
    cfg = eng.manifest.model
    return np.zeros((cfg.num_layers, cfg.num_kv_heads, 0, cfg.head_dim), np.float32)


def feed(tokens, positions, past_k, past_v, mask) -> dict[str, np.ndarray]:
    return {"input_ids": np.asarray([tokens], np.int64), "positions": np.asarray([positions], np.int64),
            "past_key": past_k, "past_value": past_v, "attention_mask": np.asarray(mask, bool)}


def prefill(sess, eng: Engine, tokens: list[int], past=None):
    """A causal step over ``tokens`` after ``past``: (logits, present_key, present_value)."""
    pk, pv = past if past is not None else (empty_kv(eng), empty_kv(eng))
    p, s = pk.shape[2], len(tokens)
    return sess.run(list(VERIFY_OUTPUTS), feed(tokens, range(p, p + s), pk, pv, causal_step_mask(p, s, p, s)))


def ort_ar_greedy(sess, eng: Engine, prompt: list[int], n: int) -> list[int]:
    """Engine's AR route on the verify graph: prefill all but the last token, then width-1 steps."""
    _, pk, pv = prefill(sess, eng, prompt[:-1])
    token, out = prompt[-1], []
    while len(out) < n:
        logits, pk, pv = prefill(sess, eng, [token], (pk, pv))
        token = int(logits[0].argmax())
        if token in eng.eos_token_ids:
            break
        out.append(token)
    return out


def capture_reference_quantisation(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Record (x, x_int8) of every activation quantisation the reference model runs."""
    seen = []
    original = model_module.quantize_activations

    def spy(x):
        x_int, scale = original(x)
        seen.append((x.detach().float().reshape(-1, x.shape[-1]).clone(), x_int.reshape(-1, x.shape[-1]).clone()))
        return x_int, scale
    monkeypatch.setattr(model_module, "quantize_activations", spy)
    return seen


def ort_quantisation(path: Path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Every int8 activation tensor of the verify graph, in graph order."""
    model = onnx.load(str(path))
    names = [n.output[0] for n in model.graph.node if n.op_type == "Cast" and n.output[0].startswith("x_int8")]
    for name in names:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return session(model.SerializeToString()).run(names, inputs)


def assert_logits_match(eng: Engine, path: Path, ids: list[int], monkeypatch) -> float:
    """The verify graph over ``ids`` (P = 0) against ``Engine.logits``; returns max |Δ|."""
    seen = capture_reference_quantisation(monkeypatch) if eng.manifest.quant.quantize_activations else []
    ref = eng.logits(ids).numpy()
    inputs = feed(ids, range(len(ids)), empty_kv(eng), empty_kv(eng), causal_step_mask(0, len(ids), 0, len(ids)))
    got = session(path).run(["logits"], inputs)[0]
    diff = np.abs(got - ref)
    bad_rows = np.nonzero((diff > ATOL + RTOL * np.abs(ref)).any(-1))[0]
    if len(bad_rows):
        assert seen, f"weight-only graph deviates from the reference at rows {bad_rows.tolist()}"
        ours = ort_quantisation(path, inputs)
        assert len(ours) == len(seen)
        flips = [o != r.numpy() for o, (_, r) in zip(ours, seen)]  # per quantisation: [rows, K]
        flipped_rows = [i for i in range(len(ids)) if any(f[i].any() for f in flips)]
        assert flipped_rows, f"logits deviate at rows {bad_rows.tolist()} with identical int8 activations"
        first_row = flipped_rows[0]
        # Rows before it saw ulp-close values everywhere, so the first flip in it must be a tie.
        call = next(c for c, f in enumerate(flips) if f[first_row].any())
        x = seen[call][0][first_row]
        cols = np.nonzero(flips[call][first_row])[0]
        frac = (x[cols] * (127.0 / x.abs().amax().clamp(min=1e-5))).abs().numpy() % 1.0
        assert np.all(np.abs(frac - 0.5) < TIE_WINDOW), f"int8 activations differ off a rounding tie: {frac}"
        assert bad_rows.min() >= first_row, "rows before the first int8 tie flip deviate"
        # A sanity bound only (one flipped int8 step, carried through the later layers).
        assert diff.max() < 0.1 * np.abs(ref).max(), "a tie flip moved the logits by more than a few int8 steps"
        assert (got[:first_row].argmax(-1) == ref[:first_row].argmax(-1)).all()
    else:
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    return float(diff.max())


# --- the files ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bitmtp", "qwen3-fp16"])
def test_checker_passes_with_shapes_inferred(artifacts, kind):
    out = artifacts(kind)
    names = ["model.onnx", "model_draft.onnx"] if kind == "bitmtp" else ["model.onnx"]
    for name in names:
        onnx.checker.check_model(str(out / name), full_check=True)
        model = onnx.load(str(out / name), load_external_data=False)
        inferred = onnx.shape_inference.infer_shapes(onnx.load(str(out / name)), strict_mode=True)
        assert model.opset_import[0].version == OPSET >= 17
        assert [i.name for i in model.graph.input] == list(INPUTS)
        expected = VERIFY_OUTPUTS if name == "model.onnx" else DRAFT_OUTPUTS
        assert [o.name for o in model.graph.output] == list(expected)
        assert all(v.doc_string for v in [*model.graph.input, *model.graph.output]) and model.graph.doc_string
        ids_shape = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        assert ids_shape == [1, "S"]
        past_shape = [d.dim_param or d.dim_value for d in model.graph.input[2].type.tensor_type.shape.dim]
        assert past_shape[2] == "P"
        assert len(inferred.graph.value_info) > len(model.graph.node) // 2  # intermediate shapes inferred


def test_ternary_projections_are_int8_initialisers_with_integer_matmul(artifacts):
    out = artifacts("bitmtp")
    manifest = read_manifest(out)
    for name, heads in (("model.onnx", 0), ("model_draft.onnx", 1)):
        model = onnx.load(str(out / name), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        assert ops.count("MatMulInteger") == 7 * manifest.model.num_layers + heads
        codes = [t for t in model.graph.initializer if t.name.endswith(".codes_t")]
        assert len(codes) == 7 * manifest.model.num_layers
        assert all(t.data_type == onnx.TensorProto.INT8 for t in codes)
        assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in codes)
        # Float MatMul only inside attention (QK^T, PV): every projection product is integer.
        assert ops.count("MatMul") == 2 * manifest.model.num_layers
    props = {p.key: p.value for p in onnx.load(str(out / "model_draft.onnx"), load_external_data=False).metadata_props}
    assert props["bitmtp.role"] == "draft" and int(props["bitmtp.block_size"]) == manifest.mtp.block_size


def test_manifest_records_the_onnx_files_and_engine_still_loads(artifacts):
    out = artifacts("bitmtp")
    files = read_manifest(out).files
    for name in ("model.onnx", "model_draft.onnx", "model.onnx.data"):
        assert files[name] == sha256_file(out / name)
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary file left behind"
    Engine.load(out, backend="reference", device="cpu")  # verifies every checksum
    build_onnx(out)  # rebuilding in place is idempotent
    assert read_manifest(out).files == files


def test_ar_only_artifact_gets_only_the_verify_graph(artifacts):
    out = artifacts("bitnet-online")
    assert (out / "model.onnx").is_file() and not (out / "model_draft.onnx").exists()


def test_out_path_elsewhere_leaves_the_manifest_alone(artifacts, tmp_path):
    out = artifacts("bitnet-online")
    before = (out / MANIFEST).read_text()
    files = build_onnx_files(out, tmp_path / "exported" / "step.onnx")
    assert files.verify.is_file() and files.data == tmp_path / "exported" / "step.onnx.data" and files.draft is None
    assert (out / MANIFEST).read_text() == before
    onnx.checker.check_model(str(files.verify), full_check=True)


# --- numerics ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_the_reference_backend(artifacts, kind, monkeypatch):
    out = artifacts(kind)
    eng = Engine.load(out, backend="reference", device="cpu")
    ids = [int(t) for t in np.random.RandomState(7).randint(0, eng.manifest.model.vocab_size, 40)]
    assert_logits_match(eng, out / "model.onnx", ids, monkeypatch)


def test_a_step_over_fed_back_kv_matches_one_full_pass(artifacts):
    # Weight-only: no int8 ties, so the fed-back KV can be held to the float tolerance.
    out = artifacts("qwen3-fp16")
    eng = Engine.load(out, backend="reference", device="cpu")
    ids = eng.encode(PROMPT * 2)
    sess = session(out / "model.onnx")
    full = eng.logits(ids).numpy()
    _, pk, pv = prefill(sess, eng, ids[:20])
    tail, pk2, _ = prefill(sess, eng, ids[20:], (pk, pv))
    assert pk2.shape[2] == len(ids)
    np.testing.assert_allclose(tail, full[20:], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["bitmtp", "qwen3-fp16"])
def test_ar_greedy_loop_through_onnxruntime_matches_engine_generate(artifacts, kind):
    out = artifacts(kind)
    eng = Engine.load(out, backend="reference", device="cpu")
    prompt = eng.encode(PROMPT)
    expected = eng.generate(prompt, max_new_tokens=64, policy="ar").token_ids
    assert len(expected) == 64  # no early EOS: the comparison covers all 64 tokens
    assert ort_ar_greedy(session(out / "model.onnx"), eng, prompt, 64) == expected


@pytest.mark.parametrize("pending", [1, 3])
def test_draft_step_through_onnxruntime_matches_the_reference_draft_step(artifacts, pending):
    out = artifacts("bitmtp")
    eng = Engine.load(out, backend="reference", device="cpu")
    d, mask_id = eng.manifest.mtp.block_size, eng.manifest.mtp.mask_token_id
    prompt = eng.encode(PROMPT)
    history, pend = prompt[:-pending], prompt[-pending:]
    ref = eng.backend
    ref.reset()
    ref.prefill(history)
    # The same history as the reference's (an int8 tie in an onnxruntime prefill would
    # perturb it by one int8 step; the AR test covers chaining through our own KV).
    pk, pv = (t.float().numpy().copy() for t in ref.kv.history())
    expected = ref.draft_step(pend, d)

    p, s = len(history), pending + d
    tokens = pend + [pend[-1]] + [mask_id] * (d - 1)
    positions = list(range(p, p + pending)) + list(range(p + pending - 1, p + pending - 1 + d))
    drafts, conf, _, present_k, _ = session(out / "model_draft.onnx").run(
        list(DRAFT_OUTPUTS), feed(tokens, positions, pk, pv, draft_step_mask(p, s, p, pending, d)))
    assert drafts.tolist() == expected.tokens
    np.testing.assert_allclose(conf, expected.confidences, rtol=1e-4)
    # The pending rows' K is what the runtime materialises into history after a draft.
    hist_k = ref.kv.history()[0].numpy()
    np.testing.assert_allclose(present_k[:, :, : p + pending], hist_k, atol=ATOL, rtol=RTOL)


def test_verify_step_with_the_hidden_anchor_row_matches_the_reference(artifacts):
    out = artifacts("bitmtp")
    eng = Engine.load(out, backend="reference", device="cpu")
    prompt = eng.encode(PROMPT)
    sess = session(out / "model.onnx")
    greedy = ort_ar_greedy(sess, eng, prompt, 4)
    drafts = greedy[:2] + [(greedy[2] + 1) % eng.manifest.model.vocab_size, greedy[3]]  # d_3 is wrong
    ref = eng.backend
    ref.reset()
    ref.prefill(prompt)
    expected = ref.verify_step(prompt[-1], DraftResult(drafts, [1.0] * len(drafts)))

    _, pk, pv = prefill(sess, eng, prompt)
    p, s = len(prompt), len(drafts) + 1
    mask = causal_step_mask(p, s, p, s, hidden_slot=p - 1)  # the repeated anchor's history row
    logits = sess.run(["logits"], feed([prompt[-1]] + drafts, range(p - 1, p - 1 + s), pk, pv, mask))[0]
    rows = logits.argmax(-1).tolist()
    a = accepted_prefix(drafts, rows)
    assert (a, rows[a]) == (expected.accepted, expected.verifier_token) == (2, greedy[2])


# --- bad input ---------------------------------------------------------------------------

def test_uncovered_architecture_is_refused_with_a_clear_error(artifacts, tmp_path):
    art = Path(shutil.copytree(artifacts("qwen3-fp16"), tmp_path / "art"))
    for name in ("model.onnx", "model.onnx.data"):
        (art / name).unlink()
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["quantization"]["activations"] = "int8_per_token"  # group-128 W1.58A8: not covered
    (art / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OnnxExportError) as e:
        build_onnx(art)
    msg = str(e.value)
    assert str(art / MANIFEST) in msg and "group-128" in msg and "not covered" in msg and msg.count("; ") == 1
    assert not (art / "model.onnx").exists()
    assert not [p for p in art.iterdir() if p.name.startswith(".")]


def test_missing_artifact_is_refused(tmp_path):
    with pytest.raises(OnnxExportError, match="no such artifact folder"):
        build_onnx(tmp_path / "nope")


# --- the CLI -----------------------------------------------------------------------------

def test_cli_export_with_onnx_writes_the_graphs(tmp_path):
    out = tmp_path / "out"
    result = run_cli(checkpoint("bitmtp"), out, "--onnx", "-q")
    assert result.exit_code == 0, result.output
    assert {"model.onnx", "model_draft.onnx", "model.onnx.data"} <= set(read_manifest(out).files)


def test_cli_onnx_from_an_existing_artifact(tmp_path):
    out = tmp_path / "out"
    assert run_cli(checkpoint("qwen3-fp16"), out, "-q").exit_code == 0
    assert not (out / "model.onnx").exists()
    result = run_cli("--onnx-from", out)
    assert result.exit_code == 0, result.output
    assert "model.onnx" in read_manifest(out).files


def test_cli_onnx_on_an_uncovered_architecture_still_writes_the_artifact(tmp_path, monkeypatch):
    from export import onnx_export

    def refuse(manifest, where):
        raise OnnxExportError(where, "architecture not covered by the ONNX builder (simulated)", "export without --onnx")
    monkeypatch.setattr(onnx_export, "check_onnx_coverage", refuse)
    out = tmp_path / "out"
    result = run_cli(checkpoint("bitnet-online"), out, "--onnx", "-q")
    assert result.exit_code == 3, result.output
    assert "not covered" in result.stderr and "Traceback" not in result.output
    assert read_manifest(out).files and not (out / "model.onnx").exists()
    Engine.load(out, backend="reference", device="cpu")


def test_cli_onnx_from_a_missing_folder_exits_2(tmp_path):
    result = run_cli("--onnx-from", tmp_path / "nope")
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


@pytest.mark.parametrize("extra", [["--max-context", "256"], ["--board", "orin-nano-8gb"], ["--overwrite"]])
def test_cli_onnx_from_refuses_options_that_would_change_nothing(tmp_path, extra):
    """They were accepted and silently ignored: a user asking for another context got none."""
    result = run_cli("--onnx-from", tmp_path, *extra)
    assert result.exit_code == 2 and extra[0] in result.output and "would change nothing" in result.output


# --- the embedded model ------------------------------------------------------------------

@pytest.mark.skipif(not (embedded_artifact_path() / MANIFEST).is_file(), reason="no embedded model in this checkout")
def test_embedded_model_exports_and_matches(tmp_path, monkeypatch):
    art = Path(shutil.copytree(embedded_artifact_path(), tmp_path / "embedded"))
    build_onnx(art)
    eng = Engine.load(art, backend="reference", device="cpu")
    ids = eng.encode(PROMPT)
    assert_logits_match(eng, art / "model.onnx", ids, monkeypatch)
    prompt = ids[:8]
    expected = eng.generate(prompt, max_new_tokens=16, policy="ar").token_ids
    assert ort_ar_greedy(session(art / "model.onnx"), eng, prompt, 16) == expected
