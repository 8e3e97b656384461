"""Build a small random-weight BitMTP checkpoint and export it: the interim demo artifact.

Until a trained model exists, this gives ``bitmtp demo`` / ``Engine.load()`` something to
run end to end: a BitNet-layout checkpoint with ``bitmtp.json`` (tools/fake_checkpoints.py)
goes through the real exporter into an artifact folder (default: the embedded model).

    python -m tools.make_demo_artifact [OUT] [--preset tiny|small] [--block-size 4] [--overwrite]

THE WEIGHTS ARE RANDOM: the generated text is meaningless, and drafts are rarely accepted, so
speedups measured on this artifact say nothing about a trained model. It exercises the
pipeline (export, artifact checks, every decoding policy, the KV segments), nothing more.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from tools import fake_checkpoints as fc

PRESETS = {
    # About 1 MB: the tests' size.
    "tiny": fc.TinyDims(max_position_embeddings=1024),
    # About 12 MB of packed weights + embeddings: slow enough on CPU to see per-step costs.
    "small": fc.TinyDims(vocab_size=512, hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8,
                         num_kv_heads=2, max_position_embeddings=4096),
}
MEANINGLESS = "random weights: the generated text is meaningless (interim demo until a trained model exists)"


def default_out() -> Path:
    from bitmtp_edge.runtime.engine import embedded_artifact_path

    return embedded_artifact_path()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(path_type=Path), required=False)
@click.option("--preset", type=click.Choice(list(PRESETS)), default="tiny", show_default=True)
@click.option("--block-size", type=click.IntRange(2, 16), default=4, show_default=True,
              help="MTP block size D recorded in bitmtp.json.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--board", type=click.Choice(["orin-nano-8gb", "orin-nx-16gb", "agx-orin", "rtx3090", "h20", "h200"]),
              default="orin-nano-8gb", show_default=True, help="KV budget preset for the export.")
@click.option("--keep-checkpoint", type=click.Path(path_type=Path), default=None,
              help="Also keep the source checkpoint folder here (default: a temporary folder).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def main(out: Path | None, preset: str, block_size: int, seed: int, board: str, keep_checkpoint: Path | None,
         overwrite: bool) -> None:
    """Write a random-weight BitMTP artifact to OUT (default: the embedded model folder)."""
    from export import ExportError, ExportOptions, export_checkpoint

    out = out or default_out()
    click.echo(f"warning: {MEANINGLESS}", err=True)
    with tempfile.TemporaryDirectory(prefix="bitmtp-demo-ckpt-") as tmp:
        ckpt = keep_checkpoint or Path(tmp) / "checkpoint"
        fc.make_bitmtp(ckpt, block_size=block_size, min_prefix=min(3, block_size), dims=PRESETS[preset], seed=seed)
        try:
            result = export_checkpoint(ckpt, out, ExportOptions(board=board, overwrite=overwrite))
        except ExportError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
    m = result.manifest
    click.echo(f"demo artifact -> {result.out} ({preset}: {m.model.num_layers} layers, hidden {m.model.hidden_size}, "
               f"D={m.mtp.block_size}, mask id {m.mtp.mask_token_id})")
    click.echo(f"note: {MEANINGLESS}")


if __name__ == "__main__":
    main()
