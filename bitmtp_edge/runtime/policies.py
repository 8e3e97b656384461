"""The decoding policies' names, defined once (torch-free: the CLI builds its options from them).

* ``ar``: one token per width-1 verify step (the baseline);
* ``confidence``: commit max(h, 1) drafts, h = the leading drafts with confidence >= τ;
* ``speculative``: always verify the block (lossless: the output equals AR's);
* ``hybrid``: commit h drafts if h >= m, else verify.

The defaults of τ and m are the model's (``MTPConfig`` in the manifest); ``DecodeOptions.for_model``
applies them.
"""

from __future__ import annotations

AR, CONFIDENCE, SPECULATIVE, HYBRID = "ar", "confidence", "speculative", "hybrid"
POLICIES = (AR, CONFIDENCE, SPECULATIVE, HYBRID)
