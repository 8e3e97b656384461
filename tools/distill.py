"""Self-distillation data: a model's own greedy continuations of training-split prompts.

    python -m tools.distill --teacher tools/checkpoints/bitmtp-d8-27m --data runs/data --out runs/distill \
        --rows 8192 --prompt-len 128 --seq-len 512 --batch 512 --device cuda --shard 0

What decides whether a draft is accepted is agreement with the verifier's own greedy
continuation, not with corpus text; ``tools.train --distill`` trains the mask blocks on these
rows (Medusa-2 / EAGLE self-distillation, "Your LLM Knows the Future").

Generation is batched greedy decoding of the *training* model (``LatentTernaryLinear``
weights frozen to their ternary values once) with a static KV cache per layer — a simple
loop for the GPU, not the batch-1 runtime. ``greedy_reference`` recomputes every prefix
from scratch: the twin the cached loop is tested against.

Output: ``rows_{shard}.npy`` (uint16 [rows, seq_len + 16]: prompt_len corpus tokens, then
the continuation; 16 extra tokens so any block size up to 16 has all its targets) and
``distill_{shard}.json`` (teacher, prompt length, timing). ``load_rows`` reads a folder of them.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bitmtp_edge.runtime.model import LatentTernaryLinear, TernaryLM, project_rows
from kernels_ampere.numerics import (apply_rope, dequantize_ternary, quantize_activations, rope_cos_sin, ternarize_absmean,
                                     ternarize_group_absmax)

EXTRA_TOKENS = 16  # tools.train.MAX_BLOCK: rows serve any D


class FrozenTernaryLinear(nn.Module):
    """A ``LatentTernaryLinear`` with its weight quantised once (inference only), computing
    what it computes in the same float order: per-tensor W1.58A8 as the product of the two
    integer grids, then the activation scale, then the weight's; the other schemes as the
    dequantised weight times the (fake-quantised) input. The same order matters: an
    ``--ntp-teacher`` that is the student's own checkpoint must give the student's logits,
    and a reordered product can flip an int8 rounding downstream."""

    def __init__(self, src: LatentTernaryLinear):
        super().__init__()
        self.quant = src.quant
        w = src.weight.detach()
        self.integer_grid = src.quant.weights != "group128" and src.quant.quantize_activations
        if src.quant.weights == "group128":
            codes, scale = ternarize_group_absmax(w)
        else:
            codes, scale = ternarize_absmean(w)
        if self.integer_grid:
            self.register_buffer("codes", codes.to(w.dtype))
            self.register_buffer("scale", scale.to(w.dtype))
        else:
            self.register_buffer("weight", dequantize_ternary(codes, scale, torch.float32).to(w.dtype))
        self.adapter = src.adapter  # mask-row adapters, if any, as they are

    def forward(self, x, adapter_from=None):
        return project_rows(self, x, adapter_from)

    adapter_input = LatentTernaryLinear.adapter_input  # the same fake-quantised input

    def _project(self, x):
        if self.integer_grid:
            x_int, a_scale = quantize_activations(x)
            return F.linear(x_int.to(x.dtype), self.codes.to(x.dtype)) * a_scale.unsqueeze(-1) * self.scale
        return F.linear(self.adapter_input(x), self.weight)


def freeze(model: TernaryLM) -> TernaryLM:
    """A copy of the training model whose projections skip re-quantising the weights every call."""
    m = copy.deepcopy(model).eval()
    for name, mod in list(m.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, LatentTernaryLinear):
                setattr(mod, child_name, FrozenTernaryLinear(child))
    return m


def _forward_cached(model: TernaryLM, ids: torch.Tensor, start: int, cache: list) -> torch.Tensor:
    """ids [B, S] at positions start.. with the static cache -> last position's logits [B, V]."""
    cfg = model.cfg
    b, s = ids.shape
    pos = torch.arange(start, start + s, device=ids.device).expand(b, s)
    x = model.model.embed_tokens(ids)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
    end = start + s
    q_idx = torch.arange(start, end, device=ids.device).view(s, 1)
    mask = (torch.arange(end, device=ids.device).view(1, end) <= q_idx).view(1, 1, s, end)
    groups = cfg.num_heads // cfg.num_kv_heads
    for i, layer in enumerate(model.model.layers):
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = at.q_proj(h).view(b, s, cfg.num_heads, cfg.head_dim)
        k = at.k_proj(h).view(b, s, cfg.num_kv_heads, cfg.head_dim)
        v = at.v_proj(h).view(b, s, cfg.num_kv_heads, cfg.head_dim)
        if cfg.has_qk_norm:
            q, k = at.q_norm(q), at.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache[i] is None:
            total = cache[-1]
            cache[i] = (k.new_zeros(b, cfg.num_kv_heads, total, cfg.head_dim),
                        v.new_zeros(b, cfg.num_kv_heads, total, cfg.head_dim))
        kc, vc = cache[i]
        kc[:, :, start:end] = k.to(kc.dtype)
        vc[:, :, start:end] = v.to(vc.dtype)
        kk, vv = kc[:, :, :end].to(q.dtype), vc[:, :, :end].to(q.dtype)
        if s == 1:
            # One new token sees the whole cache: no mask, and the KV heads shared in place
            # (no copies), so the fused attention kernels apply.
            o = F.scaled_dot_product_attention(q, kk, vv, scale=1.0 / math.sqrt(cfg.head_dim), enable_gqa=groups > 1)
        else:
            if groups > 1:
                kk, vv = kk.repeat_interleave(groups, dim=1), vv.repeat_interleave(groups, dim=1)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=1.0 / math.sqrt(cfg.head_dim))
        o = o.transpose(1, 2).reshape(b, s, cfg.num_heads * cfg.head_dim)
        if cfg.has_sub_norms:
            o = at.attn_sub_norm(o)
        x = x + at.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.verify_logits(model.model.norm(x[:, -1]))


