"""Startup of the replayable runtime: cold (empty Triton cache) with and without the kernel
precompile pass, and warm; one run, one GPU.

Every measurement loads the engine in a fresh process (a process keeps compiled kernels in
memory) with its own ``TRITON_CACHE_DIR``:

* ``cold-on``: an empty cache, the default pass (compile threads: automatic; capture takes
  each state as soon as its own kernels are compiled);
* ``cold-wait``: the same, all kernels compiled before capture starts;
* ``warm-on``: the cache ``cold-on`` filled (the pass finds cold-on's warm marker and skips);
* ``cold-off``: an empty cache, ``BITMTP_PRECOMPILE=0`` (capture compiles, as before the pass);
* ``cold-proc``: an empty cache, the pass with worker processes (``BITMTP_PRECOMPILE_MODE``);
* ``cold-1``: an empty cache, the pass on one thread (what the threads buy);
* ``warm-off``: the cache ``cold-off`` filled, no pass;
* ``warm-off-on``: the cache ``cold-on`` filled, no pass (captures as without the pass; a
  kernel the pass had not compiled would show as a new cache entry).

Each load reports its split (load / precompile / capture, ``Engine.startup``), the kernel
variants compiled (new entries in its cache folder, launchers among them) and the variants
capture entered Triton's compile path for (by specialisation key: those the pass had not
requested are listed); the modes that decode (AR and fused) must give the same tokens,
and time an AR decode after the first (replays: the same kernels must run as fast).
The artifact: BitNet-2B shape with random weights and a D = 8 MTP block (``bench_e2e``'s
``make_random_bitnet_2b``), or ``--artifact``.

    python tools/bench_startup.py [--artifact DIR] [--modes cold-on,warm-on,cold-off,cold-wait,cold-proc,cold-1] [--out DIR]
    python tools/bench_startup.py --out DIR --before BEFORE/startup.json   # add an earlier checkout's run

Writes ``startup.json`` and ``startup.md`` under ``--out`` (default ``tools/results``).
``tools/h200_coldstart.sh`` runs the modes that decide the open questions in one device call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.provenance import commit  # noqa: E402

# mode -> (description, environment, compile workers (0: automatic), cache: "fresh" or the
# mode whose cache it reuses, decode: whether it decodes the tokens every run must agree on)
MODES = {
    "cold-on": ("cold, precompile on (threads, capture overlaps)", {"BITMTP_PRECOMPILE": "1"}, 0, "fresh", True),
    "cold-wait": ("cold, precompile on (threads, all compiled before capture)",
                  {"BITMTP_PRECOMPILE": "1", "BITMTP_PRECOMPILE_OVERLAP": "0"}, 0, "fresh", False),
    "warm-on": ("warm, precompile on", {"BITMTP_PRECOMPILE": "1"}, 0, "cold-on", True),
    "cold-off": ("cold, precompile off", {"BITMTP_PRECOMPILE": "0"}, 0, "fresh", True),
    "warm-off": ("warm, precompile off", {"BITMTP_PRECOMPILE": "0"}, 0, "cold-off", False),
    "cold-proc": ("cold, precompile on (processes)", {"BITMTP_PRECOMPILE": "1", "BITMTP_PRECOMPILE_MODE": "processes"},
                  0, "fresh", True),
    "warm-off-on": ("warm (cache of cold-on), precompile off", {"BITMTP_PRECOMPILE": "0"}, 0, "cold-on", True),
    "cold-1": ("cold, precompile on 1 thread", {"BITMTP_PRECOMPILE": "1"}, 1, "fresh", False),
}
PROMPT = list(range(10, 42))
MIN_LOAD_S = 15.0  # a load given less time than this under --budget is skipped, not started


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cache_entries(folder: Path) -> int:
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


# -- one load, in its own process ------------------------------------------------------------------

def child(artifact: Path, workers: int, tokens: int, fused_candidates: tuple[int, ...] | None = None) -> dict:
    """Load ``artifact`` (ampere, Full), count the compiles of each phase, decode a little.
    Without CUDA (a dry run of this script's plumbing) the reference backend loads instead."""
    import torch
    from triton.runtime.jit import JITFunction

    from bitmtp_edge import Engine
    from bitmtp_edge.backends.graph import GraphBackend, RuntimeOptions

    compiles = {"precompile": 0, "capture": 0}
    keys = {"precompile": set(), "capture": set()}  # (kernel, specialisation key) entering the compile path
    phase = ["capture"]
    # counted where Triton compiles a variant new to the process (None: a Triton without it)
    do_compile, precompile = getattr(JITFunction, "_do_compile", None), GraphBackend.precompile

    def counting(self, key, *args, **kwargs):
        compiles[phase[0]] += 1
        keys[phase[0]].add((self.fn.__name__, str(key)))
        return do_compile(self, key, *args, **kwargs)

    def marked(self, states):
        phase[0] = "precompile"
        try:
            return precompile(self, states)  # the running compiles when capture overlaps them
        finally:
            phase[0] = "capture"

    GraphBackend.precompile = marked
    if do_compile is not None:
        JITFunction._do_compile = counting
    else:
        compiles = {"precompile": None, "capture": None}
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    before = cache_entries(cache)
    launchers_before = len(list(cache.glob("*/__triton_launcher*")))
    opts = RuntimeOptions(precompile_workers=workers) if workers else RuntimeOptions()
    if fused_candidates:  # the fused states captured (and timed) at load; default AUTO_CANDIDATES
        opts = dataclasses.replace(opts, fused_candidates=fused_candidates)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    eng = Engine.load(artifact, backend="ampere" if cuda else "reference", device="cuda" if cuda else "cpu",
                      runtime=opts)
    sync()
    wall = time.perf_counter() - t0
    GraphBackend.precompile = precompile
    if do_compile is not None:
        JITFunction._do_compile = do_compile
    report = getattr(eng.backend, "precompile_report", None)
    unrequested = sorted(keys["capture"] - keys["precompile"])
    out = {"startup_s": wall, "split": eng.startup, "graphs": len(getattr(eng.backend, "graphs", {})),
           "precompile_warm": getattr(eng.backend, "precompile_warm", False),
           "capture_warmups": getattr(eng.backend, "capture_warmups", None),  # runs before a state that needs them
           "captured_without_warmup": getattr(eng.backend, "captured_without_warmup", None),  # states with none
           "capture_fallbacks": getattr(eng.backend, "capture_fallbacks", None),  # of those: a first launch came
           "kernels_compiled": cache_entries(cache) - before, "compile_calls": compiles,
           "launchers_built": len(list(cache.glob("*/__triton_launcher*"))) - launchers_before,
           "variants": {"requested": len(keys["precompile"]), "capture": len(keys["capture"]),
                        "capture_unrequested": len(unrequested),
                        "unrequested_examples": [f"{name} {key[:300]}" for name, key in unrequested[:8]]},
           "cache_names": sorted(p.name for p in cache.iterdir()) if cache.is_dir() else [],
           "precompile": None if report is None else {
               "requested": report.requested, "compiled": report.compiled, "workers": report.workers,
               "parallel": report.parallel, "mode": report.mode, "seconds": report.seconds,
               "request_s": report.request_s,
               "kernels": report.kernels, "timings": getattr(report, "timings", [])}}
    out["variants"]["requested_keys"] = [f"{name} {key[:400]}" for name, key in sorted(keys["precompile"])]
    if tokens:
        t0 = time.perf_counter()
        out["tokens"] = {p: eng.generate(PROMPT, max_new_tokens=tokens, policy=p).token_ids for p in ("ar", "fused")}
        out["first_generate_s"] = time.perf_counter() - t0  # includes the prefill's own first compiles
        n = 128
        sync()
        t0 = time.perf_counter()
        steps = eng.generate(PROMPT, max_new_tokens=n, policy="ar")
        sync()
        out["ar_tok_s"] = len(steps.token_ids) / (time.perf_counter() - t0)  # with the prefill: for comparing runs
    return out


def run_child(artifact: Path, mode: str, cache: Path, tokens: int, timeout_s: float, fused: str = "") -> dict:
    _, mode_env, workers, _, decode = MODES[mode]
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1", **mode_env)
    for name in ("BITMTP_PRECOMPILE_MODE", "BITMTP_PRECOMPILE_OVERLAP"):  # the defaults unless the mode sets them
        if name not in mode_env:
            env.pop(name, None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(artifact), "--workers", str(workers),
           "--tokens", str(tokens if decode else 0)] + (["--fused-candidates", fused] if fused else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:]
        return {"error": f"timed out after {timeout_s:.0f} s",
                "stderr_tail": tail.decode() if isinstance(tail, bytes) else tail}
    process_s = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit status {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    result = json.loads(lines[-1])
    result["process_s"] = process_s  # with python + torch import and the decode
    return result


# -- report ------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    lines = ["# Startup: cold and warm, with and without the kernel precompile pass", "",
             f"- device: {report['device']}, {report['cpu_count']} CPU cores; torch {report.get('torch', '?')}, "
             f"Triton {report.get('triton', '?')}", f"- date: {report['date']}",
             f"- commit: {report['commit']}", f"- command: `{report['command']}`",
             f"- artifact: {report['artifact']}", "",
             "| start | startup s | load s (read / build / checksums beside, waited) | precompile s | capture s "
             "(warm-up runs) | compile wait s | kernels "
             "compiled (launchers) | variants requested / entered in capture / not requested | workers | graphs "
             "| first generate s | AR tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(MODES[mode][0], r) for mode, r in report["runs"].items()]
    before = report.get("before")
    if before:
        rows += [(f"before ({before['commit']}): {MODES[mode][0] if mode in MODES else mode}", r)
                 for mode, r in before["runs"].items()]
    for name, r in rows:
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | | | | | | | |")
            continue
        sp, pre = r["split"], r.get("precompile") or {}
        pre_s = f"{sp['precompile_s']:.1f}" + (f" ({pre['request_s']:.1f} requesting)" if pre else "")
        if r.get("precompile_warm"):
            pre_s = "skipped (warm cache)"
        v = r.get("variants") or {}
        lp = sp.get("load_parts") or {}
        load_s = f"{sp['load_s']:.1f}" + (f" ({lp['read_s']:.1f} / {lp['build_s']:.1f} / {lp['checksums_s']:.1f}, "
                                          f"{lp['checksums_wait_s']:.1f})" if lp else "")
        warmups = r.get("capture_warmups") or "-"
        if r.get("captured_without_warmup") is not None:  # the states captured with none, those a first launch aborted
            n = r["graphs"] - r["captured_without_warmup"]
            warmups = (f"{warmups} in {n} states, none in {r['captured_without_warmup']}, "
                       f"{r['capture_fallbacks']} aborted" if r["captured_without_warmup"] else f"{warmups}")
        lines.append(f"| {name} | {r['startup_s']:.1f} | {load_s} | {pre_s} | "
                     f"{sp['capture_s']:.1f} ({warmups}) | {sp.get('compile_wait_s', 0.0):.1f} | "
                     f"{r['kernels_compiled']} "
                     f"({r.get('launchers_built', '-')}) | {v.get('requested', '-')} / {v.get('capture', '-')} / "
                     f"{v.get('capture_unrequested', '-')} | "
                     f"{pre.get('workers', '-')} | {r['graphs']} | {r.get('first_generate_s', float('nan')):.1f} | "
                     f"{r.get('ar_tok_s', float('nan')):.0f} |")
    same = report.get("tokens_identical")
    if before:
        lines += ["", f"Before: `{before['command']}` (commit {before['commit']}, same artifact, run after the "
                  f"rows above); its tokens equal these: {report.get('tokens_match_before')}."]
    lines += ["", f"Tokens (AR and fused, {report['tokens']} each) identical in every run that decoded: {same}.",
              f"Kernel binaries (cache entries by hash) identical in every run that started cold: "
              f"{report.get('binaries_identical')}.", "",
              "Startup: `Engine.load` wall time (reads and checks the artifact, builds the model, "
              "precompiles, captures). Load: reading the weights and tokenizer, building the model on the "
              "device, and the checksums (sha256 of every file) in a thread beside both, then the wait for "
              "them (`Engine.startup['load_parts']`). Kernels compiled: new entries in the run's Triton cache folder. "
              "Compile wait: of the load, waiting for compiles still running (inside capture s when "
              "capture overlaps them). Triton compiles in capture: kernels capture found neither "
              "compiled in the process nor "
              "requested by the pass (a warm start without the pass loads them from disk there). "
              "Variants: distinct (kernel, specialisation key) pairs entering Triton's compile path "
              "in the pass, in capture, and in capture without having been requested (processes: "
              "capture loads the workers' kernels from disk through that path). "
              "First generate: AR then fused, including the prefill's own first compiles. AR tok/s: "
              "a second AR decode (128 tokens with its prefill), the same replays in every run. Warm-up "
              "runs: eager runs of a state's body before capturing it (one once the pass compiled, or a "
              "warm cache holds, its kernels; none where an earlier state's run launched every kernel variant "
              "it launches, the capture guarded: aborted = a first launch came, then one run and again).", ""]
    return "\n".join(lines)


def token_sets(runs: dict) -> set[str]:
    return {json.dumps(r["tokens"]) for r in runs.values() if "tokens" in r}


def attach_before(out: Path, before_json: Path) -> dict:
    """Add the report a BEFORE checkout wrote (same artifact, its own modes) to ``out``'s
    startup.json and .md, and whether its tokens equal this run's."""
    files = {"this run": out / "startup.json", "--before": before_json}
    try:
        report, before = (json.loads(f.read_text()) for f in files.values())
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench_startup --before: cannot read {' / '.join(map(str, files.values()))}: {e}") from None
    report["before"] = before
    mine, theirs = token_sets(report["runs"]), token_sets(before["runs"])
    report["tokens_match_before"] = (mine == theirs and len(mine) == 1) if mine and theirs else None
    (out / "startup.json").write_text(json.dumps(report, indent=1))
    (out / "startup.md").write_text(markdown(report))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, help="an artifact folder (default: the 2B shape, made here)")
    ap.add_argument("--modes", default="cold-on,warm-on,cold-off,cold-wait,cold-proc,cold-1")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per load (a process each)")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for the whole run: each load gets "
                    "at most what is left (a mode with less than 15 s left is skipped); 0 = no limit")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bitmtp-startup")
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    ap.add_argument("--before", type=Path, help="only add this startup.json (a BEFORE checkout's run on the same "
                    "artifact) to the report already in --out, and compare the tokens; loads nothing")
    ap.add_argument("--fused-candidates", default="",
                    help="comma-separated c whose fused states each load captures (default: the runtime's, AUTO_CANDIDATES)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fused = tuple(int(c) for c in args.fused_candidates.split(",") if c.strip())
        print(json.dumps(child(args.child, args.workers, args.tokens, fused or None)), flush=True)
        return
    if args.before:
        print(markdown(attach_before(args.out, args.before)))
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    for m in modes:
        reuse = MODES[m][3]
        if reuse != "fresh" and reuse not in modes[:modes.index(m)]:
            raise SystemExit(f"--modes: {m} reuses the cache of {reuse}; list {reuse} before it")
    t_start = time.perf_counter()
    import torch

    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "cpu_count": os.cpu_count(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "tokens": args.tokens, "runs": {}}
    artifact = args.artifact
    if artifact is None:
        from tools.bench_e2e import BITNET_2B, export, make_random_bitnet_2b

        log("building the random 2B-shaped checkpoint and exporting it")
        t0 = time.perf_counter()
        ckpt = make_random_bitnet_2b(args.work / "bitnet2b-ckpt", dict(BITNET_2B), block_size=8)
        artifact = export(ckpt, args.work / "bitnet2b-artifact", max_context=args.max_context)
        report["artifact_build_s"] = time.perf_counter() - t0
        log(f"artifact in {report['artifact_build_s']:.1f} s")
    report["artifact"] = str(artifact)

    def save():
        (args.out / "startup.json").write_text(json.dumps(report, indent=1))
        (args.out / "startup.md").write_text(markdown(report))

    caches = {}
    for mode in modes:
        elapsed = time.perf_counter() - t_start
        timeout = min(args.timeout, args.budget - elapsed) if args.budget else args.timeout
        if args.budget and args.budget - elapsed < MIN_LOAD_S:
            log(f"{mode}: skipped ({elapsed:.0f} s spent, budget {args.budget:.0f} s)")
            report["runs"][mode] = {"error": "skipped (time budget)"}
            continue
        reuse = MODES[mode][3]
        caches[mode] = caches[reuse] if reuse != "fresh" else Path(tempfile.mkdtemp(prefix=f"triton-{mode}-",
                                                                                    dir=args.work))
        log(f"{mode}: loading ({MODES[mode][0]}, cache {caches[mode]})")
        r = run_child(artifact, mode, caches[mode], args.tokens, timeout, args.fused_candidates)
        report["runs"][mode] = r
        if "error" in r:
            log(f"{mode}: {r['error']}\n{r.get('stderr_tail', '')}")
        else:
            sp = r["split"]
            log(f"{mode}: startup {r['startup_s']:.1f} s (load {sp['load_s']:.1f}, precompile {sp['precompile_s']:.1f}, "
                f"capture {sp['capture_s']:.1f}), {r['kernels_compiled']} kernels compiled, "
                f"{r['compile_calls']['capture']} in capture")
        decoded = token_sets(report["runs"])
        report["tokens_identical"] = len(decoded) == 1 if decoded else None
        binaries = [json.dumps(x["cache_names"]) for m, x in report["runs"].items()
                    if "cache_names" in x and MODES[m][3] == "fresh"]
        report["binaries_identical"] = len(set(binaries)) <= 1 if binaries else None
        save()
    save()
    print(markdown(report))


if __name__ == "__main__":
    main()
