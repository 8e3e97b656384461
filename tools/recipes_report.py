"""The training-recipes comparison of ``quality.md`` from a device evaluation's outputs.

    python -m tools.recipes_report tools/results/recipes_spec.json --eval-dir runs/h200d/eval \
        --json tools/results/recipes.json
    python -m tools.eval_quality --sections none --merge tools/results/quality.json \
        --recipes tools/results/recipes.json --data tools/checkpoints/data   # re-render quality.md

``tools/h200_distill.sh`` with ``EVAL=full`` leaves in its ``eval/`` folder one
``heldout_TAG.json`` and ``doc_TAG.json`` per group of models (``tools.eval_quality``'s
decoding section on the held-out and the docstring prompts) and ``ntp.json`` (its held-out
section, SFT baseline included). The spec names the models to compare, in order, with what
the numbers cannot say: the recipe, the training budget, and the run's ``train_log.json``
(its final validation NTP loss); ``fine_tune_pair`` [fine-tuned, from scratch] names the two
models of the fine-tuning target. Numbers come only from those files.
"""

from __future__ import annotations

import json
from pathlib import Path


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable report ({e})") from None


def build(spec: dict, eval_dir: Path, base: Path = Path(".")) -> dict:
    """The recipes dict ``tools.eval_quality --recipes`` renders (``settings.source`` = decode)."""
    heldout, docs, settings = {}, {}, None
    for f in sorted(eval_dir.glob("heldout_*.json")):
        r = _load(f)
        heldout.update(r["decoding"]["summary"])
        settings = settings or {**r["decoding"]["settings"], "device": r["decoding"].get("device"),
                                "when": r["decoding"].get("when")}
    for f in sorted(eval_dir.glob("doc_*.json")):
        r = _load(f)
        docs.update(r["decoding"]["summary"])
        doc_file = r["decoding"]["settings"].get("prompt_file")
    ntp = _load(eval_dir / "ntp.json")["heldout"] if (eval_dir / "ntp.json").is_file() else {}
    if settings is None:
        raise ValueError(f"{eval_dir}: no heldout_*.json; run tools/h200_distill.sh with EVAL=full")
    models, missing = {}, []
    for name, m in spec["models"].items():
        if name not in heldout or "speculative" not in heldout[name]:
            missing.append(name)
            continue
        entry = {"recipe": m.get("recipe", ""), "budget": m.get("budget", ""), **heldout[name]}
        if m.get("train_log"):
            entry["val_ntp"] = (_load(base / m["train_log"]).get("summary") or {}).get("val_ntp")
        elif "val_ntp" in m:
            entry["val_ntp"] = m["val_ntp"]
        entry["heldout_gap_pct"] = ntp.get("gap_pct", {}).get(name)
        if name in ntp.get("models", {}):
            entry["heldout_ntp"] = ntp["models"][name]["ntp_loss"]
        models[name] = entry
    out = {"settings": {**settings, "source": "decode"}, "shipped": spec.get("shipped"), "note": spec.get("note", ""),
           "models": models, "missing": missing,
           "heldout_baseline": {"name": ntp.get("baseline"),
                                "ntp_loss": ntp.get("models", {}).get(ntp.get("baseline"), {}).get("ntp_loss")},
           "docstring_file": spec.get("docstring_file") or (doc_file if docs else ""),
           "docstring_prompts": {n: {"speculative": docs[n]["speculative"], "hybrid": docs[n]["hybrid"],
                                     "ar": docs[n]["ar"]} for n in spec["models"] if n in docs and "hybrid" in docs[n]},
           "fine_tune_pair": spec.get("fine_tune_pair"), "findings": spec.get("findings", "")}
    return out


def main(argv: list[str] | None = None) -> None:
    import click

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.argument("spec_file", type=click.Path(exists=True, dir_okay=False))
    @click.option("--eval-dir", required=True, type=click.Path(exists=True, file_okay=False),
                  help="the eval/ folder of an EVAL=full device run")
    @click.option("--base", default=".", show_default=True, help="folder the spec's train_log paths are relative to")
    @click.option("--json", "json_out", required=True)
    def cli(spec_file, eval_dir, base, json_out):
        """Collect the recipes comparison (quality.md, issue 14) from a device evaluation."""
        try:
            out = build(_load(Path(spec_file)), Path(eval_dir), Path(base))
        except (ValueError, KeyError) as e:
            raise click.ClickException(str(e)) from None
        if out["missing"]:
            click.echo(f"warning: no decoding results for {', '.join(out['missing'])} in {eval_dir}", err=True)
        tmp = Path(json_out).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        tmp.replace(json_out)
        click.echo(f"{json_out}: {len(out['models'])} models")

    cli.main(args=argv, prog_name="python -m tools.recipes_report", standalone_mode=True)


if __name__ == "__main__":
    main()
