"""Incremental detokenisation: pieces join to the full decode, never show a broken
character, and stop strings never leak, however the ids are chunked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from bitmtp_edge.runtime.engine import embedded_artifact_path
from bitmtp_edge.runtime import detokenize
from bitmtp_edge.runtime.detokenize import TextStream, _WindowDecoder

TEXT = "def grüße(x):\n    return '日本語 — naïve café 🙂🚀' + x  # ∑ ≤ ∞\n"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(embedded_artifact_path() / "tokenizer.json"))


class _OneIdDecodeStream:
    """A DecodeStream as older tokenizers releases have it: one id per step, lists refused."""

    def __init__(self, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.inner, self.calls = DecodeStream(skip_special_tokens=skip_special_tokens), 0

    def step(self, tokenizer, token_id):
        if not isinstance(token_id, int):
            raise TypeError("argument 'id': 'list' object cannot be interpreted as an integer")
        self.calls += 1
        return self.inner.step(tokenizer, token_id)


@pytest.fixture(params=["DecodeStream", "window", "one-id"])
def decoder_kind(request, monkeypatch):
    if request.param == "window":  # the fallback for tokenizers without DecodeStream
        monkeypatch.setattr(detokenize, "_decoder", _WindowDecoder)
    if request.param == "one-id":  # a DecodeStream without list steps: one call per id
        monkeypatch.setattr(detokenize, "_decoder", _OneIdDecodeStream)
    return request.param


def test_multibyte_text_streams_whole_characters_one_token_at_a_time(tokenizer, decoder_kind):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    # The byte-level BPE splits some characters over several tokens: the case under test.
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))
    stream = TextStream(tokenizer)
    pieces = [stream.push([t]) for t in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_a_push_of_many_ids_is_one_decoder_call_and_the_same_text(tokenizer, decoder_kind):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    calls = []
    stream = TextStream(tokenizer)
    inner = stream._decoder

    class Counting:  # counts the decoder calls
        def step(self, tok, x):
            calls.append(x)
            return inner.step(tok, x)

    stream._decoder = Counting()
    pieces = [stream.push(ids[i:i + 7]) for i in range(0, len(ids), 7)] + [stream.finish()]
    assert "".join(pieces) == TEXT
    batches = -(-len(ids) // 7)
    if decoder_kind == "one-id":  # the list was refused once, then one call per id
        assert len(calls) == len(ids) + 1 and not stream._batched
    else:
        assert len(calls) == batches


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=60),
       stops=st.lists(st.sampled_from(["é ", "🙂🚀", "return", "\n", "  ", "x  #", "zzz"]), max_size=2))
def test_any_chunking_with_stops_equals_cutting_the_full_text(tokenizer, cuts, stops):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    stream = TextStream(tokenizer, stops)
    pieces, start = [], 0
    for n in cuts * (len(ids) // len(cuts) + 1):
        if start >= len(ids) or stream.stopped:
            break
        piece = stream.push(ids[start:start + n])
        pieces.append(piece)
        start += n
    pieces.append(stream.finish())
    hits = [TEXT.find(s) for s in stops if s in TEXT]
    expected = TEXT[:min(hits)] if hits else TEXT
    assert "".join(pieces) == expected and stream.text == expected
    assert stream.stopped == bool(hits)
    # What was shown at any moment is a prefix of the final text: nothing of a stop leaked.
    shown = ""
    for p in pieces:
        shown += p
        assert expected.startswith(shown)


def test_engine_stream_equals_generate_with_stop_strings(tmp_path):
    from bitmtp_edge.runtime.engine import Engine
    from tests.helpers import random_model, write_test_artifact

    engine = Engine.load(write_test_artifact(random_model(13), tmp_path / "a"), backend="reference", device="cpu")
    full = engine.generate("t1 t2 t3", max_new_tokens=24, policy="ar")
    words = full.text.split()
    assert len(words) > 6
    stop = [" ".join(words[4:6])]  # a stop string spanning two tokens
    res = engine.generate("t1 t2 t3", max_new_tokens=24, policy="ar", stop=stop)
    pieces = list(engine.stream("t1 t2 t3", max_new_tokens=24, policy="ar", stop=stop))
    assert "".join(pieces) == res.text == full.text[:full.text.find(stop[0])]
    assert res.stats.finish_reason == "stop"
