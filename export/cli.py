"""``bitmtp-export CKPT OUT/``: a thin click shell over ``export.export_checkpoint``.

Exit codes: 0 exported; 2 bad input (one line on stderr, ``error: <file>: <what was
wrong>; <what to do>``, and no OUT/ written); click's own usage errors also exit 2;
3 (``--onnx`` only) the artifact was exported but its ONNX graphs could not be written
(the artifact is complete and usable; the stderr line says why). ``--onnx-from OUT/``
adds the ONNX graphs to an existing artifact: 0 written, 2 refused or not writable (no
ONNX file half-written; the artifact still loads).
Interrupted (Ctrl-C: 130, SIGTERM: 143): the temporary folder is removed, OUT/ is unchanged
(while the ONNX graphs are written: their partly written files are removed).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from bitmtp_edge.format.segments import DEVICE_KV_BUDGET_MIB, MIB

from .errors import ExportError
from .out_folder import Terminated, sigterm_as_interrupt
from .writer import EXPORTER_VERSION, ExportOptions, export_checkpoint

EXIT_BAD_INPUT = 2
EXIT_ONNX_NOT_WRITTEN = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
EXIT_TERMINATED = 143  # 128 + SIGTERM
# Below this many tensors an export takes well under a second; a bar would only flicker.
PROGRESS_MIN_TENSORS = 64


class _RichProgress:
    """A rich progress bar over the checkpoint's tensors, on stderr."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.fields[name]}"), console=console, transient=True)
        self._task = None

    def start(self, total: int) -> None:
        if total >= PROGRESS_MIN_TENSORS:
            self._bar.start()
            self._task = self._bar.add_task("converting", total=total, name="")

    def advance(self, name: str) -> None:
        if self._task is not None:
            self._bar.update(self._task, advance=1, name=name)

    def phase(self, what: str) -> None:
        if self._task is not None:
            self._bar.update(self._task, description=what, name="")

    def stop(self) -> None:
        self._bar.stop()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("ckpt", type=click.Path(path_type=Path), required=False)
@click.argument("out", type=click.Path(path_type=Path), required=False)
@click.option("--max-context", type=click.IntRange(min=2), default=None,
              help="Longest context the KV segments cover [default: min(max_position_embeddings, 4096)].")
@click.option("--board", type=click.Choice(list(DEVICE_KV_BUDGET_MIB)), default=None,
              help="Target board whose KV memory budget bounds the segments.")
@click.option("--device", "old_device", default=None, hidden=True, expose_value=True,
              help="Renamed --board (every other --device in BitMTP is a torch device).")
@click.option("--kv-budget-mib", type=click.FloatRange(min=0, min_open=True), default=None,
              help="KV memory budget in MiB (instead of --board).")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT/ if it is an artifact (an empty folder needs no flag; anything else is refused, "
                   "never deleted).")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@click.option("--onnx", is_flag=True, help="Also write the decode step as ONNX (model.onnx, model_draft.onnx).")
@click.option("--onnx-from", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="OUT/",
              help="Only write the ONNX graphs into the existing artifact folder OUT/ (no CKPT/OUT arguments).")
