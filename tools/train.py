"""Joint NTP + MTP quantisation-aware training of a ternary code model (docs/decoding.md §Training).

    # BitMTP, D = 8, 40 blocks per 512-token row, fitted to an 8-minute budget
    python -m tools.train --data runs/data --out runs/d8 --block-size 8 --blocks 40 \
        --max-steps 0 --time-budget-s 480 --share-plan runs/d8/plan.json
    # the SFT baseline: the same command with the MTP term off, same steps as the run above
    python -m tools.train --data runs/data --out runs/sft --mtp-weight 0 --steps-from runs/d8/plan.json

The model is ``bitmtp_edge.runtime.model.TernaryLM`` with ``LatentTernaryLinear``: latent float
weights, ternary absmean weights and int8 per-token activations with straight-through
gradients — the quantisers of ``kernels_ampere.numerics``, which the exporter and runtime use.
Each row is the SDLM layout of ``tools.blocks``: the loss is NTP cross-entropy on the clean
causal stream plus ``mtp_weight`` × the cross-entropy of the mask blocks.

Fine-tuning and self-distillation (issue 14)::

    # an existing ternary checkpoint (any form bitmtp-export reads) -> BitMTP D = 8
    python -m tools.train --init tools/checkpoints/sft-27m --data runs/data --out runs/sft2mtp --lr 1e-3 ...
    # self-distillation: mask blocks on the model's own greedy continuations (tools.distill)
    python -m tools.train --init tools/checkpoints/bitmtp-d8-27m --distill runs/distill --kl-weight 1 ...
    # two GPUs of one host (DistributedDataParallel; --batch-size is the global batch)
    torchrun --nproc-per-node 2 -m tools.train ...
    # a model that does not fit one GPU: parameters, gradients and optimiser state sharded (FSDP2)
    torchrun --nproc-per-node 2 -m tools.train --fsdp ...

Under ``--fsdp`` (``tools.fsdp``) each decoder layer is one shard unit, gathered for its forward
and backward; checkpoints are written whole by rank 0 (the same files as without it), and
``resume.pt`` holds the optimiser state whole, keyed by parameter name, so a paused sharded run
resumes with ``--fsdp`` on the same process count. A frozen ``--ntp-teacher`` stays whole on
every GPU.

With ``--distill DIR`` a fraction ``--distill-frac`` of every batch are rows of the model's
own greedy continuations (``tools.distill``): their blocks are anchored in the generated part,
so the MTP cross-entropy is on the teacher's greedy tokens. ``--distill-ntp`` says what NTP
targets their clean stream carries: ``none`` (the NTP term stays on corpus rows), ``prompt``
(the corpus tokens of the prompt they continue: real text, so the backbone keeps seeing it in
every row the blocks train on) or ``all`` (the teacher's own tokens too). ``--kl-weight`` adds, on every row, the KL from
the clean stream's own distribution at the position a block slot predicts (detached: the
verifier as it is at this step) to the slot's distribution, the calibration signal hybrid
decoding's confidence test needs. ``--slot-weights`` weights the MTP terms per slot.

NTP distillation from a stronger next-token model (the held-out NTP gap)::

    python -m tools.train --init tools/checkpoints/bitmtp-d8-27m --ntp-teacher tools/checkpoints/sft-27m \
        --ntp-kl-weight 0.5 ...

``--ntp-teacher CKPT`` (any form bitmtp-export reads, same tokenizer) runs beside the student,
frozen, on the clean stream; at every position the NTP term scores, the target becomes a mix:
``(1 - w) × CE(corpus token) + w × KL(teacher's next-token distribution ‖ the student's)``
with ``w = --ntp-kl-weight``. A soft target carries the teacher's whole distribution, so it
moves the student toward the teacher's loss with less gradient noise than the one-hot token.
The teacher costs one forward pass over the clean rows per step (no backward).

Capacity for the draft rows alone (issue 14: the clean stream, hence the verifier and the NTP
loss, stays the ``--init`` model bit for bit; only the new tensors train)::

    python -m tools.train --init tools/checkpoints/sft-27m --adapter-rank 32 --distill runs/distill ...
    python -m tools.train --init tools/checkpoints/sft-27m --twin-layers 4 --distill runs/distill ...

``--adapter-rank R``: a low-rank 16-bit update of every projection on the block rows;
``--twin-layers N``: full-rank ternary copies of the last N layers' projections that the block
rows use instead (``runtime.model.MaskRowAdapter`` / ``MaskRowTwin``); either with a learned
per-slot input offset. ``--twin-kv`` (with twins): the block rows of the twinned layers also
read the history through the twins' keys and values, not the verifier's. ``bitmtp-export`` does not take such checkpoints yet.

Outputs under ``--out``: ``final/`` (latent float32 HF checkpoint), ``compact/`` (packed
HF BitNet, the release form), ``latest/`` + ``resume.pt`` (periodic, for ``--resume``),
``train_log.json`` (config, loss history, validation, summary). ``--resume`` continues only
the same model, data and objective (it may change --lr, --max-steps, --batch-size, ...); to
change those, start a new run from the weights: ``--init OUT/latest --out NEW``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bitmtp_edge.format.config import ModelConfig, MTPConfig
from bitmtp_edge.runtime.model import LatentTernaryLinear, TernaryLM
from tools.blocks import IGNORE, BlockLayout, build_rows, clean_mask, sample_anchors
from tools.corpus import CorpusIndex, load_split
from tools.hf_checkpoint import CheckpointError, load_latent_model, quant_config, save_compact, save_latent

# Named model shapes (gpt-fast style presets). Every projection's K is a multiple of 128.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32),
    "small": dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64),
    "base27m": dict(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64),
    # base27m 1.5x wider at the same depth (2.1x the parameters): the capacity step of issue 14's
    # scale round; packed with its embeddings it stays well inside the 60 MB package limit
    "base56m": dict(hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12, num_kv_heads=4, head_dim=64),
}
MAX_BLOCK = 16  # windows are sampled as if D were this large, so every run sees the same data
PLAN_POLL_EVERY = 25
SYNC_EVERY = 5
MAX_SKIPPED_IN_A_ROW = 3  # non-finite gradients in a row: the weights, not one batch, are broken


@dataclass(frozen=True)
class TrainConfig:
    data: str
    out: str
    preset: str = "base27m"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # the row layout
    seq_len: int = 512
    block_size: int = 8
    blocks: int = 40
    mtp_weight: float = 1.0
    # optimisation
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    max_steps: int = 2000  # 0: fit to --time-budget-s
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # running
    time_budget_s: float | None = None
    reserve_s: float = 25.0
    eval_every: int = 500
    eval_batches: int = 4
    log_every: int = 25
    save_every_s: float = 240.0
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"  # bf16 (autocast) | fp32 | auto: bf16 on CUDA
    compile: str = "auto"  # on | off | auto: on for CUDA
    resume: bool = False
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimiser state (tools.fsdp)
    stop_at: int | None = None  # pause after this step: save everything, continue later with --resume
    share_plan: str | None = None
    steps_from: str | None = None
    plan_wait_s: float = 60.0
    # Fitting the step count to the budget: the rate between the first two marks sets it, each
    # later mark re-fits at the rate since the previous one (concurrent runs settling).
    fit_marks: tuple[int, ...] = (10, 60, 300, 600, 1000)
    tau: float = 0.9
    min_prefix: int = 3
    # fine-tuning and self-distillation
    init: str | None = None
    distill: str | None = None
    distill_frac: float = 0.5
    distill_ntp: str = "none"  # none | prompt | all: NTP targets on the distill rows' clean stream
    kl_weight: float = 0.0
    slot_weights: tuple[float, ...] | None = None
    # NTP distillation: a frozen next-token teacher on the clean stream
    ntp_teacher: str | None = None
    ntp_kl_weight: float = 0.0
    # mask-row capacity: only it (and the per-slot input offset) trains; the base stays as loaded
    adapter_rank: int = 0  # low-rank 16-bit adapters on every projection
    twin_layers: int = 0  # or full-rank ternary twins of the last layers' projections
    twin_kv: bool = False  # the twins' draft rows read the history through their own keys and values

    @property
    def layout(self) -> BlockLayout:
        k = self.blocks if self.mtp_weight > 0 else 0
        return BlockLayout(self.seq_len, self.block_size if k else 0, k)


def check_config(tc: TrainConfig) -> None:
    """Refuse values no run can use, naming the flag, before anything is read or written
    (a bad --eval-batches would otherwise fail only after the last step, unsaved)."""
    def need(ok: bool, flag: str, value, what: str) -> None:
        if not ok:
            raise ValueError(f"{flag} {value}: {what}")

    def finite(x) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    if tc.preset not in PRESETS:
        raise ValueError(f"--preset {tc.preset!r}: choose one of {', '.join(PRESETS)}")
    need(tc.seq_len >= 2, "--seq-len", tc.seq_len, "a row needs at least 2 clean tokens")
    need(tc.blocks >= 0, "--blocks", tc.blocks, "give 0 or more mask blocks per row")
    need(finite(tc.mtp_weight) and tc.mtp_weight >= 0, "--mtp-weight", tc.mtp_weight,
         "must be >= 0 (0: the SFT baseline, no blocks)")
    has_blocks = tc.blocks > 0 and tc.mtp_weight > 0  # tc.layout's rule
    need(tc.blocks > 0 or tc.mtp_weight == 0, "--blocks", tc.blocks, f"no mask blocks for --mtp-weight {tc.mtp_weight} "
         "to train: give --blocks N, or --mtp-weight 0 for the SFT (AR-only) baseline")
    if has_blocks:
        need(2 <= tc.block_size <= MAX_BLOCK, "--block-size", tc.block_size, f"D must be in 2..{MAX_BLOCK}")
        need(tc.blocks <= tc.seq_len, "--blocks", tc.blocks,
             f"each block needs its own anchor among the {tc.seq_len} clean tokens (--seq-len)")
        need(finite(tc.tau) and 0 < tc.tau <= 1, "--tau", tc.tau, "must be in (0, 1]")
        need(1 <= tc.min_prefix <= tc.block_size, "--min-prefix", tc.min_prefix,
             f"hybrid's shortest unverified commit must be in 1..{tc.block_size} (--block-size {tc.block_size})")
    for flag, v in (("--batch-size", tc.batch_size), ("--eval-batches", tc.eval_batches),
                    ("--log-every", tc.log_every)):
        need(v >= 1, flag, v, "must be 1 or more")
    for flag, v in (("--max-steps", tc.max_steps), ("--warmup-steps", tc.warmup_steps),
                    ("--eval-every", tc.eval_every)):
        need(v >= 0, flag, v, "must be 0 or more")
    need(finite(tc.lr) and tc.lr > 0, "--lr", tc.lr, "the learning rate must be > 0")
    need(finite(tc.grad_clip) and tc.grad_clip > 0, "--grad-clip", tc.grad_clip,
         "the gradient-norm clip must be > 0 (0 would zero every gradient)")
    need(finite(tc.weight_decay) and tc.weight_decay >= 0, "--weight-decay", tc.weight_decay, "must be >= 0")
    need(finite(tc.kl_weight) and tc.kl_weight >= 0, "--kl-weight", tc.kl_weight, "must be >= 0")
    need(not tc.kl_weight or has_blocks, "--kl-weight", tc.kl_weight, "a term of the block slots' loss: it needs "
         "--mtp-weight > 0 and --blocks > 0")
    need(finite(tc.distill_frac) and 0 <= tc.distill_frac <= 1, "--distill-frac", tc.distill_frac,
         "the share of each batch from --distill must be in [0, 1]")
    if tc.time_budget_s is not None:
        need(finite(tc.time_budget_s) and tc.time_budget_s >= 0, "--time-budget-s", tc.time_budget_s,
             "give a budget in seconds > 0 (0: none)")
    if tc.stop_at is not None:
        need(tc.stop_at >= 0, "--stop-at", tc.stop_at, "must be a step >= 0")
    for flag, v in (("--adapter-rank", tc.adapter_rank), ("--twin-layers", tc.twin_layers)):
        need(v >= 0, flag, v, "must be 0 (none) or more")
    if tc.twin_kv and not tc.twin_layers:
        raise ValueError("--twin-kv gives twins their own keys and values of the history: add --twin-layers N")
    if tc.slot_weights is not None:
        sw = ",".join(f"{w:g}" for w in tc.slot_weights)
        need(has_blocks, "--slot-weights", sw, "weights the MTP term: it needs --mtp-weight > 0 "
             "and --blocks > 0")
        need(len(tc.slot_weights) == tc.block_size, "--slot-weights", sw,
             f"{len(tc.slot_weights)} values; give one per slot (D = {tc.block_size}, --block-size)")
        need(all(finite(w) and w >= 0 for w in tc.slot_weights) and any(w > 0 for w in tc.slot_weights),
             "--slot-weights", sw, "every weight must be a finite number >= 0, and one at least > 0")


def model_config(tc: TrainConfig, index: CorpusIndex) -> ModelConfig:
    if tc.preset not in PRESETS:
        raise ValueError(f"unknown preset {tc.preset!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(family="bitnet", vocab_size=index.vocab_size, **PRESETS[tc.preset],
                       rope_theta=tc.rope_theta, max_position_embeddings=tc.max_position_embeddings,
                       tie_word_embeddings=True, eos_token_ids=(index.eos_token_id,))


def lr_at(step: int, tc: TrainConfig, max_steps: int) -> float:
    """Linear warm-up, then cosine from ``lr`` down to ``lr * min_lr_ratio`` at ``max_steps``.
    ``max_steps`` 0 (a budget-fitted run before its first fit) holds ``lr``: the schedule's end
    is not known yet, and reading it as reached would run those steps at the floor."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    if max_steps <= 0:
        return tc.lr
    span = max(max_steps - tc.warmup_steps, 1)
    t = min((step - tc.warmup_steps) / span, 1.0)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


