"""Start training from an existing ternary checkpoint (``python -m tools.train --init CKPT``).

Any checkpoint ``bitmtp-export`` reads is accepted — HF BitNet latent or packed, Qwen3-layout
group-128 (Ternary-Bonsai ``-unpacked``), our own SFT or BitMTP checkpoints — because the
exporter's own readers turn it into canonical ternary codes + scales. The training model
gets latent weights whose quantisers give back exactly those codes and scales, so step 0
of the fine-tune is the checkpoint's model:

* per-tensor absmean (BitNet): ``W = codes · s / f`` with ``f`` the fraction of non-zero
  codes: then mean|W| = s and round(W / s) = codes (|codes / f| >= 1 rounds to ±1). The
  float32 mean rounds, so one weight's magnitude is bisected until absmean returns s bit for
  bit; where the mean's granularity skips s, it lands an ulp or two of s away (~1e-7 relative);
* group-128 absmax (Qwen3 / Bonsai): ``W = codes · s_group``, which absmax reads back as is.

The mask token: the corpus' tokenizer (``tools.corpus build --tokenizer CKPT``) has
``<|mask|>``; when its id is outside the checkpoint's vocabulary the embedding (and an untied
head) grow to hold it. Its embedding and head rows start at the mean of the other rows (as
SDLM initialises its mask token), unless the checkpoint is a BitMTP model trained with that
very mask id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bitmtp_edge.format.config import ModelConfig, MTPConfig
from bitmtp_edge.runtime.model import LatentTernaryLinear, TernaryLM
from tools.hf_checkpoint import quant_config


class InitError(ValueError):
    """The --init checkpoint cannot seed this run: names the file and what to do."""


@dataclass(frozen=True)
class InitInfo:
    path: str
    format: str
    family: str
    source_vocab: int
    mask_token_id: int
    mask_row: str  # "kept" | "mean"
    mtp: MTPConfig | None


def latent_from_codes(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 latent weights whose ternary quantiser returns exactly ``codes`` and ``scale``."""
    c = codes.float()
    if scale.dim() == 2:  # group-128 absmax
        n, k = codes.shape
        return (c.view(n, scale.shape[1], -1) * scale.float().unsqueeze(-1)).view(n, k)
    from kernels_ampere.numerics import ternarize_absmean

    nnz = int((codes != 0).sum())
    if nnz == 0:
        return torch.zeros_like(c)
    target = scale.reshape(1).float()
    w = c * (target * (codes.numel() / nnz))
    # float32 summation rounds the mean by an ulp or so. The mean is monotone in any one
    # element, so bisect the magnitude of the first non-zero weight (within ±0.4 s: its code
    # stays ±1) until absmean reads back the scale bit for bit.
    i = int((codes.reshape(-1) != 0).nonzero()[0])
    flat = w.view(-1)
    sign, base = float(c.view(-1)[i]), float(flat[i].abs())
    lo, hi = base - 0.4 * float(target), base + 0.4 * float(target)
    for _ in range(60):
        got = ternarize_absmean(w)[1]
        if torch.equal(got, target):
            break
        mid = float(flat[i].abs())
        lo, hi = (mid, hi) if bool(got < target) else (lo, mid)
        flat[i] = sign * (lo + hi) / 2
    return w


def check_tokenizer(ckpt_dir: Path, data_tokenizer: Path, flag: str = "--init") -> None:
    """Every token of the checkpoint's tokenizer must have the same id in the corpus' one."""
    from tools.tokenizer import load_tokenizer

    src = ckpt_dir / "tokenizer.json"
    if not src.is_file():
        raise InitError(f"{src}: missing; the corpus must be encoded with the checkpoint's tokenizer, so {flag} "
                        "needs it beside the weights")
    a, b = load_tokenizer(src).get_vocab(), load_tokenizer(data_tokenizer).get_vocab()
    bad = [t for t, i in a.items() if b.get(t) != i]
    if bad:
        raise InitError(f"{data_tokenizer}: {len(bad)} of the {len(a)} tokens of {src} have other ids (e.g. "
                        f"{bad[0]!r}); build the corpus with `python -m tools.corpus build --tokenizer {ckpt_dir} ...`")


def load_for_training(path: str | Path, mask_token_id: int, data_tokenizer: Path | None = None,
                      keep_mask_row: bool = False, flag: str = "--init") -> tuple[TernaryLM, InitInfo]:
    """The checkpoint as a float32 QAT model (``LatentTernaryLinear``) with room for the mask token.

    ``keep_mask_row``: leave the mask token's embedding row as the checkpoint has it (when it
    has one) instead of the mean row: with mask-row adapters the model must stay the source
    bit for bit (a tied head reads that row as the mask token's logit), and the adapters'
    per-slot input offset does what a trained mask row would. ``flag``: the option that named
    the checkpoint, for the error messages."""
    from export.checkpoint import open_checkpoint
    from export.errors import ExportError
    from export.hf_config import read_spec
    from export.readers import Dense, Ternary, detect_format, read_tensors, source_tensors

    path = Path(path)
    try:
        if data_tokenizer is not None:
            if not (path / "config.json").is_file():  # not a checkpoint at all: say that, not "no tokenizer"
                raise InitError(f"{flag} {path}: no config.json, so not a checkpoint; give a checkpoint folder "
                                "(config.json, *.safetensors, tokenizer.json: what save_pretrained or tools.train "
                                "write)")
            check_tokenizer(path, data_tokenizer, flag)
        with open_checkpoint(path) as ck:
            spec = read_spec(ck)
            fmt = detect_format(ck, spec)
            tensors = list(read_tensors(ck, spec, fmt, source_tensors(ck, spec, fmt)))
    except ExportError as e:
        raise InitError(f"{flag} {path}: {e}") from None
    cfg: ModelConfig = spec.model
    vocab = max(cfg.vocab_size, mask_token_id + 1)
    model = TernaryLM(replace(cfg, vocab_size=vocab), quant_config(cfg), linear_cls=LatentTernaryLinear)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for t in tensors:
            if isinstance(t, Ternary):
                params[f"{t.name}.weight"].copy_(latent_from_codes(t.codes, t.scale))
            elif isinstance(t, Dense):
                dst = params[t.name]
                src = t.tensor.float()
                dst[: src.shape[0]].copy_(src) if t.name.endswith(("embed_tokens.weight", "lm_head.weight")) \
                    else dst.copy_(src)
        keep = (spec.mtp is not None and spec.mtp.mask_token_id == mask_token_id) or (
            keep_mask_row and mask_token_id < cfg.vocab_size)
        if not keep:
            _mean_row(params["model.embed_tokens.weight"], mask_token_id, cfg.vocab_size)
            if not cfg.tie_word_embeddings:
                _mean_row(params["lm_head.weight"], mask_token_id, cfg.vocab_size)
    info = InitInfo(str(path), fmt, cfg.family, cfg.vocab_size, mask_token_id, "kept" if keep else "mean", spec.mtp)
    return model, info


def _mean_row(weight: torch.Tensor, row: int, source_rows: int) -> None:
    """Set ``weight[row]`` to the mean of the checkpoint's other rows (grown rows excluded)."""
    others = torch.ones(source_rows, dtype=torch.bool)
    if row < source_rows:
        others[row] = False
    weight[row] = weight[:source_rows][others].mean(0)
    if weight.shape[0] > source_rows:  # rows added for the mask token only: never seen, never predicted
        grown = [r for r in range(source_rows, weight.shape[0]) if r != row]
        if grown:
            weight[grown] = weight[row].clone()
