"""``bitmtp``: the command line, a thin shell over the Python API (``bitmtp_edge.Engine``).

Commands: ``generate``, ``demo``, ``chat``, ``bench``, ``tune``, ``doctor`` and ``serve``; exporting is
``bitmtp-export`` (the ``export`` package sits above the runtime). Nothing heavy is imported when this module loads: ``--help``
is instant and ``doctor`` can report a broken torch install instead of dying on it.
Errors a user can cause become ``click.ClickException`` naming the file or option and
what to do.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime
from pathlib import Path

import click

from ..format.config import DEFAULT_CANDIDATES
from ..runtime.policies import POLICIES

# Copies of engine.BACKENDS, RuntimeOptions.PRESETS, fast_model.HEADS and bench.MONITOR_CHOICES, so that building
# the options imports neither torch nor the bench (``--help`` stays fast); tests/test_cli.py and
# tests/test_cli_inputs.py check that they agree.
MONITOR_CHOICES = ("auto", "tegrastats", "jtop", "nvml", "psutil", "none")
BACKEND_NAMES = ("auto", "reference", "ampere", "server")
RUNTIME_NAMES = ("generic", "m1", "m1+m2", "full")
HEAD_NAMES = ("16bit", "int8", "certified")
DRAFT_HEAD_NAMES = ("auto", "int8", "int4")
ARGV_KEY = "bitmtp.argv"


class _ClickLogHandler(logging.Handler):
    """Library warnings (power posture, monitor failures) as ``warning: ...`` lines on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"{record.levelname.lower()}: {record.getMessage()}", err=True)


def _setup_logging() -> None:
    lib = logging.getLogger("bitmtp_edge")
    if not any(isinstance(h, _ClickLogHandler) for h in lib.handlers):
        handler = _ClickLogHandler(logging.WARNING)
        lib.addHandler(handler)


class _Main(click.Group):
    def make_context(self, info_name, args, parent=None, **extra):
        argv = list(args)  # parsing consumes the list: keep the exact command line for results
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta[ARGV_KEY] = argv
        return ctx


def _command_line(ctx: click.Context) -> str:
    from .bench import command_line

    return command_line(["bitmtp", *ctx.meta.get(ARGV_KEY, sys.argv[1:])])


def _load_engine(artifact, backend, device, runtime: str = "full", head: str = "16bit", candidates=(),
                 draft_head: str = "auto"):
    """``candidates``: the fused candidate counts asked for; a graph backend captures their
    replay states at load (else the first fused step of another c than the default captures
    its own, a stall mid-generation)."""
    from ..backends.graph import RuntimeOptions
    from ..backends.precompile import PrecompileError
    from ..format.manifest import ArtifactError
    from ..runtime.engine import Engine

    from .live import CaptureProgress

    options = RuntimeOptions.preset(runtime, fused_candidates=tuple(sorted(set(candidates)))) if candidates else runtime
    bar = CaptureProgress()
    try:
        eng = Engine.load(artifact, backend=backend, device=device, runtime=options, progress=bar, head=head,
                          draft_head=draft_head)
    except PrecompileError as e:  # a kernel that does not compile here: not the artifact's fault
        raise click.ClickException(str(e)) from None
    except (ArtifactError, ValueError) as e:
        # the hint only where the artifact is at fault, not for --device or BITMTP_CPU_THREADS
        embedded = artifact is None and isinstance(e, ArtifactError)
        hint = " (this is the embedded model; pass --artifact OUT/ for another)" if embedded else ""
        raise click.ClickException(f"{e}{hint}") from None
    finally:
        bar.close()
    captured = getattr(eng.backend, "graphs", None)
    if captured:
        split = eng.startup
        compiled = (f"compiled {split['kernels_precompiled']} kernel variants in {split['precompile_s']:.1f} s, "
                    if split.get("precompile_s") else "")
        click.echo(f"loaded in {split.get('total_s', 0.0):.1f} s: {compiled}captured {len(captured)} CUDA graphs "
                   f"in {eng.backend.capture_s:.1f} s", err=True)
    return eng