class LogitsModel(torch.nn.Module):
    """The model and its head as one module: what DistributedDataParallel wraps.
    ``adapter_from``: the first block row of a training row (its clean length), where the
    mask-row adapters or twins apply (None: a model without them)."""

    def __init__(self, model: TernaryLM, adapter_from: int | None = None):
        super().__init__()
        self.model, self.adapter_from = model, adapter_from

    def forward(self, ids, pos, mask):
        return self.model.verify_logits(self.model(ids, pos, mask, adapter_from=self.adapter_from))  # [B, S, V] float32


def joint_loss(logits_fn, ids, pos, mask, tgt, clean_len: int, mtp_weight: float, block_size: int = 0,
               anchors=None, slot_weights=None, kl_weight: float = 0.0, ntp_teacher=None, ntp_kl_weight: float = 0.0):
    """(loss, ntp, mtp, kl, ntp_kl): the NTP term over the clean rows + mtp_weight × (CE over the
    block rows, weighted per slot + kl_weight × KL(clean stream at the predicted position ‖ block slot)).

    The NTP term is the CE ``ntp``; with ``ntp_teacher`` (a teacher's clean-stream logits
    [B, clean_len, V]) it is ``(1 - ntp_kl_weight) × ntp + ntp_kl_weight × ntp_kl``, where
    ``ntp_kl`` is KL(teacher ‖ student) averaged over the positions the CE scores."""
    logits = logits_fn(ids, pos, mask)
    v = logits.shape[-1]
    clean, clean_tgt = logits[:, :clean_len], tgt[:, :clean_len]
    ntp = F.cross_entropy(clean.reshape(-1, v), clean_tgt.reshape(-1), ignore_index=IGNORE)
    zero = torch.zeros_like(ntp)
    ntp_term, ntp_kl = ntp, zero
    if ntp_teacher is not None and ntp_kl_weight > 0:
        scored = (clean_tgt != IGNORE).float()
        kl_tok = F.kl_div(F.log_softmax(clean, -1), F.log_softmax(ntp_teacher.float(), -1), log_target=True,
                          reduction="none").sum(-1)
        ntp_kl = (kl_tok * scored).sum() / scored.sum().clamp(min=1e-6)
        ntp_term = (1 - ntp_kl_weight) * ntp + ntp_kl_weight * ntp_kl
    if logits.shape[1] == clean_len:
        return ntp_term, ntp, zero, zero, ntp_kl
    blk, bt = logits[:, clean_len:], tgt[:, clean_len:]
    ce = F.cross_entropy(blk.reshape(-1, v), bt.reshape(-1), ignore_index=IGNORE, reduction="none").view(bt.shape)
    valid = (bt != IGNORE).float()
    w = valid if slot_weights is None else valid * slot_weights.repeat(bt.shape[1] // block_size)
    mtp = (ce * w).sum() / w.sum().clamp(min=1e-6)
    kl = zero
    if kl_weight > 0:
        # Slot j of the block anchored at p drafts x_{p+j+1}: the clean row p + j predicts the
        # same token with the whole true prefix — the verifier's distribution for that draft.
        b, k = anchors.shape
        at = (anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)).view(b, k * block_size)
        has_teacher = (at < clean_len) & (bt != IGNORE)
        teacher = logits[:, :clean_len].detach().gather(1, at.clamp(max=clean_len - 1).unsqueeze(-1).expand(-1, -1, v))
        kl_tok = F.kl_div(F.log_softmax(blk, -1), F.log_softmax(teacher, -1), log_target=True,
                          reduction="none").sum(-1)
        wk = has_teacher.float() if slot_weights is None else has_teacher.float() * slot_weights.repeat(k)
        kl = (kl_tok * wk).sum() / wk.sum().clamp(min=1e-6)
    return ntp_term + mtp_weight * (mtp + kl_weight * kl), ntp, mtp, kl, ntp_kl


