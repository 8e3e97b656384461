"""Are the draft confidences calibrated? Reliability of each block slot and a per-slot
temperature fitted on *training-split* prompts (issue 14: hybrid's verifier rate).

    # prompts cut from training-split files found under local trees (sha256-checked against files.tsv)
    python -m tools.calibrate prompts --data tools/checkpoints/data --root site-packages=$(python -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])') --count 64 --out runs/calib/train_prompts.jsonl
    # reliability per slot, the fitted temperatures, hybrid replayed with and without them
    python -m tools.calibrate measure --model tools/checkpoints/bitmtp-d8-27m \
        --prompts runs/calib/train_prompts.jsonl --count 48 --json runs/calib/d8.json [--write-config]

What a confidence has to mean for hybrid decoding: the chance that the draft equals the
verifier's greedy token (hybrid commits the confident prefix unverified, so that is what an
unverified mistake is). So the label of slot j of the block anchored at i is whether its
argmax equals token i + j + 1 of the model's own greedy continuation, exactly what
``tools.eval_acceptance`` replays. A slot is *underconfident* when its drafts agree more often
than its confidence says (then τ = 0.9 sends to the verifier drafts that would have passed),
*overconfident* when less often.

Two calibrations are fitted per slot and compared, both changing the confidences only, never
the argmax: a temperature T_j minimising the negative log-likelihood of the verifier's greedy
token under softmax(logits_j / T_j) (temperature scaling, Guo et al. 2017; on a grid), and
Platt scaling of the confidence itself, c' = sigmoid(a_j · logit(c) + b_j), fitted to the
agreement labels (log-loss). ``--write-config`` stores the Platt pairs in the checkpoint's
``bitmtp.json`` as ``confidence_calibration``: a map of the confidence every backend already
computes (``bitmtp_edge.runtime.calibration``), so no head kernel changes; ``bitmtp-export``
carries it into the artifact's manifest.
Never fit on held-out prompts: the report's numbers would then be fitted to themselves.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from tools.eval_acceptance import (REPLAY_COUNTS, bitmtp_checkpoint, block_logits, exact_float32_int_matmul,
                                   output_file, replay, replay_rates)

GRID = tuple(round(0.30 + 0.05 * i, 2) for i in range(35))  # 0.30 .. 2.00
BINS = (0.0, 0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0001)


def _file_list(data: Path) -> list[tuple[str, str, str, int]]:
    """(split, key, sha256, size) rows of a corpus' ``files.tsv`` (or ``.tsv.gz``)."""
    from tools.corpus import FILE_LIST

    for name, opener in ((FILE_LIST, open), (FILE_LIST + ".gz", gzip.open)):
        if (data / name).is_file():
            with opener(data / name, "rt") as f:
                rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
            return [(s, k, h, int(n)) for s, k, h, n in rows]
    raise FileNotFoundError(f"{data}: no files.tsv or files.tsv.gz; point --data at a corpus folder "
                            "(python -m tools.corpus build)")


def train_split_prompts(data: str | Path, roots: dict[str, str], count: int, per_file: int = 1):
    """Prompts (``tools.prompts``' kinds) cut from the corpus' *training*-split files that are
    present under ``roots`` {label: path} with the recorded sha256 (so surely the same text)."""
    from tools.prompts import extract_prompts

    docs, checked = [], 0
    for split, key, sha, size in _file_list(Path(data)):
        label, _, rel = key.partition("/")
        if split != "train" or label not in roots:
            continue
        path = Path(roots[label]) / rel
        if not path.is_file() or path.stat().st_size != size:
            continue
        raw = path.read_bytes()
        checked += 1
        if hashlib.sha256(raw).hexdigest() == sha:
            docs.append((key, raw.decode("utf-8")))
    if not docs:
        raise FileNotFoundError(f"none of {data}'s training-split files is under {roots} with its recorded "
                                "sha256; pass --root LABEL=PATH for the trees the corpus was built from")
    return extract_prompts(docs, count, per_file=per_file), len(docs)


def _reliability(conf: torch.Tensor, hit: torch.Tensor) -> list[dict]:
    rows = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        sel = (conf >= lo) & (conf < hi)
        n = int(sel.sum())
        rows.append({"bin": [lo, min(hi, 1.0)], "n": n,
                     "mean_confidence": round(float(conf[sel].mean()), 4) if n else None,
                     "agreement": round(float(hit[sel].float().mean()), 4) if n else None})
    return rows