def policy_for(eng, policy: str | None) -> str:
    """The policy ``generate``, ``chat`` and ``serve`` run, one rule for all three: left out, it
    is the best the model supports (hybrid; ar for an AR-only model, said in one line); an MTP
    policy asked for by name on an AR-only model is refused before anything runs, never
    silently replaced by another (a user comparing policies must not get ar numbers)."""
    if eng.manifest.mtp is not None:
        return policy or "hybrid"
    if policy is None:
        click.echo(f"note: {eng.path} is AR-only (no MTP block): decoding with policy ar", err=True)
        return "ar"
    if policy != "ar":
        raise click.ClickException(f"--policy {policy}: {eng.path} is AR-only (no MTP block); "
                                   "use --policy ar or leave --policy out")
    return policy


artifact_option = click.option("--artifact", "-a", type=click.Path(file_okay=False), default=None,
                               help="Artifact folder from bitmtp-export (default: the embedded model).")
backend_option = click.option("--backend", type=click.Choice(BACKEND_NAMES), default="auto", show_default=True)
device_option = click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
head_option = click.option("--head", type=click.Choice(HEAD_NAMES), default="16bit", show_default=True,
                           help="The verify role's head: 16bit (the checkpoint's, exact); int8 (the draft head in "
                                "every role: half the head's bytes per step, the 16-bit head not loaded; the greedy "
                                "text differs at near-ties); or certified (the 16-bit head's tokens, exactly, read from "
                                "the int8 head in the greedy AR, verify and fused steps wherever a bound proves them, "
                                "the fused step's next drafts then the int8 head's; docs/runtime.md, \"The certified "
                                "head\").")
draft_head_option = click.option(
    "--draft-head", type=click.Choice(DRAFT_HEAD_NAMES), default="auto", show_default=True,
    help="The draft role's head: int8 (the artifact's); int4 (quantised from the 16-bit head at load: half the int8 "
         "head's bytes per draft step, for large vocabularies on a board; drafts differ at near-ties, what is "
         "committed does not, except hybrid's unverified prefixes); auto: FP8 on --backend server, else int8.")
runtime_option = click.option("--runtime", type=click.Choice(RUNTIME_NAMES), default="full", show_default=True,
                              help="Fast backends: the ablation configuration (docs/runtime.md §Ablation presets).")
tau_help = "Confidence threshold τ [default: the model's]."
m_help = "Hybrid: commit without verifying when h ≥ m [default: the model's]."


def decoding_options(command):
    """--policy, --max-new-tokens, --tau, --min-prefix and sampling: one decode's settings (generate, chat)."""
    for option in reversed((
        click.option("--policy", type=click.Choice(POLICIES), default=None,
                     help="Decoding policy [default: hybrid, or ar for an AR-only model]."),
        click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True),
        click.option("--tau", type=click.FloatRange(0, 1, min_open=True), default=None, help=tau_help),
        click.option("--min-prefix", "-m", type=click.IntRange(min=1), default=None, help=m_help),
        click.option("--temperature", "-t", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     help="0 = greedy; above 0 samples (speculative/hybrid verify by speculative sampling)."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off."),
        click.option("--seed", type=click.IntRange(min=0), default=None, help="Same seed, same text."),
    )):
        command = option(command)
    return command


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="bitmtp-edge")
def main() -> None:
    """BitMTP Edge: multi-token decoding for ternary LLMs on Jetson and server GPUs."""
    _setup_logging()


# ----------------------------------------------------------------------------- generate, demo


@main.command()
@click.argument("prompt")
@artifact_option
@backend_option
@device_option
@head_option
@draft_head_option
@decoding_options
@click.option("--candidates", "-c", type=click.IntRange(min=1), default=None,
              help="Policy fused: draft blocks per pass (the c likeliest acceptance lengths; 1..D + 1) "
                   "[default: chosen per pass from the step costs timed at load (graph backends), "
                   f"else {DEFAULT_CANDIDATES}].")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats).")
