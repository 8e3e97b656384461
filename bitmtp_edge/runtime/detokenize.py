"""Incremental detokenisation with stop strings: O(1) work per token.

Re-decoding every generated id at every step costs O(n²) over a reply. ``TextStream``
feeds ids through ``tokenizers``' ``DecodeStream``, each push's ids in one call (it keeps a small window
of ids and emits text only once it is whole, so a multi-byte character split over several
byte-level tokens never shows up as U+FFFD), searches stop strings only in the newly
decoded tail, and holds back a tail that could still grow into a stop string, so what a
stream shows is always a prefix of the final text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class _WindowDecoder:
    """The same contract as ``DecodeStream`` for tokenizers releases without it: decode a
    window of ids from the last emitted boundary and emit the new text once it does not
    end in an incomplete character."""

    def __init__(self, skip_special_tokens: bool):
        self.skip, self.ids, self.prefix, self.read = skip_special_tokens, [], 0, 0

    def step(self, tokenizer, token_ids: int | list[int]) -> str | None:
        if isinstance(token_ids, list):
            self.ids.extend(token_ids)
        else:
            self.ids.append(token_ids)
        before = tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        now = tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return None


def _decoder(skip_special_tokens: bool):
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return _WindowDecoder(skip_special_tokens)
    return DecodeStream(skip_special_tokens=skip_special_tokens)


class TextStream:
    """Push committed ids, get the text that is final; ``stopped`` once a stop string shows.

    The concatenation of every ``push`` and the final ``finish`` equals the full decode of
    the ids, cut before the first stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] | None = None, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self._decoder = _decoder(skip_special_tokens)
        self._batched = True  # one decoder step per push (a list of ids), until a decoder refuses lists
        self.stop = [s for s in (stop or ()) if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self._emitted: list[str] = []  # a list: += on a str attribute would copy it each time
        self._pending = ""  # decoded text not emitted yet (at most the stop hold-back + one step)
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def push(self, ids: Iterable[int]) -> str:
        """Decode ``ids``; return the newly final text ("" when it is all held back)."""
        if self.stopped:
            return ""
        ids = [int(t) for t in ids]
        if ids:
            self._pending += self._step(ids)
        if not self.stop:
            return self._emit(len(self._pending))
        # Only the held-back tail (shorter than the longest stop) plus new text can hold a stop.
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(min(hits), drop_rest=True)
        return self._emit(len(self._pending) - self._partial_stop_suffix())

    def _step(self, ids: list[int]) -> str:
        """The text ``ids`` complete: one decoder call for the whole list where the decoder
        takes lists (tokenizers >= 0.22), else one per id."""
        if self._batched and len(ids) > 1:
            try:
                return self._decoder.step(self.tokenizer, ids) or ""
            except TypeError:  # a DecodeStream that takes one id per step
                self._batched = False
        pieces = (self._decoder.step(self.tokenizer, t) for t in ids)
        return "".join(p for p in pieces if p)

    def finish(self) -> str:
        """The held-back tail once no more ids come (it cannot become a stop string now)."""
        return "" if self.stopped else self._emit(len(self._pending))

    def _emit(self, end: int, drop_rest: bool = False) -> str:
        out = self._pending[:end]
        self._pending = "" if drop_rest else self._pending[end:]
        self._emitted.append(out)
        return out

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        tail = self._pending[-(self._longest - 1):] if self._longest > 1 else ""
        for n in range(len(tail), 0, -1):
            end = tail[-n:]
            if any(s.startswith(end) for s in self.stop):
                return n
        return 0