@torch.no_grad()
def greedy_continue(model: TernaryLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new_tokens]: batched greedy decoding with a static KV cache."""
    b, p = prompts.shape
    total = p + new_tokens
    out = torch.empty(b, total, dtype=torch.long, device=prompts.device)
    out[:, :p] = prompts
    cache: list = [None] * len(model.model.layers) + [total]
    nxt = _forward_cached(model, prompts, 0, cache).argmax(-1)
    for t in range(p, total):
        out[:, t] = nxt
        if t + 1 < total:
            nxt = _forward_cached(model, nxt.unsqueeze(1), t, cache).argmax(-1)
    return out


@torch.no_grad()
def greedy_reference(model: TernaryLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The same continuation, every step a full causal forward over the whole prefix (the twin)."""
    seq = prompts.clone()
    for _ in range(new_tokens):
        b, s = seq.shape
        mask = torch.ones(s, s, dtype=torch.bool, device=seq.device).tril().expand(b, s, s)
        pos = torch.arange(s, device=seq.device).expand(b, s)
        logits = model.verify_logits(model(seq, pos, mask)[:, -1])
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


def load_rows(folder: str | Path) -> tuple[np.ndarray, dict]:
    """All ``rows_*.npy`` of a folder and their (consistent) metadata."""
    folder = Path(folder)
    files = sorted(folder.glob("rows_*.npy"))
    if not files:
        raise FileNotFoundError(f"{folder}: no rows_*.npy; generate them with `python -m tools.distill --out {folder}`")
    metas = [json.loads(f.with_name(f.name.replace("rows_", "distill_").replace(".npy", ".json")).read_text())
             for f in files]
    for key in ("prompt_len", "teacher", "corpus_sha256"):
        if len({str(m[key]) for m in metas}) != 1:
            raise ValueError(f"{folder}: the shards disagree on {key}; keep one teacher's rows per folder")
    rows = np.concatenate([np.load(f, allow_pickle=False) for f in files])
    meta = {**metas[0], "rows": int(rows.shape[0]), "shards": len(files),
            "generate_s": round(sum(m["generate_s"] for m in metas), 1)}
    return rows, meta


