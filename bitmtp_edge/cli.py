"""``bitmtp``: the command line, a thin shell over the Python API (``bitmtp_edge.Engine``)."""

from __future__ import annotations

import json
import sys

import click

from .artifact import ArtifactError
from .decoding import POLICIES, DecodingError



def _load_engine(artifact, backend, device):
    from .engine import Engine

    try:
        return Engine.load(artifact, backend=backend, device=device)
    except (ArtifactError, ValueError) as e:
        raise click.ClickException(str(e)) from None


artifact_option = click.option("--artifact", "-a", type=click.Path(file_okay=False), default=None,
                               help="Artifact folder from bitmtp-export (default: the embedded model).")
backend_option = click.option("--backend", type=click.Choice(["auto", "reference", "ampere", "server"]),
                              default="auto", show_default=True)
device_option = click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="bitmtp-edge")
def main() -> None:
    """BitMTP Edge: multi-token decoding for ternary LLMs on Jetson and server GPUs."""


@main.command()
@click.argument("prompt")
@artifact_option
@backend_option
@device_option
@click.option("--policy", type=click.Choice(POLICIES), default="hybrid", show_default=True)
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--tau", type=click.FloatRange(0, 1, min_open=True), default=None, help="Confidence threshold τ.")
@click.option("--min-prefix", "-m", type=click.IntRange(min=1), default=None, help="Hybrid: commit without verify when h ≥ m.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats).")
def generate(prompt, artifact, backend, device, policy, max_new_tokens, tau, min_prefix, stop, as_json):
    """Complete PROMPT with the chosen decoding policy."""
    eng = _load_engine(artifact, backend, device)
    try:
        res = eng.generate(prompt, max_new_tokens=max_new_tokens, policy=policy, tau=tau,
                           min_prefix=min_prefix, stop=list(stop) or None)
    except DecodingError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": res.stats.to_dict()}))
        return
    click.echo(prompt + res.text)
    s = res.stats
    click.echo(f"\n[{policy}] {s.new_tokens} tokens, {s.decode_tokens_per_s:.1f} tok/s, "
               f"{s.tokens_per_iteration:.2f} tokens/iteration, {s.verifier_calls} verifier calls", err=True)


@main.command()
@artifact_option
@backend_option
@device_option
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=96, show_default=True)
@click.option("--policy", type=click.Choice([p for p in POLICIES if p != "ar"]), default="hybrid", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def demo(artifact, backend, device, max_new_tokens, policy, as_json):
    """Complete held-out code prompts with AR and with multi-token decoding; report the speedup."""
    from .demo import run_demo

    eng = _load_engine(artifact, backend, device)
    try:
        report = run_demo(eng, max_new_tokens=max_new_tokens, policy=policy, echo=None if as_json else click.echo)
    except DecodingError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(report, indent=2))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
