"""The decoding policies' names, defined once (torch-free: the CLI builds its options from them).

* ``ar``: one token per width-1 verify step (the baseline);
* ``confidence``: commit max(h, 1) drafts, h = the leading drafts with confidence >= τ;
* ``speculative``: always verify the block (lossless: the output equals AR's);
* ``hybrid``: commit h drafts if h >= m, else verify;
* ``fused``: lossless like speculative, one forward pass per iteration: each verify carries
  the draft blocks of the c likeliest acceptance lengths (``DecodeOptions.candidates``).

The defaults of τ and m are the model's (``MTPConfig`` in the manifest); ``DecodeOptions.for_model``
applies them.
"""

from __future__ import annotations

AR, CONFIDENCE, SPECULATIVE, HYBRID, FUSED = "ar", "confidence", "speculative", "hybrid", "fused"
POLICIES = (AR, CONFIDENCE, SPECULATIVE, HYBRID, FUSED)