def generate(teacher: str, data: str, out: str, rows: int, prompt_len: int, seq_len: int, batch: int,
             seed: int, shard: int, device: str, precision: str, log=print) -> dict:
    from tools.corpus import MAX_VOCAB, CorpusIndex, load_split
    from tools.init_checkpoint import load_for_training

    if not 1 <= prompt_len < seq_len:
        raise ValueError(f"--prompt-len {prompt_len} must be in 1..{seq_len - 1} (--seq-len)")
    for flag, v in (("--rows", rows), ("--batch", batch)):
        if v < 1:
            raise ValueError(f"{flag} {v}: must be 1 or more")
    if shard < 0:
        raise ValueError(f"--shard {shard}: must be 0 or more")
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out}: a file; give a folder for the rows")
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    index = CorpusIndex.load(data)
    tokens = load_split(data, "train")
    if len(tokens) <= prompt_len:
        raise ValueError(f"{data}: the train split has {len(tokens)} tokens, too few for --prompt-len {prompt_len}")
    model, info = load_for_training(teacher, index.mask_token_id, Path(data) / index.tokenizer, flag="--teacher")
    if model.cfg.vocab_size > MAX_VOCAB:  # its greedy tokens are stored as uint16
        raise ValueError(f"--teacher {teacher}: a vocabulary of {model.cfg.vocab_size} tokens; the rows store uint16 "
                         f"token ids, so at most {MAX_VOCAB}")
    model = freeze(model.to(dev))
    width = seq_len + EXTRA_TOKENS
    g = torch.Generator().manual_seed(seed + 7919 * shard)
    bf16 = precision == "bf16" or (precision == "auto" and dev.type == "cuda")
    ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else torch.autocast(dev.type, enabled=False)
    parts, t0 = [], time.perf_counter()
    for i in range(0, rows, batch):
        n = min(batch, rows - i)
        offsets = torch.randint(0, len(tokens) - prompt_len, (n,), generator=g).numpy()
        prompts = torch.from_numpy(np.stack([tokens[o:o + prompt_len] for o in offsets]).astype(np.int64)).to(dev)
        with ctx:
            parts.append(greedy_continue(model, prompts, width - prompt_len).cpu().numpy().astype(np.uint16))
        log(f"distill shard {shard}: {i + n}/{rows} rows ({time.perf_counter() - t0:.0f}s)")
    arr = np.concatenate(parts)
    secs = time.perf_counter() - t0
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rows_{shard:03d}.npy.tmp"
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    meta = {"teacher": str(teacher), "teacher_format": info.format, "prompt_len": prompt_len, "seq_len": seq_len,
            "width": width, "rows": int(arr.shape[0]), "seed": seed, "shard": shard, "precision": "bf16" if bf16 else "fp32",
            "corpus_sha256": index.corpus_sha256, "generate_s": round(secs, 1),
            "new_tokens_per_s": round(arr.shape[0] * (width - prompt_len) / max(secs, 1e-9)),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    (folder / f"distill_{shard:03d}.json").write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, folder / f"rows_{shard:03d}.npy")  # the rows last: a shard is complete when they exist
    return meta


def main(argv: list[str] | None = None) -> None:
    import click

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--teacher", required=True, type=click.Path(exists=True, file_okay=False),
                  help="checkpoint whose greedy continuations to record (any form bitmtp-export reads)")
    @click.option("--data", required=True, help="corpus folder (its train split gives the prompts)")
    @click.option("--out", required=True, help="output folder for rows_SHARD.npy + distill_SHARD.json")
    @click.option("--rows", default=4096, show_default=True)
    @click.option("--prompt-len", default=128, show_default=True, help="corpus tokens before the continuation")
    @click.option("--seq-len", default=512, show_default=True, help="the trainer's --seq-len (rows get 16 more)")
    @click.option("--batch", default=256, show_default=True)
    @click.option("--seed", default=0, show_default=True)
    @click.option("--shard", default=0, show_default=True, help="shard index (one per process / GPU)")
    @click.option("--device", default="auto", show_default=True)
    @click.option("--precision", type=click.Choice(["auto", "bf16", "fp32"]), default="auto", show_default=True)
    def cli(**kw):
        """Record a model's greedy continuations of training-split prompts."""
        try:
            meta = generate(**kw, log=lambda m: click.echo(m))
        except (ValueError, FileNotFoundError) as e:  # InitError is a ValueError
            raise click.ClickException(str(e)) from None
        click.echo(json.dumps(meta))

    cli.main(args=argv, prog_name="python -m tools.distill", standalone_mode=True)


if __name__ == "__main__":
    main()