class Batches:
    """Random windows of the training split, sampled on the device.

    Offsets come from a CPU generator seeded by ``seed`` and bounded as if D were
    ``MAX_BLOCK``, so runs that differ only in D or in the MTP term see the same windows;
    anchors come from a second generator.
    """

    def __init__(self, tokens: np.ndarray, layout: BlockLayout, batch: int, seed: int, device, mask_id: int, eos_id: int):
        self.tokens = torch.from_numpy(tokens.astype(np.int32)).to(device)
        self.layout, self.batch, self.device = layout, batch, device
        self.mask_id, self.eos_id = mask_id, eos_id
        self.high = self.tokens.numel() - layout.clean_len - MAX_BLOCK - 1
        if self.high <= 0:
            raise ValueError(f"the split has {self.tokens.numel()} tokens, too few for {layout.clean_len}-token rows; "
                             "give a shorter --seq-len or a larger corpus")
        self.g_data = torch.Generator().manual_seed(seed)
        self.g_anchor = torch.Generator().manual_seed(seed + 1)
        self._span = torch.arange(layout.window, device=device)

    def rows(self, offsets: torch.Tensor, anchors: torch.Tensor):
        """offsets [B], anchors [B, K] -> (input_ids, positions, mask, targets, anchors), the loss's argument order."""
        window = self.tokens[offsets.to(self.device).unsqueeze(1) + self._span].long()
        anchors = anchors.to(self.device)
        ids, pos, tgt, mask = build_rows(window, anchors, self.layout, self.mask_id, self.eos_id)
        if not self.layout.has_blocks:
            mask = clean_mask(self.layout.clean_len, self.device)  # one [1, L, L] mask broadcasts
        return ids, pos, mask, tgt, anchors

    def next(self, n: int | None = None):
        n = self.batch if n is None else n
        offsets = torch.randint(0, self.high, (n,), generator=self.g_data)
        anchors = sample_anchors(self.layout, n, self.g_anchor)
        return self.rows(offsets, anchors)

    def state(self) -> dict:
        return {"g_data": self.g_data.get_state(), "g_anchor": self.g_anchor.get_state()}

    def load_state(self, s: dict) -> None:
        self.g_data.set_state(s["g_data"])
        self.g_anchor.set_state(s["g_anchor"])


DISTILL_NTP = ("none", "prompt", "all")


class DistillRows:
    """Rows of a teacher's own greedy continuations (``tools.distill``): prompt_len corpus
    tokens then generated ones. Blocks are anchored in the generated part only, so every
    block target is a teacher greedy token. The clean stream's NTP targets follow ``ntp``:
    none, the prompt's (corpus text: clean positions 0 .. P - 2 predict x_1 .. x_{P-1}), or all."""

    def __init__(self, folder: str, layout: BlockLayout, seed: int, device, mask_id: int, eos_id: int,
                 ntp: str = "none", vocab_size: int | None = None):
        from tools.distill import load_rows

        if ntp not in DISTILL_NTP:
            raise ValueError(f"--distill-ntp {ntp!r}: choose one of {', '.join(DISTILL_NTP)}")
        self.ntp = ntp
        rows, meta = load_rows(folder)
        self.prompt_len = int(meta["prompt_len"])
        L, K = layout.clean_len, layout.num_blocks
        if not layout.has_blocks:
            raise ValueError("--distill trains the mask blocks; it needs the MTP term (--mtp-weight > 0)")
        if rows.shape[1] < layout.window:
            raise ValueError(f"{folder}: rows hold {rows.shape[1]} tokens, the layout needs {layout.window}; "
                             f"regenerate with tools.distill --seq-len {L} or train with a shorter --seq-len")
        if K > L - self.prompt_len + 1:
            raise ValueError(f"{folder}: {K} blocks per row need {K} anchors in the {L - self.prompt_len + 1} "
                             f"generated positions; use fewer --blocks or shorter prompts")
        if vocab_size is not None and rows.size and int(rows.max()) >= vocab_size:
            raise ValueError(f"{folder}: the rows hold token id {int(rows.max())}, the model's vocabulary has "
                             f"{vocab_size}; generate them with a teacher of the corpus' tokenizer (tools.distill "
                             "--data this corpus)")
        self.rows = torch.from_numpy(rows[:, :layout.window].astype(np.int32)).to(device)
        self.layout, self.device, self.mask_id, self.eos_id = layout, device, mask_id, eos_id
        self.meta = meta
        self.g = torch.Generator().manual_seed(seed + 2)

    def next(self, n: int):
        L, K = self.layout.clean_len, self.layout.num_blocks
        idx = torch.randint(0, self.rows.shape[0], (n,), generator=self.g)
        keys = torch.rand(n, L, generator=self.g)
        keys[:, : self.prompt_len - 1] = -1.0  # anchor p >= P - 1: targets x_{p+1}.. are all generated
        anchors = keys.topk(K, dim=1).indices.sort(dim=1).values.to(self.device)
        window = self.rows[idx.to(self.device)].long()
        ids, pos, tgt, mask = build_rows(window, anchors, self.layout, self.mask_id, self.eos_id)
        if self.ntp == "none":
            tgt[:, :L] = IGNORE  # NTP stays on the corpus rows
        elif self.ntp == "prompt":
            tgt[:, self.prompt_len - 1:L] = IGNORE  # the last prompt position predicts a generated token
        return ids, pos, mask, tgt, anchors

    def state(self) -> dict:
        return {"g": self.g.get_state()}

    def load_state(self, s: dict) -> None:
        self.g.set_state(s["g"])


def fixed_val_rows(tokens: np.ndarray, layout: BlockLayout, n_rows: int, seed: int):
    """Evenly spaced validation windows and anchors (the same for every eval and run)."""
    high = len(tokens) - layout.clean_len - MAX_BLOCK - 1
    if high <= 0:
        raise ValueError(f"the val split has {len(tokens)} tokens, too few for {layout.clean_len}-token rows; "
                         "give a shorter --seq-len or a larger corpus")
    offsets = torch.linspace(0, high - 1, n_rows).long()
    anchors = sample_anchors(layout, n_rows, torch.Generator().manual_seed(seed + 12345))
    return offsets, anchors