@click.version_option(EXPORTER_VERSION, prog_name="bitmtp-export")
def main(ckpt: Path | None, out: Path | None, max_context: int | None, board: str | None, old_device: str | None,
         kv_budget_mib: float | None, overwrite: bool, quiet: bool, onnx: bool, onnx_from: Path | None) -> None:
    """Export the Hugging Face checkpoint folder CKPT into the BitMTP artifact folder OUT.

    CKPT: a BitMTP training checkpoint (HF layout + bitmtp.json), an HF BitNet checkpoint
    (latent/online or packed/offline) or a ternary group-128 Qwen3 checkpoint
    (Ternary-Bonsai -unpacked); single-file or sharded safetensors, with tokenizer.json.
    """
    if old_device is not None:
        raise click.UsageError(f"--device was renamed --board (e.g. --board {old_device}): it names the target "
                               "board whose memory bounds the KV segments, while --device elsewhere is a torch device")
    if onnx_from is not None:
        if ckpt is not None or out is not None:
            raise click.UsageError("--onnx-from OUT/ takes no CKPT or OUT argument")
        # the artifact's context, board and folder are fixed: options that would shape them do nothing here
        ignored = [flag for flag, given in (("--max-context", max_context is not None), ("--board", board is not None),
                                            ("--kv-budget-mib", kv_budget_mib is not None),
                                            ("--overwrite", overwrite), ("--onnx", onnx)) if given]
        if ignored:
            raise click.UsageError(f"--onnx-from OUT/ only adds the ONNX graphs to an existing artifact; "
                                   f"{', '.join(ignored)} would change nothing there: leave it out, or re-export "
                                   "with CKPT OUT/ --onnx")
        sys.exit(_write_onnx(onnx_from, quiet, EXIT_BAD_INPUT))
    if ckpt is None or out is None:
        raise click.UsageError("give CKPT and OUT (or --onnx-from OUT/ for an existing artifact)")
    from rich.console import Console

    console = Console(stderr=True)
    progress = None if quiet or not console.is_terminal else _RichProgress(console)
    options = ExportOptions(max_context=max_context, board=board, kv_budget_mib=kv_budget_mib, overwrite=overwrite)
    note = (lambda message: None) if quiet else (lambda message: click.echo(f"note: {message}", err=True))
    t0 = time.perf_counter()
    try:
        result = export_checkpoint(ckpt, out, options, progress=progress, note=note)
    except ExportError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt as e:
        how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        click.echo(f"{how}: {out} is as it was (the temporary folder was removed)", err=True)
        sys.exit(EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED)
    finally:
        if progress is not None:
            progress.stop()
    if not quiet:
        _summary(result, time.perf_counter() - t0)
    if onnx:
        sys.exit(_write_onnx(result.out, quiet, EXIT_ONNX_NOT_WRITTEN))


def _write_onnx(folder: Path, quiet: bool, exit_on_error: int) -> int:
    from .onnx_export import build_onnx_files

    t0 = time.perf_counter()
    try:
        with sigterm_as_interrupt():  # SIGTERM unwinds like Ctrl-C: the partly written files are removed
            files = build_onnx_files(folder)
    except ExportError as e:
        click.echo(f"error: {e}", err=True)
        return exit_on_error
    except KeyboardInterrupt as e:
        how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        click.echo(f"{how}: the ONNX graphs of {folder} were not written (no partial file was left)", err=True)
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    if not quiet:
        names = ", ".join(p.name for p in (files.verify, files.draft) if p is not None)
        click.echo(f"  ONNX: {names} + {files.data.name} ({files.data.stat().st_size / MIB:.1f} MiB) "
                   f"in {time.perf_counter() - t0:.1f} s")
    return 0


def _summary(result, seconds: float) -> None:
    m = result.manifest
    size = sum(p.stat().st_size for p in result.out.iterdir() if p.is_file())
    mtp = f"MTP block D={m.mtp.block_size}, mask id {m.mtp.mask_token_id}" if m.mtp else "AR-only (no bitmtp.json)"
    caps = ", ".join(str(s.capacity) for s in m.kv.segments)
    click.echo(f"exported {m.source['kind']} ({m.source['architecture']}, {m.model.num_layers} layers, "
               f"{m.quant.weights} ternary, activations {m.quant.activations}) -> {result.out}")
    click.echo(f"  {mtp}; widths {m.widths}; KV segments [{caps}] ({m.kv.dtype}, workspace {m.kv.workspace})"
               + (f", budget {m.kv.budget_bytes / MIB:.0f} MiB" if m.kv.budget_bytes else ""))
    click.echo(f"  {size / MIB:.1f} MiB in {seconds:.1f} s")


if __name__ == "__main__":
    main()
