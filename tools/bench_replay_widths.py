"""Replay cost of chosen widths of the BitNet-2B shape under several W2A8 tables, per kernel.

The random-weight BitNet-2B artifact of ``bench_e2e.py`` (D = 8) loads once on the graph
backend (runtime ``full``); for each tuned table given (``--tables name=folder``, a folder
holding ``<gpu>.json``; ``shipped`` = ``kernels_ampere/tuned``) the replay states of the
asked widths are captured again with that table's launches and timed as ``bench_e2e.py``
times them (history length reset before every replay, the reset's own time subtracted):
width 1 = the AR replay, every other width = the fused state of that width (D = 8: 16, 24,
32, 40, after a fused hit and after a draft step alike), ``dM`` = the draft step of width
M (D + 1 .. 2D), ``v9`` = the verify (D + 1; ``states``). ``--profile`` widths are then
replayed under ``torch.profiler``: the kernels of one replay grouped by name, GPU µs each
(kernel durations overlap under programmatic launch, so their sum can exceed the replay: a
kernel starts early and waits for its producer; a table named ``<name>-nopdl`` is captured
without programmatic launch, so its kernels run one after another and their durations add up;
one named ``<name>-noahead`` without the W2A8 launches asking the L2 for the next one's weights,
``common.prefetch_next``).

    python tools/bench_replay_widths.py --tables before=/tmp/old,after=shipped --widths 1,d9,d16,16,32,33,40 \\
        --profile 32,33 --out /tmp/replays

Writes ``replay_widths.json`` and ``replay_widths.md`` under ``--out``.

``--sms N`` runs the whole engine on N SMs of the GPU (a CUDA green context: an Orin NX's 8,
an AGX Orin's 16): the untuned defaults are sized for N (``BITMTP_SM_COUNT``), every graph is
captured on the partition's stream, and before anything is timed a probe kernel captured the
same way must reach exactly N SMs (else the run stops: this torch or driver does not keep a
graph's kernels in the green context). ``--tables board=none`` times the SM-count defaults
(no table: what a board without one launches).

    python tools/bench_replay_widths.py --sms 8 --tables board=none --widths 1,d9,16,32 --profile "" \
        --out /tmp/replays_sm8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitmtp_edge import Engine  # noqa: E402
from bitmtp_edge.backends.fast_model import HEADS  # noqa: E402
from bitmtp_edge.backends.fused_graph import fused_width  # noqa: E402
from bitmtp_edge.runtime.replay import ReplayState  # noqa: E402
from kernels_ampere import tuning  # noqa: E402
from kernels_ampere.autotune import precompile  # noqa: E402
from tools.bench_e2e import BITNET_2B, cuda_ms, export, make_random_bitnet_2b  # noqa: E402
from tools.provenance import commit  # noqa: E402

PROMPT_LEN = 32


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_tables(text: str) -> dict[str, Path]:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, folder = item.partition("=")
        if not folder:
            raise SystemExit(f"bench_replay_widths: --tables item {item!r} is not name=folder")
        if folder == "shipped":
            path = tuning.TUNED_DIR
        elif folder == "none":  # an empty folder: every launch takes the SM-count defaults
            path = Path(tempfile.mkdtemp(prefix="bitmtp_no_table_"))
        else:
            path = Path(folder)
        if not path.is_dir():
            raise SystemExit(f"bench_replay_widths: --tables {name}: {path} is not a folder (it holds <gpu>.json)")
        out[name] = path
    return out


def use_table(folder: Path) -> None:
    """Every later lookup reads this folder's table (the launchers look up at capture)."""
    tuning.TUNED_DIR = folder
    tuning.load_table.cache_clear()


def states(block: int, labels: list[str]) -> dict[str, ReplayState]:
    """The replay state of each ``--widths`` label: ``1`` = the AR replay, a fused width (D = 8:
    16, 24, .., D causal rows and c blocks) = that fused state, ``dM`` = the draft
    step of width M (D + 1 .. 2D: k pending rows and D masks), ``vM`` = the verify of width M
    (D + 1)."""
    fused = {fused_width(block, block, c) for c in range(1, block + 1)}
    out = {}
    for label in labels:
        role, digits = {"d": ("draft", label[1:]), "v": ("verify", label[1:])}.get(label[:1], ("", label))
        if not digits.isdigit():
            raise SystemExit(f"bench_replay_widths: width {label!r} is not M, dM (draft) or vM (verify)")
        w = int(digits)
        if role == "draft" and block + 1 <= w <= 2 * block or role == "verify" and w in (1, block + 1):
            out[label] = ReplayState(w, 0, role)
        elif not role and w == 1:
            out[label] = ReplayState(1, 0, "verify")
        elif not role and w in fused:
            out[label] = ReplayState(w, 0, "fused")
        else:
            raise SystemExit(f"bench_replay_widths: width {label!r} is not a replay state: 1, a fused width "
                             f"({sorted(fused)}), d{block + 1}..d{2 * block} (draft) or v1 / v{block + 1} (verify)")
    return out