def generate(prompt, artifact, backend, device, head, draft_head, policy, max_new_tokens, tau, min_prefix, temperature, top_p, top_k,
             seed, candidates, stop, as_json):
    """Complete PROMPT with the chosen decoding policy."""
    from ..runtime.decoding import DecodingError

    eng = _load_engine(artifact, backend, device, head=head, candidates=(candidates,) if candidates else (),
                       draft_head=draft_head)
    policy = policy_for(eng, policy)
    try:
        res = eng.generate(prompt, max_new_tokens=max_new_tokens, policy=policy, tau=tau,
                           min_prefix=min_prefix, stop=list(stop) or None, candidates=candidates,
                           sampling=_sampling(temperature, top_p, top_k, seed))
    except DecodingError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": res.stats.to_dict()}))
        return
    click.echo(prompt + res.text)
    s = res.stats
    certified = (f"the int8 head answered {s.certified_head_int8} of {s.certified_head_calls} greedy head calls, "
                 if s.certified_head_calls else "")
    click.echo(f"\n[{policy}] {s.new_tokens} tokens, {s.decode_tokens_per_s:.1f} tok/s, "
               f"{s.tokens_per_iteration:.2f} tokens/iteration, {s.verifier_calls} verifier calls, {certified}"
               f"stopped: {s.finish_reason}", err=True)


@main.command()
@artifact_option
@backend_option
@device_option
@head_option
@draft_head_option
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=96, show_default=True)
@click.option("--policy", type=click.Choice([p for p in POLICIES if p != "ar"]), default="hybrid",
              show_default=True)
@click.option("--json", "as_json", is_flag=True)
def demo(artifact, backend, device, head, draft_head, max_new_tokens, policy, as_json):
    """Complete held-out code prompts with AR and with multi-token decoding; report the speedup."""
    from ..runtime.decoding import DecodingError
    from .bench import BenchError
    from .demo import run_demo

    eng = _load_engine(artifact, backend, device, head=head, draft_head=draft_head)
    try:
        report = run_demo(eng, max_new_tokens=max_new_tokens, policy=policy, echo=None if as_json else click.echo)
    except (DecodingError, BenchError) as e:  # BenchError: a malformed prompts.jsonl beside the artifact
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(report, indent=2))


# ----------------------------------------------------------------------------- chat


@main.command()
@artifact_option
@backend_option
@device_option
@head_option
@draft_head_option
@decoding_options
@click.option("--no-history", is_flag=True, help="Answer each turn alone (no running transcript).")
@click.pass_context
def chat(ctx, artifact, backend, device, head, draft_head, policy, max_new_tokens, tau, min_prefix, temperature, top_p, top_k, seed,
         no_history):
    """Interactive session: type text, watch the model continue it (streamed), with live
    tok/s and tokens per iteration. Commands: /quit, /policy [NAME], /reset, /help."""
    from .chat import ChatSession
    from .chat_loop import run_chat
    from ..runtime.decoding import DecodingError

    eng = _load_engine(artifact, backend, device, head=head, draft_head=draft_head)
    policy = policy_for(eng, policy)
    try:
        session = ChatSession(eng, policy=policy, max_new_tokens=max_new_tokens, tau=tau, min_prefix=min_prefix,
                              sampling=_sampling(temperature, top_p, top_k, seed),
                              keep_history=not no_history)
    except DecodingError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"bitmtp chat — {eng.path} on {eng.backend.name}/{eng.device}, policy {session.policy}. "
               "/help for commands, /quit to leave.", err=True)
    run_chat(session, sys.stdin, interactive=sys.stdin.isatty() and sys.stdout.isatty())


def _sampling(temperature, top_p, top_k, seed):
    from ..runtime.sampling import SamplingError, SamplingParams

    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except SamplingError as e:
        raise click.BadParameter(str(e)) from None


# ----------------------------------------------------------------------------- bench


def _parse_policies(ctx, param, value):
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        what = f"unknown policy {unknown[0]!r}" if unknown else "no policy given"
        raise click.BadParameter(f"{what}; choose from {', '.join(POLICIES)} (comma-separated)")
    return tuple(dict.fromkeys(names))


@main.command()
@artifact_option
@backend_option
@device_option
@head_option
@draft_head_option
@runtime_option
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="JSONL workload, one {\"prompt\": ...} per line [default: the held-out prompts beside the "
                   "artifact (prompts.jsonl), else built-in code prompts].")
