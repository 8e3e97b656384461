"""Speculative and hybrid decoding replayed from two batched passes per prompt (a fast proxy
for ``tools.eval_quality``'s decoding section, to compare training recipes).

    python -m tools.eval_acceptance --data tools/checkpoints/data --model d8=tools/checkpoints/bitmtp-d8-27m \
        --model d8sd=runs/d8sd/compact --prompts 40 --max-new-tokens 128 --json tools/results/acceptance.json

Greedy speculative decoding is lossless, so the text it commits is the AR greedy
continuation, and the draft block it runs at each iteration is the one anchored at the last
committed token with exactly that prefix. So per prompt:

1. the AR greedy continuation (``tools.distill.greedy_continue`` on the runtime model: exact
   integer projections, static KV cache);
2. one forward in the training layout (``tools.blocks``): the clean stream is prompt +
   continuation and a mask block hangs from *every* position a decode can anchor at; the
   int8 draft head gives each block's drafts and confidences, as the runtime's draft step does;
3. the policies replayed over those tables: speculative accepts the longest prefix of drafts
   equal to the continuation and commits one verifier token more; hybrid (τ, m) commits the
   confident prefix h unverified when h >= m (counted as a disagreement when those drafts
   differ from the continuation: the real decode would leave the AR text there; the replay
   stays on it), else verifies.

Speculative's numbers are those of the real decode (the test checks it against
``bitmtp_edge.runtime.decoding`` on a small model); hybrid's are exact until its first unverified
mistake. Integer products run in float32 where they are exact (|sum| < 2**24).
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from pathlib import Path

import torch

from tools.blocks import BlockLayout, build_rows


@contextlib.contextmanager
def exact_float32_int_matmul():
    """Within the block, the runtime's exact int matmul runs in float32, exact while
    127 * 127 * K < 2**24, with the float copy of each weight cached (per live tensor)."""
    import bitmtp_edge.runtime.model as model_mod

    original = model_mod.int_matmul
    cache: dict[int, tuple] = {}

    def int_matmul(a, w):
        if 127 * 127 * a.shape[-1] >= 2 ** 24:
            return original(a, w)
        hit = cache.get(id(w))
        if hit is None or hit[0]() is not w:  # a freed tensor's id can be reused
            hit = cache[id(w)] = (weakref.ref(w), w.float().t().contiguous())
        return (a.float() @ hit[1]).to(torch.int32)

    model_mod.int_matmul = int_matmul
    try:
        yield
    finally:
        model_mod.int_matmul = original


@torch.no_grad()
def block_logits(model, prompt: list[int], block_size: int, mask_id: int, max_new: int, eos: set[int]):
    """(continuation, draft logits [N, D, V] float32, stop) with row i the block anchored at
    the i-th token a decode can anchor at (the prompt's last token, then each generated one);
    ``stop`` is the index of the first EOS in the continuation (None without one)."""
    from tools.distill import greedy_continue

    dev = model.model.embed_tokens.weight.device
    ids = torch.tensor([prompt], device=dev)
    full = greedy_continue(model, ids, max_new + block_size)[0].tolist()
    cont = full[len(prompt):]
    stop = next((i for i, t in enumerate(cont[:max_new]) if t in eos), None)
    n_anchor = (stop + 1) if stop is not None else max_new
    clean = full[: len(prompt) - 1 + n_anchor + block_size]
    L = len(clean) - block_size
    layout = BlockLayout(L, block_size, n_anchor)
    anchors = torch.arange(len(prompt) - 1, len(prompt) - 1 + n_anchor, device=dev).unsqueeze(0)
    x, pos, _, mask = build_rows(torch.tensor([clean], device=dev), anchors, layout, mask_id, None)
    hidden = model(x, pos, mask, adapter_from=L)[0, L:]  # the blocks' rows: where mask-row adapters apply
    logits = model.draft_logits(hidden.reshape(-1, hidden.shape[-1])).float()
    return cont, logits.view(n_anchor, block_size, -1), stop


def prompt_tables(model, prompt: list[int], block_size: int, mask_id: int, max_new: int, eos: set[int],
                  calibration=None):
    """(continuation, drafts [N, D], confidences [N, D], stop): the argmax and max-softmax
    of ``block_logits``, mapped by the checkpoint's ``calibration`` if it has one
    (``bitmtp_edge.runtime.calibration``), as the runtime's draft step gives them."""
    cont, logits, stop = block_logits(model, prompt, block_size, mask_id, max_new, eos)
    conf, top = torch.softmax(logits, dim=-1).max(-1)
    if calibration is not None:
        conf = torch.stack([calibration(row) for row in conf])
    return cont, top.tolist(), conf.tolist(), stop


def bitmtp_checkpoint(path: str, what: str | None = None):
    """``read_checkpoint`` of a checkpoint that has drafts (cheap: no tensors), checked before any
    long evaluation starts; raises ``CheckpointError`` naming ``what`` (the flag as given) or the folder."""
    from tools.hf_checkpoint import CheckpointError, read_checkpoint

    what = what or path
    ck = read_checkpoint(path)
    if ck.mtp is None:
        raise CheckpointError(f"{what}: an AR-only checkpoint (no bitmtp.json) has no drafts; give a BitMTP "
                              "checkpoint (tools.train with --mtp-weight > 0: its OUT/compact)")
    if not (Path(path) / "tokenizer.json").is_file():
        raise CheckpointError(f"{what}: no tokenizer.json beside the weights; copy the corpus' tokenizer "
                              "files into it")
    return ck


def output_file(path: str, flag: str = "--json") -> Path:
    """An output file path, refused up front when it is a folder (so no run ends unwritten)."""
    p = Path(path)
    if p.is_dir():
        raise FileExistsError(f"{flag} {path}: a folder; give a file name for the report")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise FileExistsError(f"{flag} {path}: {parent} is a file, not a folder")
    return p


REPLAY_COUNTS = ("tokens", "iterations", "forward_passes", "verifier_calls", "unverified_mistakes")  # replay's keys


def replay(cont, drafts, confs, stop, max_new: int, policy: str, tau: float, min_prefix: int) -> dict:
    """Iterations, forward passes and tokens of one policy over one prompt's tables."""
    limit = min(stop if stop is not None else max_new, max_new)  # tokens the user sees
    end = min(stop + 1 if stop is not None else max_new, max_new)  # the decode ends once this many are committed
    pos = its = passes = verifies = wrong = 0
    while pos < end:
        d, c = drafts[pos], confs[pos]
        its += 1
        passes += 1
        if policy == "hybrid":
            h = 0
            while h < len(c) and c[h] >= tau:
                h += 1
            if h >= min_prefix:
                wrong += int(d[:h] != cont[pos:pos + h])
                pos += h
                continue
        a = 0
        while a < len(d) and d[a] == cont[pos + a]:
            a += 1
        pos += a + 1
        passes += 1
        verifies += 1
    return {"tokens": limit, "iterations": its, "forward_passes": passes, "verifier_calls": verifies,
            "unverified_mistakes": wrong}


def evaluate(path: str, prompts, tau: float, min_prefix: int, max_new: int, log=print,
             dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    with exact_float32_int_matmul():
        return _evaluate(path, prompts, tau, min_prefix, max_new, log, dtype, device)


def _evaluate(path, prompts, tau, min_prefix, max_new, log, dtype, device) -> dict:
    from bitmtp_edge.runtime.calibration import ConfidenceCalibration
    from tools.hf_checkpoint import load_runtime_model
    from tools.tokenizer import load_tokenizer

    model, ck = load_runtime_model(path, dtype, device)
    if ck.mtp is None:
        raise ValueError(f"{path}: an AR-only checkpoint has no drafts to replay")
    tok = load_tokenizer(Path(path))
    eos = set(ck.model.eos_token_ids)
    calibration = ConfidenceCalibration.for_model(ck.mtp, device)
    totals = {p: dict.fromkeys(REPLAY_COUNTS, 0) for p in ("speculative", "hybrid")}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        ids = tok.encode(p.model_prompt, add_special_tokens=False).ids
        tables = prompt_tables(model, ids, ck.mtp.block_size, ck.mtp.mask_token_id, max_new, eos, calibration)
        for pol, tot in totals.items():
            for k, v in replay(*tables, max_new, pol, tau, min_prefix).items():
                tot[k] += v
        if (i + 1) % 10 == 0:
            log(f"  {Path(path).name}: {i + 1}/{len(prompts)} prompts ({time.perf_counter() - t0:.0f}s)")
    return {pol: replay_rates(t) for pol, t in totals.items()}


def evaluate_in_slices(path: str, prompts, tau: float, min_prefix: int, max_new: int, jobs: int, log=print,
                       device: str = "cpu") -> dict:
    """``evaluate`` over ``jobs`` worker processes (every ``jobs``-th prompt each), the counts
    summed: on a GPU the per-prompt decodes are sequential and small, so processes side by side
    fill it. The same counts as one process (each prompt's replay is independent)."""
    slices = [prompts[i::jobs] for i in range(jobs) if prompts[i::jobs]]
    if len(slices) <= 1:
        return evaluate(path, prompts, tau, min_prefix, max_new, log=log, device=device)
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with concurrent.futures.ProcessPoolExecutor(len(slices), mp_context=ctx) as pool:
        parts = list(pool.map(_evaluate_slice, [(path, s, tau, min_prefix, max_new, device) for s in slices]))
    log(f"  {Path(path).name}: {len(prompts)} prompts in {len(slices)} processes")
    return {pol: replay_rates({k: sum(part[pol][k] for part in parts) for k in REPLAY_COUNTS})
            for pol in ("speculative", "hybrid")}


def _evaluate_slice(job) -> dict:
    path, prompts, tau, min_prefix, max_new, device = job
    torch.set_num_threads(1)
    return evaluate(path, prompts, tau, min_prefix, max_new, log=lambda _: None, device=device)


def replay_rates(t: dict) -> dict:
    """Summed ``replay`` counts -> the same, with tokens per iteration and per forward pass and
    the verifier call rate."""
    return {**t, "tokens_per_iteration": t["tokens"] / max(t["iterations"], 1),
            "tokens_per_forward": t["tokens"] / max(t["forward_passes"], 1),
            "verifier_call_rate": t["verifier_calls"] / max(t["iterations"], 1)}


def main(argv: list[str] | None = None) -> None:
    import click

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--data", required=True, help="corpus folder (prompts.jsonl)")
    @click.option("--model", "models", multiple=True, required=True, help="NAME=CHECKPOINT (BitMTP)")
    @click.option("--prompts", "n_prompts", default=40, show_default=True)
    @click.option("--skip", default=0, show_default=True, help="start at this prompt (slices run as separate processes)")
    @click.option("--prompt-file", default=None, help="a prompts.jsonl other than the corpus' held-out one")
    @click.option("--max-new-tokens", default=128, show_default=True)
    @click.option("--tau", default=0.9, show_default=True)
    @click.option("--min-prefix", default=3, show_default=True)
    @click.option("--threads", default=1, show_default=True)
    @click.option("--jobs", default=1, show_default=True, help="worker processes, each replaying a share of the "
                  "prompts (the counts are summed)")
    @click.option("--device", default="cpu", show_default=True, help="cpu or cuda (float32 exact-integer products "
                  "either way; TF32 stays off)")
    @click.option("--json", "json_out", required=True)
    def cli(data, models, n_prompts, skip, prompt_file, max_new_tokens, tau, min_prefix, threads, jobs, device,
            json_out):
        """Replay speculative and hybrid decoding of BitMTP checkpoints on held-out prompts."""
        from tools.corpus import CorpusIndex
        from tools.hf_checkpoint import CheckpointError
        from tools.prompts import read_prompts

        if jobs < 1:
            raise click.BadParameter(f"{jobs}: give 1 or more worker processes", param_hint="--jobs")
        if n_prompts < 1 or skip < 0:
            raise click.BadParameter(f"--prompts {n_prompts} --skip {skip}: give --prompts >= 1 and --skip >= 0")
        named = []
        for spec in models:  # NAME=CHECKPOINT, or a bare CHECKPOINT named by its path
            name, eq, path = spec.partition("=")
            named.append((name, path, spec) if eq else (spec, spec, spec))
        try:  # every input checked before the first (long) replay
            output_file(json_out)
            for _, path, spec in named:
                bitmtp_checkpoint(path, f"--model {spec}")
            pf = Path(prompt_file) if prompt_file else Path(data) / CorpusIndex.load(data).prompts
            prompts = read_prompts(pf)[skip:skip + n_prompts]
        except (ValueError, OSError, CheckpointError) as e:
            raise click.ClickException(str(e)) from None
        if not prompts:
            raise click.ClickException(f"{pf}: no prompts{f' after --skip {skip}' if skip else ''}; give a prompts "
                                       "file that has some (tools.corpus build cuts them from the test split)")
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32 = False  # the int products must stay exact
        where = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
        report = {"settings": {"prompts": len(prompts), "skip": skip, "jobs": jobs, "prompt_file": str(pf),
                               "max_new_tokens": max_new_tokens,
                               "tau": tau, "min_prefix": min_prefix, "device": where,
                               "when": time.strftime("%Y-%m-%d %H:%M")}, "models": {}}
        for name, path, _ in named:
            report["models"][name] = {"path": path, **evaluate_in_slices(path, prompts, tau, min_prefix,
                                                                          max_new_tokens, jobs, log=click.echo,
                                                                          device=device)}
            s = report["models"][name]
            click.echo(f"{name}: speculative {s['speculative']['tokens_per_iteration']:.2f} tok/it "
                       f"{s['speculative']['tokens_per_forward']:.2f} tok/fw; hybrid "
                       f"{s['hybrid']['tokens_per_iteration']:.2f} tok/it {s['hybrid']['tokens_per_forward']:.2f} tok/fw "
                       f"verifier rate {s['hybrid']['verifier_call_rate']:.2f}, "
                       f"{s['hybrid']['unverified_mistakes']} unverified mistakes")
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")

    cli.main(args=argv, prog_name="python -m tools.eval_acceptance", standalone_mode=True)


if __name__ == "__main__":
    main()