def precompile_table(eng: Engine, widths: list[int], jobs: int) -> None:
    """Compile the table's W2A8 launches of the model's projections at ``widths`` in worker
    processes (Triton's disk cache), so capture only loads them."""
    fast = eng.backend.fast
    layer = fast.layers[0]
    projections = [(layer.qkv, False), (layer.o, True), (layer.gate_up, False), (layer.down, True)]
    work = []
    for m in widths:
        for proj, residual in projections:
            n, k = proj.packed.shape[0], proj.packed.shape[1] * 4
            key = tuning.linear_key(n, k, m, proj.scale.dim() == 2)
            cfg = tuning.lookup("w2a8_linear", key, proj.packed.device)
            work.append(("w2a8_linear", n, k, key["scales"] == "group128", m, residual, cfg))
    precompile(work, jobs)


def time_states(eng: Engine, wanted: dict[str, ReplayState], repeats: int, pdl: bool = True,
                ahead: bool = True) -> dict[str, float]:
    from kernels_ampere.common import prefetch_next, programmatic_launch

    b = eng.backend
    b.static.history_len.fill_(PROMPT_LEN)
    b.kv.length = PROMPT_LEN
    pdl_before, ahead_before = programmatic_launch(), prefetch_next()
    programmatic_launch(pdl)  # a graph keeps the launch mode it was captured with
    prefetch_next(ahead)  # and whether its launches ask the L2 for the next one's weights
    try:
        for state in wanted.values():  # this table's launches: capture again
            b._capture(state)
    finally:
        programmatic_launch(pdl_before)
        prefetch_next(ahead_before)
    reset = lambda: b.static.history_len.fill_(PROMPT_LEN)  # noqa: E731
    t_reset = cuda_ms(reset, repeats)
    out = {}
    for label, state in wanted.items():
        graph = b.graphs[state]

        def one():
            reset()
            graph.replay()

        one()
        out[label] = 1000 * (cuda_ms(one, repeats) - t_reset)
    b.reset()
    return out


def profile_state(eng: Engine, state: ReplayState, replays: int = 5) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    b = eng.backend
    graph = b.graphs[state]
    b.static.history_len.fill_(PROMPT_LEN)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            b.static.history_len.fill_(PROMPT_LEN)
            graph.replay()
        torch.cuda.synchronize()
    b.reset()
    return cuda_kernel_times(prof, replays)


def cuda_kernel_times(prof, calls: int) -> list[dict]:
    """A torch profile's GPU kernels per call (``calls`` profiled): name, launches, GPU µs,
    the costliest first."""
    rows = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            rows[evt.name][0] += 1
            rows[evt.name][1] += evt.device_time
    out = [{"kernel": name[:60], "launches": n / calls, "us": us / calls} for name, (n, us) in rows.items()]
    return sorted(out, key=lambda r: -r["us"])


def markdown(report: dict) -> str:
    widths = report["widths"]
    lines = ["# Replay cost per width, BitNet-2B shape (random weights, D = 8)", "",
             f"- device: {report['device']}" + (f", confined to {report['sms']} SMs (a CUDA green context)"
                                                if report.get("green_context") else ""),
             f"- date: {report['date']}", f"- commit: {report['commit']}",
             f"- command: `{report['command']}`",
             f"- heads: verify {report.get('head', '16bit')}, draft {report.get('draft_head', 'int8')}", "",
             "µs per replay (history 32, median-free mean of the repeats, reset subtracted); width 1 = AR, "
             "dM / vM = the draft / verify step of width M, other widths = the fused state of that width.", "",
             "| table | " + " | ".join(f"M = {w}" for w in widths) + " | " +
             " | ".join(f"M = {w} / AR" for w in widths if w != "1") + " |",
             "|---|" + "---|" * (2 * len(widths) - ("1" in widths))]
    for name, t in report["tables"].items():
        us = t["replay_us"]
        ar = us.get("1")
        lines.append(f"| {name} | " + " | ".join(f"{us[w]:.1f}" for w in widths) + " | " +
                     " | ".join(f"{us[w] / ar:.2f}x" if ar else "" for w in widths if w != "1") + " |")
    for name, t in report["tables"].items():
        for w, rows in t.get("profile", {}).items():
            total = sum(r["us"] for r in rows)
            lines += ["", f"## {name}, M = {w}: kernels of one replay (GPU µs, sum {total:.0f})", "",
                      "| kernel | launches | µs |", "|---|---|---|"]
            lines += [f"| `{r['kernel']}` | {r['launches']:.0f} | {r['us']:.1f} |" for r in rows[:12]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default="shipped=shipped", help="comma list of name=folder (shipped: the repo's)")
    ap.add_argument("--widths", default="1,16,32,33,40")
    ap.add_argument("--profile", default="32,33", help="widths whose replay is profiled per kernel")
    ap.add_argument("--profile-tables", default=None, help="comma list of the tables whose replays are profiled "
                    "(default: all); a table named '<name>-nopdl' is captured without programmatic launch")
    ap.add_argument("--artifact", type=Path, default=None, help="an exported 2B-shaped artifact (default: build one)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bitmtp_replay_widths"))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=8, help="compile processes for each table's launches")
    ap.add_argument("--head", choices=HEADS, default="16bit",
                    help="the verify role's head (Engine.load(head=...)): int8 reads the draft head in every role; "
                         "certified the 16-bit head's tokens, from the int8 rows where proven (random weights: "
                         "rarely)")
    ap.add_argument("--draft-head", choices=("int8", "int4"), default="int8",
                    help="the draft role's head (Engine.load(draft_head=...)): what the d<M> states read")
    ap.add_argument("--sms", type=int, default=0, help="run on this many SMs of the GPU (a green context; "
                    "0: all of them)")
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.sms < 0:
        raise SystemExit(f"bench_replay_widths: --sms {args.sms}: give a number of SMs (0: the whole GPU)")
    if not torch.cuda.is_available():
        print("bench_replay_widths: needs a CUDA device", file=sys.stderr)
        return 2
    tables = parse_tables(args.tables)
    with contextlib.ExitStack() as confined:
        if args.sms:
            confined.enter_context(partition(args.sms))
        return run(args, tables)