@torch.no_grad()
def evaluate(model, val: Batches, offsets, anchors, tc: TrainConfig, autocast, logits_fn=None) -> dict:
    """Validation NTP / MTP loss and per-slot top-1 accuracy of the blocks (eager). ``logits_fn``
    (ids, pos, mask) -> logits: the model's forward and head when not given."""
    if logits_fn is None:
        def logits_fn(ids, pos, mask):
            return model.verify_logits(model(ids, pos, mask, adapter_from=val.layout.clean_len))
    model.eval()
    layout = val.layout
    ntp_sum = mtp_sum = 0.0
    n_ntp = n_mtp = 0
    slot_hits = torch.zeros(max(layout.block_size, 1), dtype=torch.float64)
    slot_n = torch.zeros_like(slot_hits)
    for i in range(0, len(offsets), tc.batch_size):
        ids, pos, mask, tgt, _ = val.rows(offsets[i:i + tc.batch_size], anchors[i:i + tc.batch_size])
        with autocast():
            logits = logits_fn(ids, pos, mask)
        L, v = layout.clean_len, logits.shape[-1]
        ntp_sum += float(F.cross_entropy(logits[:, :L].reshape(-1, v), tgt[:, :L].reshape(-1), reduction="sum"))
        n_ntp += tgt[:, :L].numel()
        if layout.has_blocks:
            bt = tgt[:, L:]
            mtp_sum += float(F.cross_entropy(logits[:, L:].reshape(-1, v), bt.reshape(-1), ignore_index=IGNORE,
                                             reduction="sum"))
            n_mtp += int((bt != IGNORE).sum())
            hit = (logits[:, L:].argmax(-1) == bt).view(bt.shape[0], layout.num_blocks, layout.block_size)
            valid = (bt != IGNORE).view_as(hit)
            slot_hits += hit.sum((0, 1)).double().cpu()
            slot_n += valid.sum((0, 1)).double().cpu()
    model.train()
    out = {"val_ntp": ntp_sum / n_ntp}
    if layout.has_blocks:
        out["val_mtp"] = mtp_sum / max(n_mtp, 1)
        out["val_slot_acc"] = [round(float(a), 4) for a in (slot_hits / slot_n.clamp(min=1))]
    return out


# --resume: what must match the run it continues (Trainer._run_identity)
RESUME_SAME = ("seq_len", "block_size", "blocks", "mtp_weight", "kl_weight", "slot_weights", "distill_frac",
               "distill_ntp", "ntp_kl_weight", "adapter_rank", "twin_layers", "twin_kv", "tau", "min_prefix",
               "rope_theta", "max_position_embeddings")
RESUME_SAME_PATHS = ("init", "distill", "ntp_teacher")
MODEL_SHAPE = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim")
FSDP_OPTIMIZER_FORM = "fsdp-full"  # resume.pt's optimizer_form under --fsdp (tools.fsdp.full_optimizer_state)
RESUME_STEP = "resume_step"  # latest/model.safetensors metadata: the step its weights are


def _show_identity(d: dict, other: dict, keys: list[str]) -> str:
    """The ``keys`` of a run identity as flags and values (the model: its differing dimensions)."""
    out = []
    for k in keys:
        v = d.get(k)
        if k == "model" and isinstance(v, dict):
            o = other.get(k) or {}
            dims = ", ".join(f"{n} {v.get(n)}" for n in v if v.get(n) != o.get(n))
            out.append(f"the model (--preset / --init) {dims}")
        elif k == "corpus_sha256":
            out.append(f"the corpus (--data) of sha256 {str(v)[:12]}")
        else:
            out.append(f"--{k.replace('_', '-')} {v}")
    return ", ".join(out)


def _latest_step(folder: Path) -> int | None:
    """The step OUT/latest was saved at (None: missing, or saved before the stamp existed)."""
    from safetensors import safe_open

    p = folder / "model.safetensors"
    if not p.is_file():
        return None
    try:
        with safe_open(str(p), "pt") as f:
            step = (f.metadata() or {}).get(RESUME_STEP)
    except Exception:  # unreadable: load_latent_model names the file
        return None
    return int(step) if step is not None and step.isdigit() else None


# A folder with resume.pt holds a run worth keeping (every save and every finished run write
# it); one with only train_log.json was cut before its first save and may be started over.
RUN_FILES = ("resume.pt",)


def _out_folder(out: str, resume: bool, data: str | None = None, init: str | None = None) -> Path:
    """--out as a folder path, refused when it (or a parent) is a file, or when it holds a run
    and this is not --resume (its first save would overwrite that run's checkpoints); created later."""
    path = Path(out)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise ValueError(f"--out {out}: {p} is a file; give a folder for the run's checkpoints and train_log.json")
    for flag, given in (("--data", data), ("--init", init)):
        if given and path.resolve() == Path(given).resolve():  # saves would write into the inputs
            raise ValueError(f"--out {out} is the {flag} folder; give the run a folder of its own")
    held = [name for name in RUN_FILES if (path / name).is_file()]
    if held and not resume:
        raise ValueError(f"--out {out}: holds a training run ({held[0]}); continue it with --resume, or give "
                         "another --out (or remove that run) to start a new one")
    return path


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf: the run stopped without writing its final checkpoints."""


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


class PlanFile:
    """The step count one run fits to its budget and others adopt (``--share-plan`` / ``--steps-from``)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.version = -1

    def write(self, max_steps: int, version: int, info: dict) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"max_steps": max_steps, "version": version, **info}))
        os.replace(tmp, self.path)

    def read(self) -> int | None:
        """The step count if the file has a newer version than last read, else None."""
        if self.path is None or not self.path.is_file():
            return None
        try:
            d = json.loads(self.path.read_text())
        except (json.JSONDecodeError, OSError):
            return None
        if d["version"] <= self.version:
            return None
        self.version = d["version"]
        return int(d["max_steps"])