@click.option("--num-prompts", type=click.IntRange(min=0), default=None,
              help="Use the first N prompts (0: all) [default: 8; 2 on a CPU].")
@click.option("--policies", callback=_parse_policies, default=None, metavar="LIST",
              help=f"Comma-separated routes from {','.join(POLICIES)} [default: all the model supports]. "
                   "Put ar in for speedups.")
@click.option("--tau", multiple=True, type=click.FloatRange(0, 1, min_open=True),
              help=tau_help + " Repeat to sweep.")
@click.option("--min-prefix", "-m", multiple=True, type=click.IntRange(min=1), help=m_help + " Repeat to sweep.")
@click.option("--candidates", "-c", multiple=True, type=click.IntRange(min=1),
              help="Policy fused: draft blocks per pass [default: chosen per pass from the step costs timed at "
                   f"load (graph backends), else {DEFAULT_CANDIDATES}]. Repeat to sweep.")
@click.option("--block-size", "-D", type=click.IntRange(min=2), default=None,
              help="Must be the D the model was trained for [default: the artifact's].")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=None,
              help="[default: 128; 32 on a CPU].")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Discarded runs per route (first prompt).")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help="Measured runs per route and prompt (medians are reported) [default: 3; 1 on a CPU].")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly --max-new-tokens every run (fixed lengths).")
@click.option("--strict", is_flag=True, help="Refuse on a Jetson not at MAXN/MAXN_SUPER with locked clocks.")
@click.option("--monitor", type=click.Choice(MONITOR_CHOICES), default="auto", show_default=True,
              help="Power/thermal source: auto = tegrastats or jtop on a Jetson, NVML on a GPU host, else psutil.")
@click.option("--interval-ms", type=click.IntRange(min=10), default=100, show_default=True,
              help="Monitor sampling interval.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for bench.json, bench.md and the plots [default: ./bench-<date>-<time>].")