def _ece(conf: torch.Tensor, hit: torch.Tensor) -> float:
    total = conf.numel()
    err = 0.0
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        sel = (conf >= lo) & (conf < hi)
        if sel.any():
            err += float(sel.sum()) / total * abs(float(conf[sel].mean()) - float(hit[sel].float().mean()))
    return err


def slot_statistics(logits: torch.Tensor, targets: torch.Tensor, grid=GRID):
    """logits [N, V] of one slot, targets [N] (the verifier's greedy tokens) ->
    (hit [N] bool, conf [G, N] max-softmax at each grid temperature, nll [G] summed)."""
    hit = logits.argmax(-1) == targets
    conf, nll = [], []
    for t in grid:
        lp = torch.log_softmax(logits.double() / t, dim=-1)
        conf.append(lp.max(-1).values.exp().float())
        nll.append(float(-lp.gather(1, targets.unsqueeze(1)).sum()))
    return hit, torch.stack(conf), torch.tensor(nll, dtype=torch.float64)


def collect(path: str, prompts, max_new: int, log=print, dtype: torch.dtype = torch.float32,
            device: str = "cpu") -> dict:
    """Per prompt: the greedy continuation, the drafts [N, D] and their confidences at every
    grid temperature [G, N, D]; per slot: the NLL of the verifier's tokens at each temperature."""
    from tools.hf_checkpoint import load_runtime_model
    from tools.tokenizer import load_tokenizer

    model, ck = load_runtime_model(path, dtype, device)
    if ck.mtp is None:
        raise ValueError(f"{path}: an AR-only checkpoint has no drafts to calibrate")
    d = ck.mtp.block_size
    tok = load_tokenizer(Path(path))
    eos = set(ck.model.eos_token_ids)
    nll = torch.zeros(d, len(GRID), dtype=torch.float64)
    tables = []
    t0 = time.perf_counter()
    with exact_float32_int_matmul():
        for i, p in enumerate(prompts):
            ids = tok.encode(p.model_prompt, add_special_tokens=False).ids
            cont, logits, stop = block_logits(model, ids, d, ck.mtp.mask_token_id, max_new, eos)
            n = logits.shape[0]
            conf = torch.empty(len(GRID), n, d)
            hit = torch.empty(n, d, dtype=torch.bool)
            for j in range(d):
                # anchor a's slot j drafts continuation token a + j (cont holds max_new + D tokens)
                tgt = torch.tensor(cont[j:j + n], dtype=torch.long)
                hit[:, j], conf[:, :, j], s = slot_statistics(logits[:, j], tgt)
                nll[j] += s
            tables.append({"cont": cont, "drafts": logits.argmax(-1).tolist(), "conf": conf, "hit": hit, "stop": stop})
            if (i + 1) % 8 == 0:
                log(f"  {Path(path).name}: {i + 1}/{len(prompts)} prompts ({time.perf_counter() - t0:.0f}s)")
    return {"block_size": d, "nll": nll, "tables": tables}


def fit_platt(conf: torch.Tensor, hit: torch.Tensor, steps: int = 200) -> tuple[float, float]:
    """(a, b) of c' = sigmoid(a * logit(c) + b) minimising the log-loss of ``hit``: Platt scaling
    of one slot's confidence against agreement with the verifier."""
    x = torch.logit(conf.double().clamp(1e-6, 1 - 1e-6))
    y = hit.double()
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([ab], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ab[0] * x + ab[1], y)
        loss.backward()
        return loss
    opt.step(closure)
    return float(ab[0].detach()), float(ab[1].detach())


def platt(conf: torch.Tensor, a: float, b: float) -> torch.Tensor:
    return torch.sigmoid(a * torch.logit(conf.double().clamp(1e-6, 1 - 1e-6)) + b).float()


