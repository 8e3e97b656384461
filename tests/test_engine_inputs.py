"""The Python API with inputs a new user tries: two streams on one engine, a temperature
just above 0, stop strings from a generator, sampling fields of the wrong type, a device
torch does not know. Each either works as documented or is one clear error naming the
argument (tests/test_cli_inputs.py has the rest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bitmtp_edge.runtime.decoding import DecodingError
from bitmtp_edge.runtime.engine import Engine

from .helpers import no_prefill, one_thread, random_model, write_test_artifact  # noqa: F401  (the fixtures, by name)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "t5 t6"  # seed 13: eight distinct tokens before any end-of-text


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return write_test_artifact(random_model(seed=13), tmp_path_factory.mktemp("engine-inputs") / "model", block_size=4)


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.load(artifact, backend="reference", device="cpu")


def solo(engine, prompt, policy, n=6):
    return engine.generate(prompt, max_new_tokens=n, policy=policy).token_ids


# ----------------------------------------------------------------------------- one KV cache


@pytest.mark.parametrize("policy", ["ar", "speculative", "fused"])
def test_a_stream_interrupted_by_another_generation_stops_with_a_clear_error(engine, policy):
    # The engine holds one KV cache: the second stream resets it. The first must not go on
    # decoding from the second's cache (wrong tokens, or an AssertionError about the KV).
    other = "t9 t8 t7 t6"
    first, second = engine.stream_ids(PROMPT, max_new_tokens=6, policy=policy), \
        engine.stream_ids(other, max_new_tokens=6, policy=policy)
    head = next(first)
    rest = [t for chunk in second for t in chunk]
    with pytest.raises(DecodingError, match="another generation"):
        next(first)
    assert rest == solo(engine, other, policy)
    assert head == solo(engine, PROMPT, policy)[:len(head)]


def test_logits_between_two_steps_of_a_stream_ends_the_stream(engine):
    # The graph backend scores in the KV buffer, so on a GPU the stream's cache is gone;
    # the reference backend refuses alike, so a CPU test shows what a GPU run would do.
    stream = engine.stream_ids(PROMPT, max_new_tokens=6, policy="ar")
    next(stream)
    engine.logits([1, 2, 3])
    with pytest.raises(DecodingError, match="logits"):
        next(stream)


def test_an_abandoned_stream_leaves_the_engine_usable(engine):
    stream = engine.stream(PROMPT, max_new_tokens=6, policy="speculative")
    next(stream)  # then dropped without close(): the usual `break` out of a for loop
    assert solo(engine, PROMPT, "speculative") == solo(engine, PROMPT, "ar")
    with pytest.raises(DecodingError, match="another generation"):
        next(stream)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("policy", ["ar", "speculative", "hybrid"])
@pytest.mark.parametrize("temperature", [1e-40, 1e-9])
def test_a_temperature_just_above_zero_is_greedy(engine, policy, temperature):
    # 1e-40 overflowed logits / T in float32: AR drew the last token id every step and
    # speculative stopped with an error blaming the weights.
    greedy = engine.generate(PROMPT, max_new_tokens=6, policy=policy)
    res = engine.generate(PROMPT, max_new_tokens=6, policy=policy, temperature=temperature, seed=3)
    assert res.token_ids == greedy.token_ids


@pytest.mark.parametrize("kw, name", [({"temperature": "0.5"}, "temperature"), ({"top_p": "0.9"}, "top_p"),
                                      ({"temperature": None}, "temperature"), ({"seed": True}, "seed"),
                                      ({"seed": 1.0}, "seed"), ({"top_k": True}, "top_k")])
def test_sampling_fields_of_the_wrong_type_are_named_when_called(no_prefill, kw, name):
    with pytest.raises(TypeError, match=name):
        no_prefill.stream(PROMPT, max_new_tokens=2, policy="ar", **kw)


def test_numpy_seeds_and_top_k_are_integers(engine):
    plain = engine.generate(PROMPT, max_new_tokens=6, policy="ar", temperature=0.9, top_k=5, seed=4)
    numpy = engine.generate(PROMPT, max_new_tokens=6, policy="ar", temperature=np.float32(0.9),
                            top_k=np.int64(5), seed=np.int64(4))
    assert numpy.token_ids == plain.token_ids and numpy.stats.seed == 4


# ----------------------------------------------------------------------------- the verify head


def test_the_int8_head_decodes_losslessly_against_its_own_ar(artifact):
    """``Engine.load(head="int8")``: the engine says which head it verifies with, and every
    lossless policy equals that head's AR."""
    eng = Engine.load(artifact, backend="reference", device="cpu", head="int8")
    assert eng.head == "int8" and eng.backend.model.int8_verify
    ar = solo(eng, PROMPT, "ar", n=24)
    for policy in ("speculative", "fused"):
        assert solo(eng, PROMPT, policy, n=24) == ar, policy