@click.option("--json", "as_json", is_flag=True, help="Print bench.json to stdout instead of the table.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
@click.pass_context
def bench(ctx, artifact, backend, device, head, draft_head, runtime, prompts_file, num_prompts, policies, tau, min_prefix, candidates,
          block_size, max_new_tokens, warmup, repeats, ignore_eos, strict, monitor, interval_ms, out_dir, as_json,
          quiet):
    """Benchmark AR and each decoding policy with power monitoring.

    Per route: decode tok/s, tokens per iteration, verifier-call rate, speedup over AR,
    average power, energy per token (J/token), peak temperatures, clocks, memory, and
    the board's power posture. Writes bench.json, bench.md, bench.csv and PNG plots to --out.
    On a CPU the defaults are smaller (a few minutes, not hours). Ctrl-C stops early and
    still writes what was measured, marked partial.
    """
    from . import bench as B
    from .bench_report import ReportError, write_report
    from .live import BenchProgress
    from .tables import print_bench_table
    from ..jetson.monitor import SourceUnavailable
    from ..jetson.posture import PostureError, check_posture

    try:
        prompts = B.load_prompts(prompts_file) if prompts_file else None
    except B.BenchError as e:
        raise click.ClickException(str(e)) from None
    try:
        posture = check_posture(strict)  # before loading: a refused board costs nothing
    except PostureError as e:
        raise click.ClickException(str(e)) from None
    if not posture.on_jetson and not quiet:
        click.echo("note: not a Jetson: power-mode and clock checks skipped", err=True)

    eng = _load_engine(artifact, backend, device, runtime, head, candidates, draft_head=draft_head)
    sizes = B.CPU_DEFAULTS if eng.device.type == "cpu" else B.GPU_DEFAULTS
    num_prompts = sizes["num_prompts"] if num_prompts is None else num_prompts
    max_new_tokens = sizes["max_new_tokens"] if max_new_tokens is None else max_new_tokens
    repeats = sizes["repeats"] if repeats is None else repeats
    if eng.device.type == "cpu" and not quiet:
        click.echo(f"note: CPU defaults: {num_prompts} prompts, {max_new_tokens} new tokens, {repeats} repeat(s) "
                   "(--num-prompts, --max-new-tokens, --repeats for more)", err=True)
    try:
        config = B.BenchConfig(max_new_tokens=max_new_tokens, warmup=warmup, repeats=repeats, ignore_eos=ignore_eos,
                               strict=strict, monitor=monitor, interval_s=interval_ms / 1000)
    except B.BenchError as e:
        raise click.ClickException(str(e)) from None
    if block_size is not None and block_size != eng.block_size:
        have = f"D={eng.block_size}" if eng.block_size else "no MTP block (AR-only)"
        raise click.ClickException(f"--block-size {block_size}: {eng.path} was trained with {have}; "
                                   "drop --block-size or pass the artifact's D")
    try:
        if prompts is None:
            prompts, source = B.builtin_prompts(eng)
        else:
            source = str(prompts_file)
        prompts = prompts[:num_prompts] if num_prompts else prompts
        routes = B.make_routes(eng, policies, tau, min_prefix, candidates)
    except B.BenchError as e:
        raise click.ClickException(str(e)) from None
    out = Path(out_dir) if out_dir else Path(f"bench-{datetime.now():%Y%m%d-%H%M%S}")
    show_bar = not quiet and sys.stderr.isatty()
    try:
        report = B.run_bench(eng, prompts, routes, config, posture=posture,
                             progress=BenchProgress() if show_bar else None,
                             command=_command_line(ctx), workload_source=source)
    except B.BenchError as e:
        raise click.ClickException(str(e)) from None
    except SourceUnavailable as e:
        raise click.ClickException(f"--monitor {monitor}: {e}; choose another --monitor (or none)") from None
    if report.partial and not any(not r.warmup for r in report.runs):
        # Nothing measured (Ctrl-C during the warm-up): an empty report would only replace
        # the results of an earlier run in the same --out.
        kept = f" ({out} is left as it was)" if out.exists() else ""
        click.echo(f"interrupted before any measured run ({len(report.runs)} warm-up run(s) done): "
                   f"nothing written{kept}", err=True)
        sys.exit(130)
    data = report.to_dict()
    try:
        paths, unsaved = write_report(data, out), None
    except ReportError as e:  # still show what was measured: the runs may have taken an hour
        paths, unsaved = [], e
    if as_json:
        click.echo(json.dumps(data, allow_nan=False))
    elif not quiet or unsaved is not None:
        print_bench_table(data)
    if unsaved is not None:
        raise click.ClickException(f"{unsaved} (the numbers measured are printed above)")
    if not as_json:
        click.echo(f"wrote {', '.join(str(p) for p in paths)}", err=True)
    if report.partial:
        click.echo(f"interrupted: wrote the {len(report.runs)} of {report.planned_runs} runs measured "
                   "(marked partial)", err=True)
        sys.exit(130)  # the shell's code for Ctrl-C


# ----------------------------------------------------------------------------- tune

TUNE_MODELS = ("bitnet-2b", "bonsai-1.7b", "bitmtp-27m", "bitnet-3b")  # kernels_ampere.autotune.MODEL_SHAPES
TUNE_WIDTHS = "1,2,5,9,16,27,40,80"  # AR, drafts and verify blocks up to the widest tree


@main.command()
@click.option("--models", default="bitnet-2b,bitmtp-27m", show_default=True, metavar="LIST",
              help=f"Comma list of models whose layer shapes are tuned: {', '.join(TUNE_MODELS)}.")
@click.option("--shapes", default=None, metavar="LIST",
              help="Extra single shapes NxK (append g for group-128 scales), e.g. 3840x2560,2048x2048g.")
@click.option("--widths", default=TUNE_WIDTHS, show_default=True, metavar="LIST", help="Comma list of widths M.")
@click.option("--weight-only", is_flag=True, help="Tune the W2A16 linear (bf16 activations) instead of W2A8.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Table to write [default: kernels_ampere/tuned/<gpu>.json, which the runtime and bench read].")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Compile processes [default: min(8, CPUs)].")
def tune(models, shapes, widths, weight_only, out, jobs):
    """Tune the packed-linear kernels for this GPU and write its table, which the runtime and
    `bitmtp bench` then use (a GPU without one gets defaults sized from its SM count).

    Every candidate is checked against its pure-PyTorch twin before it is timed; a model's
    projections are chosen as a layer. Needs CUDA.
    """
    for name in filter(None, models.split(",")):
        if name not in TUNE_MODELS:
            raise click.BadParameter(f"unknown model {name!r}; known: {', '.join(TUNE_MODELS)} (or use --shapes)",
                                     param_hint="--models")
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a Jetson wheel for another JetPack: say so, not a traceback
        raise click.ClickException(f"tune needs a CUDA GPU and a working torch, and torch cannot be imported "
                                   f"({type(e).__name__}: {e}); `bitmtp doctor` says more") from None
    if not torch.cuda.is_available():
        raise click.ClickException("tune needs a CUDA GPU (none is visible to torch); tables are per GPU model")
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise click.ClickException("tune times Triton kernels and Triton is not installed: "
                                   "pip install 'bitmtp-edge[triton]'")
    try:
        from kernels_ampere.autotune import main as autotune_main
    except ImportError as e:
        raise click.ClickException(f"tune cannot load its kernels ({e}); `bitmtp doctor` says more") from None

    argv = ["--widths", widths, "--op", "w2a16_linear" if weight_only else "w2a8_linear"]
    if models:
        argv += ["--models", models]
    if shapes:
        argv += ["--shapes", shapes]
    if out:
        argv += ["--out", out]
    if jobs:
        argv += ["--jobs", str(jobs)]
    try:
        rc = autotune_main(argv)
    except SystemExit as e:  # autotune's argument errors name the option
        raise click.ClickException(str(e)) from None
    if rc:
        raise click.ClickException(f"tune failed (autotune exit status {rc})")


# ----------------------------------------------------------------------------- doctor


@main.command()
@click.option("--artifact", "-a", type=click.Path(file_okay=False), default=None,
              help="Artifact folder to verify (default: the embedded model).")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as one JSON object.")
def doctor(artifact, as_json):
    """Check this machine: Python, torch, Triton, GPU, the backend `auto` picks, Jetson board
    and power posture, monitoring sources, and the artifact's checksums.

    Exits 1 when a check fails (e.g. torch cannot be imported, or the --artifact is broken).
    """
    from .doctor import run_doctor, verdict

    checks = run_doctor(artifact)
    failed = any(c.status == "fail" for c in checks)
    if as_json:
        click.echo(json.dumps({"checks": [c.to_dict() for c in checks], "verdict": verdict(checks), "ok": not failed},
                              default=str))
    else:
        marks = {"ok": click.style("✓", fg="green"), "info": "·", "warn": click.style("!", fg="yellow"),
                 "fail": click.style("✗", fg="red")}
        for c in checks:
            click.echo(f"{marks[c.status]} {c.name:<10} {c.summary}")
        click.echo(verdict(checks))
    if failed:
        sys.exit(1)


# ----------------------------------------------------------------------------- serve


@main.command()
@artifact_option
@backend_option
@device_option
@head_option
@draft_head_option
@runtime_option
@click.option("--host", default=None, help="Serve the OpenAI-compatible HTTP API on this address [default with "
                                           "--port: 127.0.0.1; 0.0.0.0 for every interface].")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Serve the OpenAI-compatible HTTP API on this port (see bitmtp_edge/app/http_server.py).")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), default=None,
              help="Listen on this UNIX socket (JSON lines) [default without --port/--socket: JSON lines on "
                   "stdin, replies on stdout].")