def summarise(data: dict, tau: float, min_prefix: int, max_new: int) -> dict:
    d, nll, tables = data["block_size"], data["nll"], data["tables"]
    one = GRID.index(1.0)
    fitted = [GRID[int(nll[j].argmin())] for j in range(d)]
    hits = torch.cat([t["hit"] for t in tables])  # [S, D]
    confs = torch.cat([t["conf"] for t in tables], dim=1)  # [G, S, D]
    plat = [fit_platt(confs[one, :, j], hits[:, j]) for j in range(d)]
    # Prefix labels: slot j counts as right only when slots 0..j all are, the event an
    # unverified commit of j + 1 drafts bets on; its map estimates P(the prefix is right).
    chain = hits.long().cumprod(dim=1).bool()
    plat_prefix = [fit_platt(confs[one, :, j], chain[:, j]) for j in range(d)]

    def stats(conf, hit) -> dict:
        above = conf >= tau
        return {"mean_confidence": round(float(conf.mean()), 4), "ece": round(_ece(conf, hit), 4),
                "share_confident": round(float(above.float().mean()), 4),
                "agreement_when_confident": round(float(hit[above].float().mean()), 4) if above.any() else None,
                "reliability": _reliability(conf, hit)}

    slots = []
    for j in range(d):
        hit, k = hits[:, j], GRID.index(fitted[j])
        slots.append({"slot": j, "samples": int(hit.numel()), "agreement": round(float(hit.float().mean()), 4),
                      "nll_per_token": round(float(nll[j, one]) / hit.numel(), 4),
                      "as_trained": stats(confs[one, :, j], hit),
                      "temperature": fitted[j], "nll_per_token_fitted": round(float(nll[j, k]) / hit.numel(), 4),
                      "temperature_fitted": stats(confs[k, :, j], hit),
                      "platt": [round(plat[j][0], 4), round(plat[j][1], 4)],
                      "platt_fitted": stats(platt(confs[one, :, j], *plat[j]), hit),
                      "prefix_agreement": round(float(chain[:, j].float().mean()), 4),
                      "platt_prefix": [round(plat_prefix[j][0], 4), round(plat_prefix[j][1], 4)],
                      "platt_prefix_fitted": stats(platt(confs[one, :, j], *plat_prefix[j]), chain[:, j])})

    def replayed(conf_of) -> dict:
        tot = dict.fromkeys(REPLAY_COUNTS, 0)
        for t in tables:
            c = torch.stack([conf_of(t["conf"], j) for j in range(d)], dim=1).tolist()
            for k, v in replay(t["cont"], t["drafts"], c, t["stop"], max_new, "hybrid", tau, min_prefix).items():
                tot[k] += v
        rates = replay_rates(tot)
        return {**tot, "tokens_per_forward": round(rates["tokens_per_forward"], 4),
                "verifier_call_rate": round(rates["verifier_call_rate"], 4)}

    hybrid = {"as_trained": replayed(lambda c, j: c[one, :, j]),
              "temperature": replayed(lambda c, j: c[GRID.index(fitted[j]), :, j]),
              "platt": replayed(lambda c, j: platt(c[one, :, j], *plat[j])),
              "platt_prefix": replayed(lambda c, j: platt(c[one, :, j], *plat_prefix[j]))}
    return {"block_size": d, "temperature": fitted, "platt": [list(p) for p in plat],
            "platt_prefix": [list(p) for p in plat_prefix], "slots": slots, "hybrid": hybrid}