@contextlib.contextmanager
def partition(sms: int):
    """The engine on ``sms`` SMs: defaults sized for them, graphs captured in their green context."""
    from bitmtp_edge.backends.graph import capture_stream
    from tools.sm_partition_stack import enter_partition, graph_sms_reached

    before = os.environ.get(tuning.SM_COUNT_ENV)
    os.environ[tuning.SM_COUNT_ENV] = str(sms)  # read by the launchers and the compile workers
    tuning.sm_count.cache_clear()
    try:
        ctx = enter_partition(sms)  # noqa: F841 (the green context lives as long as its stream)
        stream = torch.cuda.current_stream()
        reached = graph_sms_reached(stream)
        if reached != sms:
            raise SystemExit(f"bench_replay_widths: --sms {sms}: a graph captured in the green context ran on "
                             f"{reached} SMs; this torch / driver does not confine graph kernels, nothing was timed")
        log(f"confined to {sms} SMs (a probe graph captured on the partition's stream reached {reached})")
        with capture_stream(stream):
            yield
    finally:
        if before is None:
            os.environ.pop(tuning.SM_COUNT_ENV, None)
        else:
            os.environ[tuning.SM_COUNT_ENV] = before
        tuning.sm_count.cache_clear()


def run(args, tables: dict[str, Path]) -> int:
    widths = [w.strip() for w in args.widths.split(",") if w.strip()]
    profiled = [w.strip() for w in args.profile.split(",") if w.strip()]
    art = args.artifact
    if art is None:
        log("building the random 2B-shaped checkpoint and exporting it")
        ckpt = make_random_bitnet_2b(args.work / "bitnet2b-ckpt", dict(BITNET_2B), block_size=8)
        art = export(ckpt, args.work / "bitnet2b-artifact", max_context=2048)  # as bench_e2e: segment 0 = 256 history slots
    report = {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "command": " ".join([Path(sys.argv[0]).name, *args.argv]),
              "sms": args.sms or torch.cuda.get_device_properties(0).multi_processor_count, "head": args.head,
              "draft_head": args.draft_head,
              "green_context": bool(args.sms), "widths": widths, "tables": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    eng = None
    for name, folder in tables.items():
        use_table(folder)
        if eng is None:
            log(f"loading {art} with table {name}")
            eng = Engine.load(art, backend="ampere", device="cuda", runtime="full", head=args.head,
                              draft_head=args.draft_head)
        wanted = states(eng.block_size, widths + [w for w in profiled if w not in widths])
        precompile_table(eng, sorted({state.width for state in wanted.values()}), args.jobs)
        t0 = time.perf_counter()
        pdl, ahead = "-nopdl" not in name, "-noahead" not in name
        us = time_states(eng, wanted, args.repeats, pdl, ahead)  # the profiled ones too: captured with this table
        log(f"{name}: " + ", ".join(f"M={w} {v:.1f} us" for w, v in us.items()) + f" ({time.perf_counter() - t0:.0f} s)")
        entry = {"folder": str(folder), "programmatic_launch": pdl, "next_weights_l2": ahead,
                 "replay_us": {w: round(v, 1) for w, v in us.items()}, "profile": {}}
        if args.head == "certified":  # (greedy head calls, answered by the int8 rows) over capture and timing
            entry["certified_counts"] = list(eng.backend.fast.certified_counts())
        for w in (profiled if not args.profile_tables or name in args.profile_tables.split(",") else ()):
            try:
                entry["profile"][w] = profile_state(eng, wanted[w])
            except Exception as e:  # a profiler without graph kernel records: the timings still stand
                entry["profile_error"] = f"{type(e).__name__}: {e}"[:300]
        report["tables"][name] = entry
        (args.out / "replay_widths.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "replay_widths.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