@click.option("--policy", type=click.Choice(POLICIES), default=None,
              help="Default policy of requests [default: hybrid, or ar for an AR-only model].")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True,
              help="Default max_new_tokens (HTTP: max_tokens) of requests.")
@click.option("--model-name", default=None, help="HTTP: the model id clients send [default: the artifact folder's "
                                                 "name, bitmtp-embedded for the embedded model].")
@click.option("--max-queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="HTTP: requests that may wait behind the running one; more get 503.")
@click.option("--monitor", type=click.Choice(["none", *MONITOR_CHOICES]), default="none", show_default=True,
              help="HTTP: a power source for /metrics (watts, joules per token).")
@click.option("--stream-interval-ms", type=click.FloatRange(min=0, max=1000), default=5.0, show_default=True,
              help="HTTP streaming: at most one SSE chunk per this many ms; tokens decoded faster share a chunk "
                   "(0: a chunk per wake-up of the server's event loop).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="One log line per request at info.")
@click.option("--no-warmup", is_flag=True, help="Skip the warm-up generations at start.")
def serve(artifact, backend, device, head, draft_head, runtime, host, port, socket_path, policy, max_new_tokens, model_name, max_queue,
          monitor, stream_interval_ms, log_level, no_warmup):
    """Keep one model loaded (graphs captured, kernels warm) and answer requests: with
    --port, the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics); else JSON lines {"prompt": ..., "max_new_tokens": 64} on a
    --socket or stdin (bitmtp_edge/app/serve.py has the protocol)."""
    from ..jetson.posture import read_posture
    from .serve import ServeDefaults, UnixServer, info, serve_lines, warm_up

    if port is not None and socket_path is not None:
        raise click.UsageError("give --port (HTTP) or --socket (JSON lines), not both")
    if host is not None and port is None:
        raise click.UsageError("--host needs --port (e.g. --host 0.0.0.0 --port 8000)")
    logging.getLogger("bitmtp_edge").setLevel(log_level.upper())
    posture = read_posture()
    for w in posture.warnings if posture.on_jetson else ():
        click.echo(f"warning: power posture: {w}", err=True)
    t0 = time.perf_counter()
    eng = _load_engine(artifact, backend, device, runtime, head, draft_head=draft_head)
    if not no_warmup:
        warm_up(eng)
    default_policy = policy_for(eng, policy)
    if port is not None:
        _serve_http(eng, host or "127.0.0.1", port, default_policy, max_new_tokens, model_name, max_queue, monitor,
                    log_level, artifact is None, t0, stream_interval_ms / 1e3)
        return
    defaults = ServeDefaults(policy=default_policy, max_new_tokens=max_new_tokens)
    where = socket_path or "stdin"
    click.echo(f"bitmtp serve: {json.dumps(info(eng))} ready in {time.perf_counter() - t0:.1f} s on {where}", err=True)
    if socket_path is None:
        import threading

        served = serve_lines(eng, sys.stdin, sys.stdout, threading.Lock(), defaults)
        click.echo(f"bitmtp serve: end of input after {served} request(s)", err=True)
        return
    import signal

    def _stop(signum, frame):  # systemd stops with SIGTERM: leave through the finally below
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)  # before binding: no moment where the socket could be left behind
    try:
        server = UnixServer(socket_path, eng, defaults)
    except OSError as e:
        raise click.ClickException(f"--socket {socket_path}: {e}") from None
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _serve_http(eng, host, port, policy, max_new_tokens, model_name, max_queue, monitor, log_level, embedded, t0,
                stream_interval_s):
    from .http_server import ServerConfig, create_app, generation_defaults, make_server

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    http_log = logging.getLogger("bitmtp_edge.http")
    http_log.addHandler(handler)
    http_log.propagate = False  # the CLI's warning handler would print each request line twice
    sampler = None
    if monitor != "none":
        from ..jetson.monitor import Sampler

        try:
            sampler = Sampler(monitor).start()
        except Exception as e:
            raise click.ClickException(f"--monitor {monitor}: {e}; choose another source or --monitor none") from None
    name = model_name or ("bitmtp-embedded" if embedded else eng.path.name)
    config = ServerConfig(model_name=name, policy=policy, max_tokens=max_new_tokens, max_queue=max_queue,
                          stream_interval_s=stream_interval_s, sampling_defaults=generation_defaults(eng))
    server = make_server(create_app(eng, config, sampler), host, port, log_level)
    click.echo(f"bitmtp serve: model {name!r} ({eng.backend.name}/{eng.device}) ready in "
               f"{time.perf_counter() - t0:.1f} s on http://{host}:{port}/v1", err=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on
        pass
    finally:
        if sampler is not None:
            sampler.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