def measure(path: str, prompts, max_new: int, tau: float, min_prefix: int, log=print,
            dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    return {"path": path, **summarise(collect(path, prompts, max_new, log, dtype, device), tau, min_prefix, max_new)}


def write_config(path: str | Path, pairs: list[list[float]]) -> None:
    """Store per-slot Platt pairs in the checkpoint's bitmtp.json as ``confidence_calibration``
    (checked as the exporter and runtime read it; written atomically)."""
    from bitmtp_edge.format.config import MTPConfig

    f = Path(path) / "bitmtp.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: not a BitMTP checkpoint (no bitmtp.json); calibrate the checkpoint "
                                "tools.train wrote (its compact/ folder)")
    cfg = json.loads(f.read_text())
    cfg["confidence_calibration"] = [[round(float(a), 6), round(float(b), 6)] for a, b in pairs]
    MTPConfig.from_dict(cfg)  # one pair per slot, finite, a > 0
    tmp = f.with_name(".bitmtp.json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, f)


def main(argv: list[str] | None = None) -> None:
    import click

    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    def cli():
        """Reliability of the draft confidences and per-slot temperatures (training-split prompts)."""

    @cli.command("prompts")
    @click.option("--data", required=True, help="corpus folder (its files.tsv says which files are training split)")
    @click.option("--root", "roots", multiple=True, required=True, help="LABEL=PATH tree holding those files")
    @click.option("--count", default=64, show_default=True)
    @click.option("--out", required=True, help="prompts.jsonl to write")
    def prompts_cmd(data, roots, count, out):
        from tools.corpus import _parse_root
        from tools.prompts import write_prompts

        try:  # the corpus builder's own --root syntax
            parsed = {r.label: str(r.path) for r in map(_parse_root, roots)}
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--root") from None
        if count < 1:
            raise click.BadParameter(f"{count}: give 1 or more", param_hint="--count")
        try:
            output_file(out, "--out")
            found, n_docs = train_split_prompts(data, parsed, count)
        except (ValueError, OSError) as e:
            raise click.ClickException(str(e)) from None
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_prompts(Path(out), found)
        click.echo(f"{len(found)} prompts from {n_docs} training-split files -> {out}")

    @cli.command("measure")
    @click.option("--model", "path", required=True, help="BitMTP checkpoint")
    @click.option("--prompts", "prompt_file", required=True, help="training-split prompts (the prompts command)")
    @click.option("--count", default=48, show_default=True)
    @click.option("--max-new-tokens", default=128, show_default=True)
    @click.option("--tau", default=0.9, show_default=True)
    @click.option("--min-prefix", default=3, show_default=True)
    @click.option("--threads", default=1, show_default=True)
    @click.option("--json", "json_out", required=True)
    @click.option("--write-config", "write_config_", is_flag=True,
                  help="store the fitted Platt pairs in the checkpoint's bitmtp.json (confidence_calibration)")
    @click.option("--labels", type=click.Choice(["draft", "prefix"]), default="prefix", show_default=True,
                  help="which fit --write-config stores: P(this draft is right) or P(this draft and all before it are)")
    def measure_cmd(path, prompt_file, count, max_new_tokens, tau, min_prefix, threads, json_out, write_config_, labels):
        from tools.hf_checkpoint import CheckpointError
        from tools.prompts import read_prompts

        if count < 1:
            raise click.BadParameter(f"{count}: give 1 or more prompts", param_hint="--count")
        try:  # every input checked before the (long) measurement
            output_file(json_out)
            bitmtp_checkpoint(path, f"--model {path}")
            prompts = read_prompts(prompt_file)[:count]
        except (ValueError, OSError, CheckpointError) as e:
            raise click.ClickException(str(e)) from None
        if not prompts:
            raise click.ClickException(f"--prompts {prompt_file}: no prompts in it; write some with "
                                       "`python -m tools.calibrate prompts`")
        torch.set_num_threads(threads)
        report = measure(path, prompts, max_new_tokens, tau, min_prefix, log=click.echo)
        report["settings"] = {"prompts": len(prompts), "prompt_file": prompt_file, "max_new_tokens": max_new_tokens,
                              "tau": tau, "min_prefix": min_prefix, "when": time.strftime("%Y-%m-%d %H:%M")}
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
        for s in report["slots"]:
            a, t, pl = s["as_trained"], s["temperature_fitted"], s["platt_fitted"]
            click.echo(f"slot {s['slot']}: agreement {s['agreement']:.3f} mean conf {a['mean_confidence']:.3f} "
                       f"conf>=tau {a['share_confident']:.3f} (agree {a['agreement_when_confident']}) ECE {a['ece']:.3f}"
                       f" | T {s['temperature']}: ECE {t['ece']:.3f} conf>=tau {t['share_confident']:.3f} "
                       f"(agree {t['agreement_when_confident']}) | platt {s['platt']}: ECE {pl['ece']:.3f} "
                       f"conf>=tau {pl['share_confident']:.3f} (agree {pl['agreement_when_confident']}) | prefix "
                       f"{s['platt_prefix']}: conf>=tau {s['platt_prefix_fitted']['share_confident']:.3f}")
        for k, h in report["hybrid"].items():
            click.echo(f"hybrid {k}: {h['tokens_per_forward']:.2f} tok/fw, verifier rate {h['verifier_call_rate']:.3f}, "
                       f"{h['unverified_mistakes']} unverified mistakes")
        if write_config_:
            try:
                write_config(path, report["platt" if labels == "draft" else "platt_prefix"])
            except ValueError as e:  # a degenerate fit (a <= 0): too few or too uniform samples
                raise click.ClickException(f"{path}/bitmtp.json left as it was: the fitted pairs are not a "
                                           f"calibration ({e}); measure on more prompts (--count) and write again; "
                                           f"the report is in {json_out}") from None
            click.echo(f"wrote confidence_calibration (the Platt pairs) to {path}/bitmtp.json")

    cli.main(args=argv, prog_name="python -m tools.calibrate", standalone_mode=True)


if __name__ == "__main__":
    main()