class Dist:
    """Where this process stands under ``torchrun`` (world 1 without it).

    Nothing here but torch.distributed's own initialisation from the torchrun environment
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``): NCCL on CUDA, gloo on CPU."""

    def __init__(self, device_spec: str):
        import torch.distributed as dist

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = _device(device_spec)
        if self.world > 1 and device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def agree(self, values: list[int]) -> list[int]:
        """Element-wise max over ranks: rank 0's step plan, anyone's stop or save request."""
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(x) for x in t.tolist()]

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class Trainer:
    def __init__(self, tc: TrainConfig, log=print):
        check_config(tc)
        self.out = _out_folder(tc.out, tc.resume, tc.data, tc.init)
        self.dist = Dist(tc.device)
        self.tc, self.log = tc, (log if self.dist.main else (lambda m: None))
        self.t_start = time.perf_counter()
        self.deadline = self.t_start + tc.time_budget_s if tc.time_budget_s else None
        if tc.max_steps == 0 and not tc.time_budget_s and not tc.steps_from:
            raise ValueError("--max-steps 0 fits the run to --time-budget-s; give a budget (or a step count)")
        if tc.fsdp and self.dist.world == 1:
            raise ValueError("--fsdp shards the model over the processes torchrun starts: run it under "
                             "torchrun --nproc-per-node N (N >= 2), or drop --fsdp")
        if tc.batch_size % self.dist.world:
            raise ValueError(f"--batch-size {tc.batch_size} (the global batch) is not a multiple of the "
                             f"{self.dist.world} processes")
        self.device = self.dist.device
        torch.manual_seed(tc.seed)
        self.index = CorpusIndex.load(tc.data)
        self.init_info = None
        self.mask_rows_only = bool(tc.adapter_rank or tc.twin_layers)
        if tc.init:
            from tools.init_checkpoint import load_for_training

            self.model, self.init_info = load_for_training(tc.init, self.index.mask_token_id,
                                                           Path(tc.data) / self.index.tokenizer,
                                                           keep_mask_row=self.mask_rows_only)
            self.cfg = self.model.cfg
            self.log(f"initialised from {tc.init} ({self.init_info.format}, {self.init_info.family}; "
                     f"mask row {self.init_info.mask_row})")
        else:
            self.cfg = model_config(tc, self.index)
            self.model = TernaryLM(self.cfg, quant_config(self.cfg), linear_cls=LatentTernaryLinear)
            # nn.Embedding starts at N(0, 1); with a tied head that means logits of std ~sqrt(H).
            torch.nn.init.normal_(self.model.model.embed_tokens.weight, std=0.02)
        if tc.seq_len > self.cfg.max_position_embeddings:  # RoPE would train positions the config disowns
            where = f"--init {tc.init}'s config.json" if tc.init else "the preset"
            raise ValueError(f"--seq-len {tc.seq_len}: the model has {self.cfg.max_position_embeddings} positions "
                             f"(max_position_embeddings of {where}); give --seq-len "
                             f"{self.cfg.max_position_embeddings} or less")
        self.mtp = (MTPConfig(tc.block_size, self.index.mask_token_id, tc.tau, tc.min_prefix,
                              adapter_rank=tc.adapter_rank, twin_layers=tc.twin_layers, twin_kv=tc.twin_kv)
                    if tc.layout.has_blocks else None)
        if self.mask_rows_only:
            self._mask_rows_only()
        bf16 = tc.precision == "bf16" or (tc.precision == "auto" and self.device.type == "cuda")
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 \
            else contextlib.nullcontext
        self.precision = "bf16" if bf16 else "fp32"
        layout = tc.layout
        ids = (self.index.mask_token_id, self.index.eos_token_id)
        self.local_batch = tc.batch_size // self.dist.world
        self.n_distill = round(self.local_batch * tc.distill_frac) if tc.distill else 0
        if self.n_distill >= self.local_batch and tc.distill_ntp == "none":
            raise ValueError(f"--distill-frac {tc.distill_frac}: all {self.local_batch} rows of a batch would be "
                             "--distill rows, which carry no NTP targets with --distill-ntp none; lower it or "
                             "give --distill-ntp prompt")
        seed = tc.seed + 1000 * self.dist.rank  # each rank its own windows
        self.train_data = Batches(load_split(tc.data, "train"), layout, self.local_batch - self.n_distill, seed,
                                  self.device, *ids)
        self.distill_data = (DistillRows(tc.distill, layout, seed, self.device, *ids, ntp=tc.distill_ntp,
                                         vocab_size=self.cfg.vocab_size) if tc.distill else None)
        self.val_data = Batches(load_split(tc.data, "val"), layout, tc.batch_size, tc.seed, self.device, *ids)
        self.val_offsets, self.val_anchors = fixed_val_rows(load_split(tc.data, "val"), layout,
                                                            tc.eval_batches * tc.batch_size, tc.seed)
        self.slot_weights = (torch.tensor(tc.slot_weights, dtype=torch.float32, device=self.device)
                             if tc.slot_weights is not None else None)
        self.ntp_teacher, self.ntp_teacher_info = self._load_ntp_teacher()
        self.step = 0
        self.max_steps = tc.max_steps
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.events: list[str] = []
        self.skipped_steps = self.skipped_in_a_row = 0  # updates left out for a non-finite gradient
        self.first_bad_step = 0
        self.compiled = None
        self.plan_out = PlanFile(tc.share_plan if self.dist.main else None)
        self.plan_in = PlanFile(tc.steps_from if self.dist.main else None)
        self.elapsed_before = 0.0
        # --resume: the weights go into the model before it is placed (sharded, it holds no whole tensor)
        resumed_optimizer = self._resume() if tc.resume else None
        self.model.train()
        self.logits_model = LogitsModel(self.model, tc.layout.clean_len if self.mask_rows_only else None)
        self.shell = None  # --fsdp: what rank 0 writes checkpoints through (tools.fsdp.meta_shell)
        if tc.fsdp:
            from tools import fsdp

            self.shell = fsdp.meta_shell(self.model) if self.dist.main else None
            fsdp.shard(self.logits_model, self.model.model.layers, self.device)
        else:
            self.model.to(self.device)
            if self.dist.world > 1:
                from torch.nn.parallel import DistributedDataParallel as DDP

                # Broadcasts rank 0's weights; gradients are averaged over ranks in backward.
                self.logits_model = DDP(self.logits_model, device_ids=[self.device.index]
                                        if self.device.type == "cuda" else None)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in trained if p.dim() >= 2 and p is not self.model.mask_slot_embedding]
        no_decay = [p for p in trained if p.dim() < 2 or p is self.model.mask_slot_embedding]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=self.device.type == "cuda" and not tc.fsdp)
        if resumed_optimizer is not None:
            self._load_optimizer(resumed_optimizer)
        self.out.mkdir(parents=True, exist_ok=True)  # only once every input checked out

    def _mask_rows_only(self) -> None:
        """Mask-row adapters or twins on the loaded model, and nothing else trained: the clean
        stream (the verifier, and the NTP loss) stays the source model bit for bit, whatever the
        steps do."""
        tc = self.tc
        flag = "--adapter-rank" if tc.adapter_rank else "--twin-layers"
        if not tc.init or not tc.layout.has_blocks:
            raise ValueError(f"{flag} trains mask-row capacity on an existing model: give --init CKPT "
                             "and keep the MTP term (--mtp-weight > 0)")
        if tc.ntp_teacher:
            raise ValueError(f"{flag} keeps the clean stream fixed: --ntp-teacher would have nothing to train")
        if self.init_info.mask_row != "kept":  # the checkpoint's vocabulary had no mask token
            self.log("note: the mask token is new to this checkpoint: its (mean) embedding row is one more logit "
                       "in every softmax, so the clean stream equals the source's up to that row")
        self.model.requires_grad_(False)
        self.model.attach_mask_rows(tc.adapter_rank, tc.twin_layers, tc.block_size, tc.twin_kv)
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        what = (f"mask-row adapters of rank {tc.adapter_rank}" if tc.adapter_rank
                else f"mask-row twins of the last {tc.twin_layers} layers"
                + (", reading the history through their own keys and values" if tc.twin_kv else ""))
        self.log(f"{what}: {trained:,} trained parameters, the rest frozen")

    def _load_ntp_teacher(self):
        """(frozen teacher as a LogitsModel, its InitInfo), or (None, None) without --ntp-teacher.
        Read like --init (safetensors and JSON, the tokenizer checked against the corpus')."""
        tc = self.tc
        if not 0.0 <= tc.ntp_kl_weight <= 1.0:
            raise ValueError(f"--ntp-kl-weight {tc.ntp_kl_weight}: the share of the NTP target taken from the "
                             "teacher must be in [0, 1]")
        if (tc.ntp_teacher is None) != (tc.ntp_kl_weight == 0):
            raise ValueError("--ntp-teacher and --ntp-kl-weight go together: give the teacher checkpoint and a "
                             "weight in (0, 1], or neither")
        if tc.ntp_teacher is None:
            return None, None
        from tools.distill import freeze
        from tools.init_checkpoint import load_for_training

        teacher, info = load_for_training(tc.ntp_teacher, self.index.mask_token_id,
                                          Path(tc.data) / self.index.tokenizer, flag="--ntp-teacher")
        if teacher.cfg.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"--ntp-teacher {tc.ntp_teacher}: vocabulary of {teacher.cfg.vocab_size} tokens, the "
                             f"student has {self.cfg.vocab_size}; distill from a model with the student's tokenizer")
        frozen = freeze(teacher.to(self.device)).requires_grad_(False)
        self.log(f"NTP teacher {tc.ntp_teacher} ({info.format}, {info.family}), KL weight {tc.ntp_kl_weight}")
        return LogitsModel(frozen), info

    def _ntp_teacher_logits(self, ids, pos, mask):
        """The teacher's logits on the clean stream [B, L, V]. The mask token is no next token
        (its row in a model trained without it is a stand-in): the teacher gives it no mass.
        A finite floor, not -inf, keeps KL's 0 · log 0 terms at 0."""
        L = self.tc.layout.clean_len
        with torch.no_grad():
            logits = self.ntp_teacher(ids[:, :L], pos[:, :L], mask[:, :L, :L])
            logits[..., self.index.mask_token_id] = -1e4
        return logits

    # -- bookkeeping ---------------------------------------------------------------------
    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _note(self, msg: str) -> None:
        self.events.append(f"step {self.step}: {msg}")
        self.log(msg)

    def _remaining(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()

    def _data_state(self) -> dict:
        s = {"corpus": self.train_data.state()}
        if self.distill_data is not None:
            s["distill"] = self.distill_data.state()
        return s

    def _run_identity(self) -> dict:
        """What a resumed run must share with the run it continues: the model, its data and its
        objective (``RESUME_SAME``); optimisation and running settings (--lr, --max-steps,
        --batch-size, --device, ...) may change. JSON-plain, so it compares after a round trip."""
        tc = self.tc
        d = {f: getattr(tc, f) for f in RESUME_SAME}
        for f in RESUME_SAME_PATHS:
            d[f] = str(Path(getattr(tc, f)).resolve()) if getattr(tc, f) else None
        d["corpus_sha256"] = self.index.corpus_sha256
        d["model"] = {k: v for k, v in self.cfg.to_dict().items() if k in MODEL_SHAPE}
        return json.loads(json.dumps(d))

    def _load_resume_state(self, path: Path) -> dict:
        """resume.pt as the trainer wrote it: tensors and plain containers only (``weights_only``)."""
        try:
            # on the CPU: the optimiser moves its state to its parameters' devices (or shards) as it loads
            s = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises RuntimeError / UnpicklingError / EOFError for a bad file
            raise ValueError(f"{path}: not a resume state tools.train wrote ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}); start the run again without --resume") from None
        if not isinstance(s, dict) or not {"optimizer", "data", "step"} <= set(s):
            raise ValueError(f"{path}: not a resume state tools.train wrote; start the run again without --resume")
        return s

    def _resume(self) -> dict:
        """The run folder's weights into the (not yet placed) model, its data generators and
        history into this trainer; -> the optimiser state, for ``_load_optimizer`` once the
        optimiser exists."""
        state_path = self.out / "resume.pt"
        if not state_path.is_file():
            raise FileNotFoundError(f"{state_path}: nothing to resume from; run without --resume first")
        s = self._load_resume_state(state_path)
        if "run" in s:  # runs saved before the identity was recorded resume unchecked
            saved, now = json.loads(s["run"]), self._run_identity()
            # A path may move (another machine, a copied run folder; the device's checkouts):
            # --init / --distill given or not must match, the folder itself need not.
            moved = [k for k in RESUME_SAME_PATHS if saved.get(k) and now[k] and saved[k] != now[k]]
            for k in moved:
                self._note(f"--{k.replace('_', '-')} is {now[k]}, the run had {saved[k]}: resuming with the "
                           "weights and state of the run folder")
            diff = [k for k in now if saved.get(k) != now[k] and k not in moved]
            if diff:
                raise ValueError(f"--resume {self.out}: the run was trained with {_show_identity(saved, now, diff)}; "
                                 f"this command gives {_show_identity(now, saved, diff)}. Resume with the run's "
                                 f"settings (train_log.json 'config'), or start a new run from its weights: "
                                 f"--init {self.out / 'latest'} --out NEW")
        latest = self.out / "latest"
        stamp = _latest_step(latest)
        if stamp is not None and stamp != s["step"]:
            # The save writes resume.pt.tmp, then latest/, then renames: an interruption between
            # the last two leaves latest/ one save ahead, and resume.pt.tmp holding its state.
            tmp = state_path.with_name(state_path.name + ".tmp")
            ahead = self._load_resume_state(tmp) if tmp.is_file() else None
            if ahead is None or ahead["step"] != stamp:
                raise ValueError(f"{latest} holds step {stamp} and {state_path} step {s['step']}: a save was "
                                 f"interrupted; start the run again without --resume, or from its weights: "
                                 f"--init {latest} --out NEW")
            s = ahead  # read, not renamed: every rank reads it; the next save writes a fresh pair
            self._note(f"resumed from {tmp.name}: the save of step {stamp} was interrupted before its rename")
        if not (latest / "config.json").is_file():
            raise FileNotFoundError(f"{latest}: missing or incomplete, so {state_path} has no weights to go with; "
                                    "start the run again without --resume")
        saved_sharded = s.get("optimizer_form") == FSDP_OPTIMIZER_FORM
        if saved_sharded != self.tc.fsdp:
            was = "with" if saved_sharded else "without"
            raise ValueError(f"{state_path}: the run was saved {was} --fsdp (its optimiser state has that form); "
                             f"resume it {was} --fsdp, or start a new run from its weights: --init {latest} --out NEW")
        model, _ = load_latent_model(latest)
        self.model.load_state_dict(model.state_dict())
        ranks = s["data"]
        if len(ranks) != self.dist.world:
            raise ValueError(f"{state_path}: saved by {len(ranks)} process(es), resumed with {self.dist.world}; "
                             "resume with the same --nproc-per-node")
        mine = ranks[self.dist.rank]
        self.train_data.load_state(mine["corpus"])
        if self.distill_data is not None:
            self.distill_data.load_state(mine["distill"])
        self.step, self.max_steps = s["step"], s["max_steps"] if self.tc.max_steps == 0 else self.tc.max_steps
        self.history, self.evals, self.elapsed_before = s["history"], s["evals"], s["elapsed_s"]
        self._note(f"resumed at step {self.step} of {self.max_steps}")
        return s["optimizer"]

    def _load_optimizer(self, state: dict) -> None:
        if self.tc.fsdp:
            from tools.fsdp import load_optimizer_state

            load_optimizer_state(self.model, self.opt, state)
        else:
            self.opt.load_state_dict(state)

    def _save_resume(self) -> None:
        """Collective under torchrun (every rank's data generators); rank 0 writes.
        resume.pt.tmp first, then latest/ (stamped with the step), then the rename: wherever it
        is interrupted, --resume finds a consistent pair, completes it from resume.pt.tmp, or
        refuses; it never pairs one save's weights with another's optimiser (``_resume``)."""
        data = self.dist.gather(self._data_state())
        model = self._whole_model()
        if self.tc.fsdp:
            from tools.fsdp import full_optimizer_state

            optimizer, form = full_optimizer_state(self.model, self.opt), FSDP_OPTIMIZER_FORM
        else:
            optimizer, form = (self.opt.state_dict() if self.dist.main else None), "torch"
        if not self.dist.main:
            return
        state = {"optimizer": optimizer, "optimizer_form": form, "data": data, "step": self.step,
                 "max_steps": self.max_steps, "history": self.history, "evals": self.evals,
                 "elapsed_s": self.elapsed_before + time.perf_counter() - self.t_start, "world": self.dist.world,
                 "run": json.dumps(self._run_identity())}
        torch.save(state, self.out / "resume.pt.tmp")
        save_latent(model, self.out / "latest", Path(self.tc.data), self.mtp, self.index.corpus_sha256,
                    metadata={RESUME_STEP: str(self.step)})
        os.replace(self.out / "resume.pt.tmp", self.out / "resume.pt")

    def _whole_model(self) -> TernaryLM | None:
        """The model with every tensor whole, for a checkpoint writer: the model itself, or under
        --fsdp rank 0's shell filled with the gathered tensors (a collective: every rank calls
        it; the others get None)."""
        if not self.tc.fsdp:
            return self.model
        from tools.fsdp import full_model_state

        state = full_model_state(self.model)
        if not self.dist.main:
            return None
        filled = copy.deepcopy(self.shell)  # meta tensors: no memory; the gathered ones go when the caller drops it
        filled.load_state_dict(state, assign=True)
        return filled

    def write_log(self, summary: dict | None = None) -> None:
        if not self.dist.main:
            return
        tc = self.tc
        d = {"config": asdict(tc), "model": self.cfg.to_dict(), "params": self.n_params,
             "layout": asdict(tc.layout), "seq_len_total": tc.layout.seq_len, "precision": self.precision,
             "compiled": bool(self.compiled), "device": str(self.device), "world_size": self.dist.world,
             "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
             "torch": torch.__version__, "corpus_sha256": self.index.corpus_sha256, "max_steps": self.max_steps,
             "init": asdict(self.init_info) if self.init_info else None,
             "ntp_teacher": asdict(self.ntp_teacher_info) if self.ntp_teacher_info else None,
             "distill": self.distill_data.meta if self.distill_data is not None else None,
             "history": self.history, "evals": self.evals, "events": self.events, "summary": summary}
        tmp = self.out / "train_log.json.tmp"
        tmp.write_text(json.dumps(d, indent=1, default=str) + "\n")
        os.replace(tmp, self.out / "train_log.json")

    # -- the step ------------------------------------------------------------------------
    def _next_batch(self):
        corpus = self.train_data.next()
        if self.distill_data is None or self.n_distill == 0:
            return corpus
        distill = self.distill_data.next(self.n_distill)
        return tuple(torch.cat([a, b]) for a, b in zip(corpus, distill))

    def _loss_fn(self, logits_model):
        tc, L = self.tc, self.tc.layout.clean_len

        def fn(ids, pos, mask, tgt, anchors):
            with self.autocast():
                teacher = None if self.ntp_teacher is None else self._ntp_teacher_logits(ids, pos, mask)
                return joint_loss(logits_model, ids, pos, mask, tgt, L, tc.mtp_weight, tc.layout.block_size,
                                  anchors, self.slot_weights, tc.kl_weight, teacher, tc.ntp_kl_weight)
        return fn

    def _want_compile(self) -> bool:
        return self.tc.compile == "on" or (self.tc.compile == "auto" and self.device.type == "cuda")

    def _train_step(self, fn, batch):
        """One optimiser step -> (loss, ntp, mtp, kl, ntp_kl, grad norm) as device tensors, and the lr."""
        lr = lr_at(self.step, self.tc, self.max_steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss, ntp, mtp, kl, ntp_kl = fn(*batch)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        if self.tc.fsdp:  # the norm over every rank's shards, the same on all: they skip a step together
            from tools.fsdp import whole

            gnorm = whole(gnorm)
        # A non-finite gradient would make every weight NaN in one update. One such batch is
        # skipped and counted (a 56M D = 8 run lost its weights at step 925 of 2,778 to one, with
        # the loss smooth before it); MAX_SKIPPED_IN_A_ROW of them in a row end the run as diverged.
        if bool(torch.isfinite(gnorm)):
            self.opt.step()
            self.skipped_in_a_row = 0
        else:
            if self.skipped_in_a_row == 0:
                self.first_bad_step = self.step + 1
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            self._note(f"step {self.step + 1}: gradient norm {float(gnorm)}; update skipped "
                       f"({self.skipped_steps} so far)")
        self.opt.zero_grad(set_to_none=True)
        return loss, ntp, mtp, kl, ntp_kl, gnorm, lr

    def _first_step(self, batch):
        """The first step, compiled if asked; any compile failure falls back to eager."""
        eager = self._loss_fn(self.logits_model)
        if self._want_compile():
            try:
                import torch._dynamo

                torch._dynamo.config.suppress_errors = True
                compiled = torch.compile(eager, dynamic=False)
                out = self._train_step(compiled, batch)
                torch.cuda.synchronize() if self.device.type == "cuda" else None
                self.compiled = compiled
                return out
            except Exception as e:  # inductor / triton / dynamo: never let compilation end a run
                self.opt.zero_grad(set_to_none=True)
                self._note(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                           "continuing eager")
        self.compiled = None
        return self._train_step(eager, batch)

    # -- the plan: how many steps fit ----------------------------------------------------
    def _fit_steps(self, t_from: float, s_from: int, version: int) -> None:
        rate = (self.step - s_from) / max(time.perf_counter() - t_from, 1e-6)
        left = self._remaining() - self.tc.reserve_s
        steps = self.step + int(0.93 * rate * max(left, 0.0))
        self.plan_steps = max(steps, self.step + 1)
        self.plan_out.write(self.plan_steps, version, {"rate_steps_s": rate, "at_step": self.step})
        self._note(f"fitted {self.plan_steps} steps to the budget ({rate:.2f} steps/s, v{version})")

    def _follow_plan(self, wait: bool) -> None:
        t0 = time.perf_counter()
        while True:
            steps = self.plan_in.read()
            if steps is not None:
                if steps != self.plan_steps:
                    self._note(f"adopted {steps} steps from {self.plan_in.path}")
                self.plan_steps = steps
                return
            if not wait or self.plan_in.version >= 0:
                return
            if time.perf_counter() - t0 > self.tc.plan_wait_s or self._remaining() < self.tc.reserve_s:
                self._note(f"no plan in {self.plan_in.path} after {self.tc.plan_wait_s:.0f}s; "
                           f"keeping {self.plan_steps or 'a budget-fitted'} steps")
                return
            time.sleep(0.5)

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            return self._run()
        finally:
            self.dist.close()

    def _run(self) -> dict:
        tc = self.tc
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        bar = tqdm(total=self.max_steps or None, initial=self.step, desc=self.out.name, dynamic_ncols=True,
                   mininterval=0.5 if tty else 20.0, disable=None if tty else not self.dist.main)
        fn = None
        marks: dict[int, float] = {}  # step -> time, for fitting the step count
        t_log, s_log = time.perf_counter(), self.step
        last_save = time.perf_counter()
        stop_reason = "max_steps"
        clean_per_step = tc.batch_size * tc.seq_len
        diverged = False
        self.plan_steps = self.max_steps
        # Under torchrun the ranks agree every SYNC_EVERY steps (a host sync); alone, every step.
        sync_every = 1 if self.dist.world == 1 else SYNC_EVERY
        while True:
            if self.plan_in.path is not None and (self.step % PLAN_POLL_EVERY == 0 or self.max_steps == 0):
                self._follow_plan(wait=self.step >= tc.warmup_steps and self.plan_in.version < 0)
            fm = tc.fit_marks
            if self.deadline is not None and tc.max_steps == 0 and self.step in marks and self.step in fm[1:]:
                if self.max_steps == 0 or (self.step != fm[1] and self.plan_in.path is None):
                    prev = max(s for s in marks if s < self.step)
                    if self.dist.main:
                        self._fit_steps(marks[prev], prev, fm.index(self.step))
            # Every rank takes the same decisions: rank 0's step plan and clock, anyone's divergence.
            want_save = out_of_time = False
            if self.step % sync_every == 0:
                want_save = time.perf_counter() - last_save > tc.save_every_s
                out_of_time = self._remaining() < tc.reserve_s
                plan, out_of_time, want_save, diverged = self.dist.agree(
                    [self.plan_steps if self.dist.main else 0, int(out_of_time), int(want_save), int(diverged)])
                self.max_steps = plan
            if bar.total != (self.max_steps or None):
                bar.total = self.max_steps or None
                bar.refresh()
            if diverged:
                stop_reason = "diverged"
                break
            if self.max_steps and self.step >= self.max_steps:
                break
            if tc.stop_at is not None and self.step >= tc.stop_at:
                stop_reason = "stop_at"
                break
            if out_of_time:
                stop_reason = "time_budget"
                self._note(f"time budget reached at step {self.step}; stopping and saving")
                break
            if want_save and self.step:
                self._save_resume()
                last_save = time.perf_counter()
            batch = self._next_batch()
            if fn is None:
                loss, ntp, mtp, kl, ntp_kl, gnorm, lr = self._first_step(batch)
                fn = self.compiled or self._loss_fn(self.logits_model)
            else:
                loss, ntp, mtp, kl, ntp_kl, gnorm, lr = self._train_step(fn, batch)
            self.step += 1
            bar.update(1)
            if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                diverged = True
            if self.step in tc.fit_marks:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                marks[self.step] = time.perf_counter()
            if self.step % tc.log_every == 0 or self.step == 1:
                loss_v, ntp_v, mtp_v, kl_v, nkl_v, g_v = (float(x.detach())
                                                          for x in (loss, ntp, mtp, kl, ntp_kl, gnorm))
                if not math.isfinite(loss_v) and self.skipped_in_a_row == 0:  # a loss with no gradient
                    diverged = True
                    self.first_bad_step = self.step
                    self._note(f"loss is {loss_v}; stopping")
                now = time.perf_counter()
                tok_s = (self.step - s_log) * clean_per_step / max(now - t_log, 1e-9)
                t_log, s_log = now, self.step
                self.history.append({"step": self.step, "loss": round(loss_v, 4), "ntp": round(ntp_v, 4),
                                     "mtp": round(mtp_v, 4), "kl": round(kl_v, 4), "ntp_kl": round(nkl_v, 4),
                                     "grad_norm": round(g_v, 3),
                                     "lr": lr, "clean_tok_s": round(tok_s), "elapsed_s": round(self._elapsed(), 1)})
                bar.set_postfix(loss=f"{loss_v:.3f}", ntp=f"{ntp_v:.3f}", mtp=f"{mtp_v:.3f}", tok_s=f"{tok_s / 1e3:.0f}k")
                self.write_log()
            if tc.eval_every and self.step % tc.eval_every == 0 and self._evaluates():
                self._eval()
        bar.close()
        if stop_reason == "diverged":
            self._diverged()
        self._save_resume()
        summary: dict = {}
        final = self._eval() if self._evaluates() else None
        model = self._whole_model()
        if self.dist.main:
            save_latent(model, self.out / "final", Path(tc.data), self.mtp, self.index.corpus_sha256)
            save_compact(model, self.out / "compact", Path(tc.data), self.mtp, self.index.corpus_sha256)
            summary = {"steps": self.step, "max_steps": self.max_steps, "stop_reason": stop_reason,
                       "clean_tokens": self.step * clean_per_step,
                       "block_tokens": self.step * tc.batch_size * (tc.layout.seq_len - tc.seq_len),
                       "distill_rows": self.step * self.n_distill * self.dist.world,
                       "wall_s": round(self._elapsed(), 1), "params": self.n_params, "world_size": self.dist.world,
                       "skipped_steps": self.skipped_steps,
                       "final_train": self.history[-1] if self.history else None, **final}
            self.write_log(summary)
            self.log(json.dumps({k: summary[k] for k in ("steps", "clean_tokens", "wall_s", "val_ntp", "stop_reason")}))
        return summary

    def _diverged(self) -> None:
        """A non-finite loss: the weights are no longer worth saving. The last periodic save
        (latest/ + resume.pt) stays as it was, no final/ or compact/ is written, and the run
        ends with an error: a NaN checkpoint written with exit status 0 would look trained."""
        last = _latest_step(self.out / "latest") if (self.out / "resume.pt").is_file() else None
        summary = {"steps": self.step, "max_steps": self.max_steps, "stop_reason": "diverged",
                   "wall_s": round(self._elapsed(), 1), "final_train": self.history[-1] if self.history else None}
        if self.dist.main:
            self.write_log(summary)
        keep = (f"the last good state is {self.out / 'latest'} (step {last}): --resume it with a lower --lr"
                if last is not None else "nothing was saved before it; start again with a lower --lr")
        raise TrainingDiverged(f"{self.out}: the loss became non-finite at step {self.first_bad_step or self.step}; "
                               f"no final/ or compact/ "
                               f"was written, and {keep} (or a larger --warmup-steps)")

    def _elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start

    def _evaluates(self) -> bool:
        """Rank 0 evaluates; under --fsdp every rank runs the (sharded) forward with it, on the same rows."""
        return self.dist.main or self.tc.fsdp

    def _eval(self) -> dict:
        logits = self.logits_model if self.tc.fsdp else None  # sharded: only the root's forward gathers
        r = evaluate(self.model, self.val_data, self.val_offsets, self.val_anchors, self.tc, self.autocast, logits)
        self.evals.append({"step": self.step, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}})
        self.log(f"[{self.out.name}] step {self.step}: " + ", ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        self.write_log()
        return r


def main(argv: list[str] | None = None) -> None:
    import click

    defaults = {f.name: f.default for f in fields(TrainConfig)}

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--data", required=True, help="corpus folder (python -m tools.corpus build)")
    @click.option("--out", required=True, help="run folder: checkpoints and train_log.json")
    @click.option("--preset", type=click.Choice(list(PRESETS)), default=defaults["preset"], show_default=True)
    @click.option("--seq-len", default=defaults["seq_len"], show_default=True, help="clean tokens per row")
    @click.option("--block-size", default=defaults["block_size"], show_default=True, help="D")
    @click.option("--blocks", default=defaults["blocks"], show_default=True, help="mask blocks per row")
    @click.option("--mtp-weight", default=defaults["mtp_weight"], show_default=True,
                  help="weight of the MTP term; 0 = the SFT baseline (no blocks)")
    @click.option("--batch-size", default=defaults["batch_size"], show_default=True)
    @click.option("--lr", default=defaults["lr"], show_default=True)
    @click.option("--warmup-steps", default=defaults["warmup_steps"], show_default=True)
    @click.option("--max-steps", default=defaults["max_steps"], show_default=True,
                  help="0 = as many as fit in --time-budget-s")
    @click.option("--weight-decay", default=defaults["weight_decay"], show_default=True)
    @click.option("--grad-clip", default=defaults["grad_clip"], show_default=True)
    @click.option("--time-budget-s", type=float, default=None, help="wall-clock budget: stop and save cleanly")
    @click.option("--eval-every", default=defaults["eval_every"], show_default=True)
    @click.option("--eval-batches", default=defaults["eval_batches"], show_default=True)
    @click.option("--log-every", default=defaults["log_every"], show_default=True)
    @click.option("--save-every-s", default=defaults["save_every_s"], show_default=True)
    @click.option("--seed", default=defaults["seed"], show_default=True)
    @click.option("--device", default=defaults["device"], show_default=True)
    @click.option("--precision", type=click.Choice(["auto", "bf16", "fp32"]), default="auto", show_default=True)
    @click.option("--compile", "compile_", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True)
    @click.option("--resume", is_flag=True, help="continue from OUT/latest + OUT/resume.pt")
    @click.option("--fsdp", is_flag=True, help="under torchrun: shard parameters, gradients and optimiser state "
                  "over the processes (FSDP2, one unit per layer), for a model that does not fit one GPU")
    @click.option("--stop-at", type=int, default=None, help="pause after this step (save; continue with --resume)")
    @click.option("--share-plan", default=None, help="with --max-steps 0: write the fitted step count here")
    @click.option("--steps-from", default=None, help="adopt the step count another run wrote (same steps)")
    @click.option("--tau", default=defaults["tau"], show_default=True, help="default τ written to bitmtp.json")
    @click.option("--min-prefix", default=defaults["min_prefix"], show_default=True, help="default m for bitmtp.json")
    @click.option("--init", default=None, type=click.Path(exists=True, file_okay=False),
                  help="start from this checkpoint (any form bitmtp-export reads; the corpus must use its tokenizer)")
    @click.option("--distill", default=None, type=click.Path(exists=True, file_okay=False),
                  help="folder of the teacher's greedy continuations (python -m tools.distill)")
    @click.option("--distill-frac", default=defaults["distill_frac"], show_default=True,
                  help="fraction of each batch taken from --distill rows")
    @click.option("--distill-ntp", type=click.Choice(DISTILL_NTP), default=defaults["distill_ntp"], show_default=True,
                  help="NTP targets on the distill rows' clean stream: none, the prompt's corpus tokens, or all")
    @click.option("--kl-weight", default=defaults["kl_weight"], show_default=True,
                  help="weight of KL(clean stream ‖ block slot) inside the MTP term")
    @click.option("--slot-weights", default=None, help="comma list of D per-slot MTP weights, e.g. 1,1,1,1,2,2,2,2")
    @click.option("--ntp-teacher", default=None, type=click.Path(exists=True, file_okay=False),
                  help="frozen next-token teacher on the clean stream (any form bitmtp-export reads, same tokenizer)")
    @click.option("--ntp-kl-weight", default=defaults["ntp_kl_weight"], show_default=True,
                  help="share of the NTP target from --ntp-teacher: (1 - w) CE + w KL(teacher ‖ student)")
    @click.option("--adapter-rank", default=defaults["adapter_rank"], show_default=True,
                  help="with --init: train only mask-row adapters of this rank (the clean stream stays the source's)")
    @click.option("--twin-layers", default=defaults["twin_layers"], show_default=True,
                  help="with --init: train only ternary twins of the last N layers' projections for the mask rows")
    @click.option("--twin-kv", is_flag=True, default=defaults["twin_kv"],
                  help="with --twin-layers: the mask rows read the history through the twins' own keys and values")
    def cli(compile_, slot_weights, **kw):
        """Train a ternary LM with the joint NTP + MTP objective (or the SFT baseline)."""
        try:
            sw = tuple(float(x) for x in slot_weights.split(",")) if slot_weights else None
        except ValueError:
            raise click.BadParameter(f"{slot_weights!r}: expected comma-separated numbers", param_hint="--slot-weights")
        tc = TrainConfig(compile=compile_, slot_weights=sw, **kw)
        try:  # what a user gave that cannot train: a message naming it, not a traceback
            trainer = Trainer(tc, log=lambda m: print(m, flush=True))
        except (ValueError, FileNotFoundError, CheckpointError) as e:
            raise click.ClickException(str(e)) from None
        try:
            trainer.run()
        except TrainingDiverged as e:
            raise click.ClickException(str(e)) from None

    cli.main(args=argv, prog_name="python -m tools.train", standalone_mode=True)


if __name__ == "__main__":
    main()