def test_the_int4_draft_head_is_lossless_and_named(artifact):
    """``Engine.load(draft_head="int4")``: the engine says which head drafts, the drafts read
    int4 rows, and speculative and fused equal AR; an unknown draft head is refused by name."""
    eng = Engine.load(artifact, backend="reference", device="cpu", draft_head="int4")
    assert eng.draft_head == "int4" and eng.head == "16bit"
    assert int(eng.backend.model.draft_head_int8.abs().max()) <= 7
    ar = solo(eng, PROMPT, "ar", n=24)
    for policy in ("speculative", "fused"):
        assert solo(eng, PROMPT, policy, n=24) == ar, policy
    assert Engine.load(artifact, backend="reference", device="cpu").draft_head == "int8"
    with pytest.raises(ValueError, match="unknown draft head 'fp4'; choose one of auto, int8, int4"):
        Engine.load(artifact, backend="reference", device="cpu", draft_head="fp4")


@pytest.mark.parametrize("head", ["fp8", "int4", "", "INT8"])
def test_an_unknown_head_is_named(artifact, head):
    with pytest.raises(ValueError, match=f"unknown head {head!r}; choose one of 16bit, int8"):
        Engine.load(artifact, backend="reference", device="cpu", head=head)


# ----------------------------------------------------------------------------- stop strings


def test_stop_strings_from_a_generator_are_honoured(engine):
    full = engine.generate(PROMPT, max_new_tokens=8, policy="ar")
    stop = engine.decode_ids(full.token_ids[2:3]).strip()
    assert stop and stop in full.text
    listed = engine.generate(PROMPT, max_new_tokens=8, policy="ar", stop=[stop])
    assert listed.stats.finish_reason == "stop"
    once = engine.generate(PROMPT, max_new_tokens=8, policy="ar", stop=(s for s in [stop]))
    assert (once.text, once.stats.finish_reason) == (listed.text, "stop")
    streamed = "".join(engine.stream(PROMPT, max_new_tokens=8, policy="ar", stop=iter([stop])))
    assert streamed == listed.text


@pytest.mark.parametrize("stop", [5, b"t3", "t3"])
def test_a_stop_that_is_not_a_list_of_strings_is_named(no_prefill, stop):
    with pytest.raises(TypeError, match="stop must be a list of strings"):
        no_prefill.generate(PROMPT, max_new_tokens=2, stop=stop)


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize("device", ["tpu", "", "CPU", "meta", "xpu"])
def test_a_device_torch_cannot_run_here_is_one_value_error(artifact, device):
    with pytest.raises(ValueError, match=f"device={device!r}"):
        Engine.load(artifact, backend="reference", device=device)


# ----------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("policy", ["speculative", "hybrid"])
def test_a_stop_string_counts_the_tokens_ar_would_have_produced(engine, policy):
    """A multi-token step commits a whole block; the tokens after the one that completes the
    stop string are not the request's: token_ids, stats.new_tokens (the server's usage) and
    the streamed count equal AR's for the same text."""
    from bitmtp_edge.runtime.decoding import DecodeStats

    lossless = {"tau": 1.0} if policy == "hybrid" else {}  # hybrid verifying every block: AR's text
    chunks = list(engine.stream_ids(PROMPT, max_new_tokens=12, policy=policy, **lossless))
    ids = [t for c in chunks for t in c]
    assert ids == engine.generate(PROMPT, max_new_tokens=12, policy="ar").token_ids
    # a stop string that first completes at the first token of a multi-token commit
    at = next(sum(map(len, chunks[:i])) + 1 for i, c in enumerate(chunks) if len(c) > 1)
    before, through = engine.decode_ids(ids[:at - 1]), engine.decode_ids(ids[:at])
    stop = through[-(len(through) - len(before) + 1):]
    assert stop and stop not in before, "the probe needs a stop string that is new at that token"
    ar = engine.generate(PROMPT, max_new_tokens=12, policy="ar", stop=[stop])
    assert ar.stats.finish_reason == "stop" and len(ar.token_ids) == at
    multi = engine.generate(PROMPT, max_new_tokens=12, policy=policy, stop=[stop], **lossless)
    assert (multi.text, multi.token_ids, multi.stats.new_tokens) == (ar.text, ar.token_ids, at)
    streamed = DecodeStats()
    text = "".join(engine.stream(PROMPT, max_new_tokens=12, policy=policy, stop=[stop], stats=streamed, **lossless))
    assert (text, streamed.new_tokens, streamed.finish_reason) == (ar.text, at, "stop")
