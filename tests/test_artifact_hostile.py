"""Hostile artifacts: every edit of a manifest or of the weights is refused with a clear
``ArtifactError`` before anything big is allocated, or the artifact loads and generates
exactly as before. Explicit cases for each known attack, then property-based mutations."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import resource
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from bitmtp_edge.app.cli import main as bitmtp
from bitmtp_edge.format.manifest import MANIFEST, WEIGHTS, ArtifactError, read_manifest, sha256_file
from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, NonFiniteError, decode
from bitmtp_edge.runtime.engine import Engine

from .helpers import fast_backend, random_model, reference_backend, write_test_artifact

PROMPT = [5, 17, 33, 2, 41]
N_NEW = 8
BLOCK = 4


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_test_artifact(random_model(seed=3), tmp_path_factory.mktemp("art") / "model", block_size=BLOCK)


@pytest.fixture(scope="module")
def baseline(pristine) -> dict[str, list[int]]:
    eng = Engine.load(pristine, backend="reference", device="cpu")
    return {p: eng.generate(PROMPT, max_new_tokens=N_NEW, policy=p).token_ids for p in ("ar", "speculative")}


def copy_artifact(src: Path, dest: Path) -> Path:
    return Path(shutil.copytree(src, dest, symlinks=True))


def edit_manifest(folder: Path, edit) -> None:
    path = folder / MANIFEST
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def set_path(data, path: tuple, value):
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def edit_weights(folder: Path, edit) -> None:
    """Change the tensors and record the new sha256 (a consistent, deliberate edit)."""
    tensors = load_file(str(folder / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS))
    digest = sha256_file(folder / WEIGHTS)
    edit_manifest(folder, lambda d: set_path(d, ("files", WEIGHTS), digest))


def refused(folder: Path, *words: str) -> str:
    with pytest.raises(ArtifactError) as e:
        Engine.load(folder, backend="reference", device="cpu")
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    return msg


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- file names


def test_a_file_outside_the_folder_is_refused_even_with_its_right_hash(pristine, tmp_path):
    art = copy_artifact(pristine, tmp_path / "art")
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    edit_manifest(art, lambda d: set_path(d, ("files", "../secret.txt"), digest))
    refused(art, "../secret.txt", "plain file name")
    edit_manifest(art, lambda d: d["files"].pop("../secret.txt"))
    edit_manifest(art, lambda d: set_path(d, ("files", str(secret)), digest))
    refused(art, "plain file name")


def _with_alarm(seconds: int):
    """Fail instead of hanging forever (the bug this guards against was a hang)."""
    def _raise(*_):
        raise TimeoutError("hung")
    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    return old


def test_proc_files_fifos_and_links_out_are_refused_without_hanging(pristine, tmp_path):
    art = copy_artifact(pristine, tmp_path / "art")
    fake = "0" * 64
    old = _with_alarm(20)
    try:
        edit_manifest(art, lambda d: set_path(d, ("files", "/proc/self/pagemap"), fake))
        refused(art, "plain file name")
        edit_manifest(art, lambda d: d["files"].pop("/proc/self/pagemap"))
        # A link inside the folder pointing at /proc: resolved, found outside, refused.
        os.symlink("/proc/self/pagemap", art / "pagemap")
        edit_manifest(art, lambda d: set_path(d, ("files", "pagemap"), fake))
        refused(art, "outside the artifact folder")
        edit_manifest(art, lambda d: d["files"].pop("pagemap"))
        # A FIFO in the folder: opening it for reading would block until a writer comes.
        os.mkfifo(art / "pipe")
        edit_manifest(art, lambda d: set_path(d, ("files", "pipe"), fake))
        refused(art, "not a regular file")
        # The weights themselves replaced by a link out of the folder.
        edit_manifest(art, lambda d: d["files"].pop("pipe"))
        outside = tmp_path / "elsewhere.safetensors"
        shutil.move(art / WEIGHTS, outside)
        os.symlink(outside, art / WEIGHTS)
        refused(art, "outside the artifact folder")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_manifest_that_is_a_fifo_or_huge_is_refused(pristine, tmp_path):
    art = copy_artifact(pristine, tmp_path / "art")
    (art / MANIFEST).write_text(" " * (2 << 20) + "{}")
    refused(art, "bytes")
    (art / MANIFEST).unlink()
    os.mkfifo(art / MANIFEST)
    old = _with_alarm(20)
    try:
        refused(art, MANIFEST)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_link_inside_the_folder_is_followed(pristine, tmp_path, baseline):
    art = copy_artifact(pristine, tmp_path / "art")
    (art / "tokenizer.json").rename(art / "tokenizer.real.json")
    os.symlink("tokenizer.real.json", art / "tokenizer.json")
    eng = Engine.load(art, backend="reference", device="cpu")
    assert eng.generate(PROMPT, max_new_tokens=N_NEW, policy="ar").token_ids == baseline["ar"]


# ----------------------------------------------------------------------------- sizes before allocation


@pytest.mark.parametrize("path, value, words", [
    (("model", "vocab_size"), 8_000_000, ["model.vocab_size", "8000000"]),
    (("model", "vocab_size"), 100_000, ["model.embed_tokens.weight", "[100000, 128]"]),
    (("model", "num_layers"), 10 ** 6, ["model.num_layers"]),
    (("model", "num_layers"), 3, ["kv.bytes_per_slot"]),
    (("model", "hidden_size"), "128", ["model.hidden_size", "must be an integer"]),
    (("model", "hidden_size"), 128.0, ["model.hidden_size", "must be an integer"]),
    (("model", "intermediate_size"), 4096, ["model.intermediate_size"]),
    (("model", "num_kv_heads"), 4, ["bytes_per_slot"]),
    (("mtp", "mask_token_id"), 10 ** 6, ["mtp.mask_token_id"]),
    (("mtp", "mask_token_id"), 96, ["mtp.mask_token_id"]),
    (("mtp", "block_size"), 8, ["widths"]),
    (("mtp", "adapter_rank"), 16, ["mtp.adapter_rank", "no mask-row adapters"]),
    (("kv", "workspace"), 1, ["kv.workspace"]),
    (("model", "eos_token_ids"), [500], ["model.eos_token_ids"]),
    (("model", "tie_word_embeddings"), True, ["lm_head.weight"]),
    (("model", "family"), "qwen3", ["q_norm"]),
    (("quantization", "weights"), "group128", [".scale"]),
])
def test_edited_sizes_and_ids_are_refused_before_allocation(pristine, tmp_path, path, value, words):
    art = copy_artifact(pristine, tmp_path / "art")
    edit_manifest(art, lambda d: set_path(d, path, value))
    before = peak_rss_mib()
    refused(art, *words)
    assert peak_rss_mib() - before < 200  # the 8e6 vocabulary once reached 15.9 GB


def test_a_kv_capacity_of_millions_is_refused(pristine, tmp_path):
    art = copy_artifact(pristine, tmp_path / "art")

    def huge(d):
        seg = d["kv"]["segments"][-1]
        seg["capacity"] = 4_000_000
        seg["bytes"] = (seg["capacity"] + seg["workspace"]) * d["kv"]["bytes_per_slot"]
        d["kv"]["max_context"] = 4_000_000
    edit_manifest(art, huge)
    refused(art, "capacity", "max_position_embeddings")
    # Raising max_position_embeddings too stops at the bound on contexts.
    edit_manifest(art, lambda d: set_path(d, ("model", "max_position_embeddings"), 4_000_000))
    refused(art, "model.max_position_embeddings")


def test_a_max_context_too_small_to_decode_is_refused(pristine, tmp_path):
    """Every segment shrunk to 2·D slots (consistent bytes): it would load and refuse every MTP
    policy at the first request, so loading (and ``bitmtp doctor``) refuse it with the minimum."""
    art = copy_artifact(pristine, tmp_path / "art")

    def tiny(d):
        seg = d["kv"]["segments"][-1]
        seg["capacity"] = 2 * BLOCK
        seg["bytes"] = (seg["capacity"] + seg["workspace"]) * d["kv"]["bytes_per_slot"]
        d["kv"]["segments"] = [seg]
        d["kv"]["max_context"] = 2 * BLOCK
    edit_manifest(art, tiny)
    refused(art, "kv.max_context", f"at least {2 * BLOCK + 1}", f"--max-context {2 * BLOCK + 1}")


def test_a_kv_segment_larger_than_free_memory_is_refused(pristine, tmp_path, monkeypatch):
    from bitmtp_edge.format import validate

    art = copy_artifact(pristine, tmp_path / "art")
    monkeypatch.setattr(validate, "available_memory", lambda device: 1 << 20)
    refused(art, "largest KV segment", "GiB")


def test_block_size_edited_with_its_widths_is_still_refused(pristine, tmp_path):
    art = copy_artifact(pristine, tmp_path / "art")

    def d8(d):
        d["mtp"]["block_size"] = 8
        d["widths"] = {"verify": [1, 9], "draft": list(range(9, 17))}
    edit_manifest(art, d8)
    refused(art, "kv.workspace")  # a D=4 artifact has room for widths up to 8


def test_the_recorded_training_block_size_wins(pristine, tmp_path):
    art = copy_artifact(pristine, tmp_path / "art")
    edit_manifest(art, lambda d: set_path(d, ("source",), {"bitmtp": {"block_size": 2}}))
    refused(art, "trained with block_size 2")


@pytest.mark.parametrize("text", ["[1, 2, 3]", "\"manifest\"", "[" * 100_000, "null", "{\"format\": 7}"])
def test_manifests_of_the_wrong_shape_are_refused(pristine, tmp_path, text):
    art = copy_artifact(pristine, tmp_path / "art")
    (art / MANIFEST).write_text(text)
    refused(art, MANIFEST)


@pytest.mark.parametrize("section, value", [("model", []), ("kv", "x"), ("widths", [1]), ("files", [1, 2]),
                                            ("mtp", 3), ("kv", {"segments": "abc"})])
def test_sections_of_the_wrong_json_type_are_refused(pristine, tmp_path, section, value):
    art = copy_artifact(pristine, tmp_path / "art")
    edit_manifest(art, lambda d: set_path(d, (section,), value))
    refused(art, MANIFEST)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("name, value", [("model.norm.weight", float("nan")),
                                         ("model.layers.1.self_attn.q_proj.scale", float("inf")),
                                         ("model.embed_tokens.weight", float("-inf")),
                                         ("draft_head.scale", float("nan"))])
def test_non_finite_weights_are_refused_at_load(pristine, tmp_path, name, value):
    art = copy_artifact(pristine, tmp_path / "art")

    def poison(t):
        t[name].view(-1)[0] = value
    edit_weights(art, poison)
    refused(art, name, "non-finite")


def test_a_truncated_tensor_is_refused(pristine, tmp_path):
    art = copy_artifact(pristine, tmp_path / "art")
    edit_weights(art, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.packed",
                                             t["model.layers.0.mlp.up_proj.packed"][:-1].clone()))
    refused(art, "up_proj.packed")


def test_an_invalid_packed_code_is_an_artifact_error(pristine, tmp_path):
    art = copy_artifact(pristine, tmp_path / "art")
    edit_weights(art, lambda t: t["model.layers.0.mlp.up_proj.packed"].view(-1).__setitem__(0, 255))
    refused(art, "code 3")


# ----------------------------------------------------------------------------- NaN at run time


def _nan_model(which: str):
    model = random_model(seed=5)
    with torch.no_grad():
        if which == "norm":
            model.model.norm.weight[3] = float("nan")
        else:
            model.model.layers[1].self_attn.q_proj.scale.fill_(float("inf"))
    return model


@pytest.mark.parametrize("which", ["norm", "scale"])
@pytest.mark.parametrize("policy", ["ar", "confidence", "speculative", "hybrid", "fused"])
def test_nan_steps_stop_generation_with_an_error_on_the_reference_backend(which, policy):
    backend = reference_backend(_nan_model(which), block_size=BLOCK)
    opts = DecodeOptions(policy=policy, max_new_tokens=N_NEW, block_size=BLOCK, tau=0.5, min_prefix=2)
    stats = DecodeStats()
    emitted = []
    with pytest.raises(NonFiniteError, match="NaN/Inf"):
        for chunk in decode(backend, PROMPT, opts, stats):
            emitted += chunk
    assert emitted == [] and stats.finish_reason == "non_finite"


@pytest.mark.parametrize("policy", ["ar", "speculative", "hybrid", "fused"])
def test_nan_steps_stop_generation_on_the_graph_backend_without_extra_syncs(policy):
    model = _nan_model("norm")
    backend = fast_backend(model, block_size=BLOCK)
    opts = DecodeOptions(policy=policy, max_new_tokens=N_NEW, block_size=BLOCK, tau=0.5, min_prefix=2)
    with pytest.raises(NonFiniteError):
        list(decode(backend, PROMPT, opts, DecodeStats()))
    # A healthy model on the same backend: the flag rides on values the host reads anyway
    # (one read per decision: the token, or the draft's confidences, or the verify outputs).
    healthy = fast_backend(random_model(seed=5), block_size=BLOCK)
    stats = DecodeStats()
    list(decode(healthy, PROMPT, opts, stats))
    reads = {"ar": stats.iterations, "speculative": stats.iterations, "fused": stats.iterations,
             "hybrid": stats.draft_calls + stats.verifier_calls}[policy]
    assert stats.new_tokens == N_NEW and stats.host_syncs == reads


# ----------------------------------------------------------------------------- CLI users see no traceback


@pytest.mark.parametrize("command", [["generate", "x", "--device", "cpu", "-n", "2"], ["doctor"]])
def test_cli_reports_a_bad_artifact_in_one_line(pristine, tmp_path, command):
    art = copy_artifact(pristine, tmp_path / "art")
    edit_manifest(art, lambda d: set_path(d, ("model", "vocab_size"), 8_000_000))
    args = command[:1] + ["-a", str(art)] + command[1:]
    result = CliRunner().invoke(bitmtp, args)
    assert result.exit_code != 0
    assert "Traceback" not in result.output and not isinstance(result.exception, (KeyError, TypeError))
    assert "model.vocab_size" in result.output


# ----------------------------------------------------------------------------- property-based


LEAVES = [("model", k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                 "num_kv_heads", "head_dim", "max_position_embeddings", "family",
                                 "tie_word_embeddings")] + [
    ("quantization", "weights"), ("packing_layout",), ("mtp", "block_size"), ("mtp", "mask_token_id"),
    ("widths", "verify"), ("widths", "draft"), ("kv", "dtype"), ("kv", "bytes_per_slot"), ("kv", "workspace"),
    ("kv", "max_context"), ("kv", "segments"), ("kv", "segments", 0, "capacity"), ("kv", "segments", 0, "bytes"),
    ("kv", "segments", 0, "workspace"), ("draft_head",), ("format",), ("format_version",), ("mtp",), ("model",),
    ("files",), ("files", WEIGHTS), ("files", "tokenizer.json"),
]
# Not mutated: values the tensors cannot pin and that change the numbers by design
# (rope_theta, rms_norm_eps, eos/bos ids, activations, tau, min_prefix).

VALUES = st.one_of(
    st.integers(min_value=-2, max_value=3), st.sampled_from([8, 9, 16, 95, 96, 97, 128, 256, 512, 10 ** 6, 2 ** 40]),
    st.integers(min_value=-(2 ** 63), max_value=2 ** 63), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.sampled_from(["128", "../x", "/proc/self/pagemap", "qwen3", "group128", "float32"]),
    st.none(), st.booleans(), st.lists(st.integers(-1, 20), max_size=4), st.dictionaries(st.text(max_size=3),
                                                                                       st.integers(), max_size=2),
)

PROPERTY = settings(max_examples=30, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _loads_and_matches(folder: Path, baseline) -> None:
    try:
        eng = Engine.load(folder, backend="reference", device="cpu")
    except ArtifactError as e:
        assert str(e) and "\n" not in str(e)
        return
    for policy in (("ar", "speculative") if eng.manifest.mtp else ("ar",)):
        assert eng.generate(PROMPT, max_new_tokens=N_NEW, policy=policy).token_ids == baseline[policy]


@PROPERTY
@given(leaf=st.sampled_from(LEAVES), value=VALUES)
def test_any_single_manifest_edit_is_refused_or_harmless(pristine, baseline, tmp_path_factory, leaf, value):
    art = copy_artifact(pristine, tmp_path_factory.mktemp("prop") / "art")
    data = json.loads((art / MANIFEST).read_text())
    try:
        set_path(data, leaf, copy.deepcopy(value))
    except (KeyError, IndexError, TypeError):
        return
    (art / MANIFEST).write_text(json.dumps(data))
    _loads_and_matches(art, baseline)


WEIGHT_EDITS = st.sampled_from(["nan", "inf", "drop", "truncate", "extra", "dtype", "reshape"])


@PROPERTY
@given(edit=WEIGHT_EDITS, index=st.integers(min_value=0, max_value=10 ** 6), seed=st.integers(0, 2 ** 16))
def test_any_weight_edit_with_its_hash_updated_is_refused_or_harmless(pristine, baseline, tmp_path_factory,
                                                                     edit, index, seed):
    art = copy_artifact(pristine, tmp_path_factory.mktemp("propw") / "art")

    def mutate(tensors):
        names = sorted(tensors)
        name = names[index % len(names)]
        t = tensors[name]
        if edit in ("nan", "inf") and t.is_floating_point():
            t.view(-1)[seed % t.numel()] = float(edit)
        elif edit in ("nan", "inf"):
            t.view(-1)[seed % t.numel()] = 3  # integer tensors: an out-of-range code instead
        elif edit == "drop":
            del tensors[name]
        elif edit == "truncate" and t.shape[0] > 1:
            tensors[name] = t[:-1].clone()
        elif edit == "extra":
            tensors[f"model.layers.{seed % 4}.extra"] = torch.zeros(2)
        elif edit == "dtype":
            tensors[name] = t.to(torch.float64) if t.is_floating_point() else t.to(torch.int16)
        elif edit == "reshape":
            tensors[name] = t.reshape(-1).clone()
    edit_weights(art, mutate)
    _loads_and_matches(art, baseline)


def test_the_embedded_artifact_passes_every_check():
    from bitmtp_edge.format.validate import artifact_file, check_weights_header
    from bitmtp_edge.runtime.engine import embedded_artifact_path

    folder = embedded_artifact_path()
    if not (folder / MANIFEST).is_file():
        pytest.skip("no embedded model in this checkout")
    m = read_manifest(folder)
    check_weights_header(m, artifact_file(folder, WEIGHTS))
