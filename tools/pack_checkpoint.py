"""Pack a training checkpoint into the compact release form (HF BitNet, packed, ``offline``).

    python -m tools.pack_checkpoint runs/d8/final tools/checkpoints/bitmtp-d8

``SRC`` is a latent (``online``) checkpoint written by ``tools.train``; ``DST`` gets the
ternary codes packed HF-style (uint8 ``[N/4, K]``) with ``weight_scale`` multipliers, every
float tensor in bfloat16, and the same config / tokenizer / ``bitmtp.json``
(``tools.hf_checkpoint``). A compact ``SRC`` is re-saved with its float tensors in bfloat16.
Either way the result is read back and its ternary codes are checked against ``SRC``, and its
scales, norms and embedding against ``SRC`` up to bfloat16 rounding, before it is kept.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools.hf_checkpoint import (CheckpointError, load_latent_model, load_runtime_model, read_checkpoint, recast_compact,
                                 save_compact)


def pack(src: str | Path, dst: str | Path, overwrite: bool = False) -> Path:
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it")
    ck = read_checkpoint(src)
    if ck.compact:
        recast_compact(src, dst)
    else:
        model, _ = load_latent_model(src)
        save_compact(model, dst, src, ck.mtp, ck.corpus_sha256)
    verify_same_codes(src, dst)
    return dst


def verify_same_codes(a: str | Path, b: str | Path) -> None:
    """Both checkpoints give the runtime identical ternary codes, and the same scales and
    16-bit tensors up to bfloat16 rounding."""
    ma, _ = load_runtime_model(a, torch.float32)
    mb, _ = load_runtime_model(b, torch.float32)
    sa, sb = ma.state_dict(), mb.state_dict()
    for name, t in sa.items():
        if name.endswith(".codes"):
            if not torch.equal(t, sb[name]):
                raise CheckpointError(f"{b}: {name} differs from {a}; the packed checkpoint is not faithful")
        elif not torch.allclose(t.float(), sb[name].float(), rtol=1e-2, atol=1e-6):
            raise CheckpointError(f"{b}: {name} differs from {a} by more than bfloat16 rounding")


def main(argv: list[str] | None = None) -> None:
    import click

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
    @click.argument("dst", type=click.Path(path_type=Path))
    @click.option("--overwrite", is_flag=True, help="replace DST if it exists")
    def cli(src, dst, overwrite):
        """Pack the checkpoint SRC into the compact release form at DST."""
        try:
            out = pack(src, dst, overwrite)
        except (CheckpointError, FileExistsError) as e:
            raise click.ClickException(str(e)) from None
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        click.echo(f"packed {src} -> {out} ({size / 2**20:.1f} MiB), codes verified")

    cli.main(args=argv, prog_name="python -m tools.pack_checkpoint", standalone_mode=True)


if __name__ == "__main__":
    main()
