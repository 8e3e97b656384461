"""What the HTTP server costs: server tok/s vs ``Engine.generate`` on the same GPU, in one run.

The server runs as users run it (``bitmtp serve --port``, its own process; one per
``--stream-intervals`` value, all up at once); this process holds a second Engine on the
same artifact, device, backend and runtime preset and is the HTTP client. Both sides are
warm before anything is timed: each engine ran ``serve.warm_up`` and then every timed
(prompt, length, policy) once untimed, because the eager prefill compiles kernels for each
new prompt length on first use (seconds, once per process). Then, interleaved in rotating
order and repeated: ``Engine.generate`` directly, the same request streamed over SSE, and
non-streamed, at two lengths (``--short-tokens``, ``--tokens``). Greedy, so all produce the
same tokens (checked: ``same text``).

Reported per policy and server: wall tok/s of each path (prefill included); decode-only
tok/s (tokens over the decode loop's own time: ``Engine.generate``'s stats directly, the
server's ``bitmtp`` stats over HTTP); time to the first streamed token vs the direct
prefill; and the HTTP overhead, paired per request (HTTP wall − direct wall), split into a
fixed cost per request and a marginal cost per token (the slope between the two lengths),
each as a share of one AR decode step (direct AR decode time per token) — the issue's
target is ≤ 5 % per streamed token.

    python tools/bench_serve.py                      # embedded model, backend auto
    python tools/bench_serve.py --artifact OUT/ --policies ar,hybrid --tokens 256 --repeats 5

Writes ``tools/results/serve.json`` and ``serve.md`` (or under ``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``bitmtp serve --port`` in its own process."""

    def __init__(self, args, interval_ms: float):
        self.interval_ms, self.port = interval_ms, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "bitmtp_edge.app.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--model-name", MODEL, "--backend", args.backend, "--device", args.device, "--runtime", args.runtime,
               "--stream-interval-ms", f"{interval_ms:g}", "--log-level", "warning",
               "--max-new-tokens", str(args.tokens)]
        if args.artifact:
            cmd += ["--artifact", str(args.artifact)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log("server: " + " ".join(cmd[1:]))
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT)

    def wait_ready(self, client, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server (stream interval {self.interval_ms:g} ms) exited with "
                                   f"{self.proc.returncode} while starting")
            try:
                if client.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def prompts(engine, n: int) -> list[str]:
    path = engine.path / "prompts.jsonl"
    if path.is_file():
        rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    else:
        rows = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef main():\n"]
    return rows[:n]


def timed_direct(engine, prompt: str, policy: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    res = engine.generate(prompt, max_new_tokens=tokens, policy=policy)
    return {"wall_s": time.perf_counter() - t0, "tokens": len(res.token_ids), "text": res.text,
            "prefill_s": res.stats.prefill_s, "decode_s": res.stats.decode_s}


def timed_stream(client, url: str, prompt: str, policy: str, tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "policy": policy}
    pieces, first, last, chunks = [], None, None, 0
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks += 1
            text = chunk["choices"][0]["text"]
            if text and first is None:
                first = time.perf_counter() - t0
            pieces.append(text)
            last = chunk if chunk.get("usage") else last
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": last["usage"]["completion_tokens"], "text": "".join(pieces),
            "first_s": first, "chunks": chunks, **_server_times(last["bitmtp"])}


def _server_times(stats: dict) -> dict:
    return {key: stats[key] for key in ("prefill_s", "decode_s", "server_s")}


def timed_json(client, url: str, prompt: str, policy: str, tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "policy": policy}
    t0 = time.perf_counter()
    resp = client.post(url + "/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    data = resp.json()
    return {"wall_s": time.perf_counter() - t0, "tokens": data["usage"]["completion_tokens"],
            "text": data["choices"][0]["text"], **_server_times(data["bitmtp"])}


def _median_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.median(seconds) if seconds else None


def _rate(rows: list[dict], key: str) -> float:
    seconds = sum(r[key] for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds > 0 else 0.0


def overhead(pairs: list[tuple[dict, dict]], short: int, long: int) -> dict:
    """HTTP wall − baseline wall, paired per request: the all-in cost per token at the long
    length, and its split into a fixed cost per request and a marginal cost per token (the
    slope of the median overhead between the two lengths)."""
    by_len = {n: [(h, d) for h, d in pairs if d["requested"] == n] for n in (short, long)}
    med_s = {n: statistics.median(h["wall_s"] - d["wall_s"] for h, d in rows) for n, rows in by_len.items()}
    med_tok = {n: statistics.median(d["tokens"] for _, d in rows) for n, rows in by_len.items()}
    marginal = (med_s[long] - med_s[short]) / (med_tok[long] - med_tok[short]) \
        if med_tok[long] > med_tok[short] else None
    return {
        "all_in_us_per_token": 1e6 * statistics.median((h["wall_s"] - d["wall_s"]) / max(d["tokens"], 1)
                                                       for h, d in by_len[long]),
        "fixed_ms_per_request": 1e3 * (med_s[short] - (marginal or 0.0) * med_tok[short]),
        "marginal_us_per_token": None if marginal is None else 1e6 * marginal,
        # The server's own decode loop vs the baseline's (what HTTP work beside it costs it).
        "decode_loop_us_per_token": 1e6 * statistics.median((h["decode_s"] - d["decode_s"]) / max(d["tokens"], 1)
                                                            for h, d in by_len[long]),
    }


def summarize(runs: list[dict], servers: list[str], short: int, long: int) -> dict:
    long_runs = [r for r in runs if r["direct"]["requested"] == long]
    direct = [r["direct"] for r in long_runs]
    out = {
        "runs": len(runs), "tokens_long": statistics.median(d["tokens"] for d in direct),
        "direct_wall_tok_s": _rate(direct, "wall_s"), "direct_decode_tok_s": _rate(direct, "decode_s"),
        "direct_prefill_ms": 1e3 * statistics.median(d["prefill_s"] for d in direct),
        "direct_decode_us_per_token": 1e6 * sum(d["decode_s"] for d in direct) / max(sum(d["tokens"] for d in direct), 1),
        "servers": {},
    }
    for name in servers:
        stream = [r[f"stream@{name}"] for r in long_runs]
        js = [r[f"json@{name}"] for r in long_runs]
        out["servers"][name] = {
            "stream_wall_tok_s": _rate(stream, "wall_s"), "stream_decode_tok_s": _rate(stream, "decode_s"),
            "json_wall_tok_s": _rate(js, "wall_s"), "json_decode_tok_s": _rate(js, "decode_s"),
            "first_token_ms": _median_ms([s["first_s"] for s in stream if s["first_s"] is not None]),
            "server_prefill_ms": 1e3 * statistics.median(s["prefill_s"] for s in stream),
            "chunks_per_token": sum(s["chunks"] for s in stream) / max(sum(s["tokens"] for s in stream), 1),
            # Where a request's time goes besides decoding (long requests, medians): the HTTP
            # exchange and the client (wall − the server's admission-to-end time), and the
            # worker's set-up and hand-off (server time − prefill − decode).
            "stream_outside_server_ms": _median_ms([s["wall_s"] - s["server_s"] for s in stream]),
            "stream_worker_rest_ms": _median_ms([s["server_s"] - s["prefill_s"] - s["decode_s"] for s in stream]),
            "json_outside_server_ms": _median_ms([s["wall_s"] - s["server_s"] for s in js]),
            "stream": overhead([(r[f"stream@{name}"], r["direct"]) for r in runs], short, long),
            "json": overhead([(r[f"json@{name}"], r["direct"]) for r in runs], short, long),
            # Streaming's own cost: SSE vs JSON on the same server process (no cross-process bias).
            "stream_vs_json": overhead([(r[f"stream@{name}"], r[f"json@{name}"]) for r in runs], short, long),
            "identical": all(r["direct"]["text"] == r[f"stream@{name}"]["text"] == r[f"json@{name}"]["text"]
                             for r in runs),
        }
    return out


def add_shares(report: dict) -> None:
    """Each overhead as a share of one AR decode step (direct, decode-only)."""
    ar = report["policies"].get("ar")
    step_us = ar["direct_decode_us_per_token"] if ar else None
    report["ar_step_us"] = step_us
    for summary in report["policies"].values():
        for server in summary["servers"].values():
            for kind in ("stream", "json", "stream_vs_json"):
                o = server[kind]
                for key in ("all_in", "marginal", "decode_loop"):
                    value = o[f"{key}_us_per_token"]
                    o[f"{key}_pct_of_ar_step"] = 100 * value / step_us if step_us and value is not None else None


def _f(x, fmt=".1f", unit=""):
    return "—" if x is None else f"{x:{fmt}}{unit}"


def markdown(report: dict) -> str:
    lines = ["# HTTP serving overhead", "", f"- device: {report['device']}", f"- date: {report['date']}",
             f"- commit: {report['commit']}", f"- command: `{report['command']}`",
             f"- backend: {report.get('backend')}, runtime: {report.get('runtime')}, HTTP stack: "
             f"{report.get('http_stack')}",
             f"- tokens per request: {report['short_tokens']} and {report['tokens']}; prompts: {report['prompts']}, "
             f"repeats: {report['repeats']}; AR step (direct, decode only): {_f(report.get('ar_step_us'), '.1f', ' µs')}",
             "", "## Rates (long requests)", "",
             "| policy | server | Engine.generate tok/s wall / decode | SSE tok/s wall / server decode "
             "| JSON tok/s wall / server decode | first token ms (direct prefill ms) | chunks per token | same text |",
             "|---|---|---|---|---|---|---|---|"]
    for policy, s in report.get("policies", {}).items():
        for name, v in s["servers"].items():
            lines.append(f"| {policy} | {name} | {s['direct_wall_tok_s']:.0f} / {s['direct_decode_tok_s']:.0f} | "
                         f"{v['stream_wall_tok_s']:.0f} / {v['stream_decode_tok_s']:.0f} | "
                         f"{v['json_wall_tok_s']:.0f} / {v['json_decode_tok_s']:.0f} | "
                         f"{_f(v['first_token_ms'], '.2f')} ({s['direct_prefill_ms']:.2f}) | {v['chunks_per_token']:.3f} | "
                         f"{'yes' if v['identical'] else 'NO'} |")
    lines += ["", "## HTTP overhead (paired: HTTP wall − Engine.generate wall)", "",
              "| policy | server | path | per token, all-in at the long length | marginal per token "
              "| fixed per request | server decode loop slowdown per token |",
              "|---|---|---|---|---|---|---|"]
    for policy, s in report.get("policies", {}).items():
        for name, v in s["servers"].items():
            for kind, label in (("stream", "SSE − direct"), ("json", "JSON − direct"),
                                ("stream_vs_json", "SSE − JSON, same server")):
                o = v[kind]
                lines.append(
                    f"| {policy} | {name} | {label} | "
                    f"{_f(o['all_in_us_per_token'])} µs ({_f(o['all_in_pct_of_ar_step'])} %) | "
                    f"{_f(o['marginal_us_per_token'])} µs ({_f(o['marginal_pct_of_ar_step'])} %) | "
                    f"{o['fixed_ms_per_request']:.2f} ms | "
                    f"{_f(o['decode_loop_us_per_token'])} µs ({_f(o['decode_loop_pct_of_ar_step'])} %) |")
    lines += ["", "## Where the rest goes (long requests, medians, ms per request)", "",
              "| policy | server | SSE: HTTP exchange + client | SSE: worker set-up + hand-off | JSON: HTTP exchange + client |",
              "|---|---|---|---|---|"]
    for policy, s in report.get("policies", {}).items():
        for name, v in s["servers"].items():
            lines.append(f"| {policy} | {name} | {_f(v['stream_outside_server_ms'], '.2f')} | "
                         f"{_f(v['stream_worker_rest_ms'], '.2f')} | {_f(v['json_outside_server_ms'], '.2f')} |")
    lines += ["", "Percentages are of one AR decode step. All-in: the median over requests of (HTTP wall − direct "
              "wall) / tokens at the long length, fixed costs included. Marginal: the slope of the median "
              "overhead between the two lengths (what each further streamed token costs); fixed: the rest, per "
              "request (parsing, validation, tokenising, queue hand-off, response). Decode loop slowdown: the "
              "server's own decode time per token minus the direct one (HTTP work competing with the decode "
              "thread). SSE − JSON pairs the two HTTP paths of one server process: streaming's own "
              "cost, free of any difference between the server's engine and this process's. HTTP exchange + "
              "client: the client's wall time minus the server's time from admission (request parsed, "
              "validated, tokenised) to the end. Server `interval N ms`: `--stream-interval-ms N`, at most one SSE chunk per N ms. "
              "Client and servers are separate processes on one host; each holds its own engine on the GPU; "
              "only one decodes at a time."]
    if report.get("error"):
        lines += ["", f"error: {report['error']}"]
    return "\n".join(lines) + "\n"


def http_stack() -> str:
    """What uvicorn's auto settings pick here (the servers run in this same environment)."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    import uvicorn

    return f"uvicorn {uvicorn.__version__}, loop {loop}, http {http}, python {sys.version.split()[0]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=None, help="artifact folder [default: the embedded model]")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--runtime", default="full", help="runtime preset of both engines")
    ap.add_argument("--policies", default="ar,speculative,hybrid", help="comma-separated; ar gives the AR step")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="the long requests' max_tokens")
    ap.add_argument("--short-tokens", type=int, default=16, help="the short requests' max_tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stream-intervals", default="5,20,0",
                    help="comma-separated --stream-interval-ms values, one server each")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    args = ap.parse_args()
    if not 0 < args.short_tokens < args.tokens:
        ap.error(f"--short-tokens {args.short_tokens} must be in 1..--tokens-1 ({args.tokens - 1})")
    intervals = [float(x) for x in args.stream_intervals.split(",")]
    # On a CPU the processes share cores: OpenMP threads spinning after the other
    # process's last op would be charged to whichever path runs next.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import httpx
    import torch

    from bitmtp_edge.app.serve import warm_up
    from bitmtp_edge.runtime.engine import Engine

    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "tokens": args.tokens,
              "short_tokens": args.short_tokens, "repeats": args.repeats, "runtime": args.runtime,
              "http_stack": http_stack(), "policies": {}}

    def save():
        tmp_json, tmp_md = args.out / ".serve.json.tmp", args.out / ".serve.md.tmp"
        tmp_json.write_text(json.dumps(report, indent=1))
        tmp_md.write_text(markdown(report))
        tmp_json.replace(args.out / "serve.json")
        tmp_md.replace(args.out / "serve.md")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: keep what was measured
    servers = {f"interval {ms:g} ms": Server(args, ms) for ms in intervals}
    try:
        with httpx.Client() as client:
            t0 = time.perf_counter()
            engine = Engine.load(args.artifact, backend=args.backend, device=args.device, runtime=args.runtime)
            report["backend"] = engine.backend.name
            warm_up(engine)
            for server in servers.values():
                server.wait_ready(client, args.start_timeout)
            log(f"engine and {len(servers)} server(s) ready in {time.perf_counter() - t0:.1f} s")
            texts = prompts(engine, args.prompts)
            report["prompts"] = len(texts)
            lengths = (args.short_tokens, args.tokens)
            for policy in args.policies.split(","):
                if policy != "ar" and engine.manifest.mtp is None:
                    continue
                paths = {"direct": lambda text, n: timed_direct(engine, text, policy, n)}
                for name, server in servers.items():
                    paths[f"stream@{name}"] = lambda text, n, url=server.url: timed_stream(client, url, text, policy, n)
                    paths[f"json@{name}"] = lambda text, n, url=server.url: timed_json(client, url, text, policy, n)
                order = list(paths)
                for text in texts:  # untimed: each prompt length's first prefill compiles kernels
                    for n in lengths:
                        for run in paths.values():
                            run(text, n)
                runs = []
                for rep in range(args.repeats):
                    for i, text in enumerate(texts):
                        for n in lengths:
                            k = (rep + i) % len(order)  # rotate which path goes first
                            row = {}
                            for key in order[k:] + order[:k]:
                                row[key] = {**paths[key](text, n), "requested": n}
                            runs.append(row)
                report["policies"][policy] = summarize(runs, list(servers), *lengths)
                report.setdefault("rows", {})[policy] = [
                    {k: {f: v for f, v in row[k].items() if f != "text"} for k in row} for row in runs]
                add_shares(report)
                s = report["policies"][policy]
                log(f"{policy}: direct {s['direct_decode_tok_s']:.0f} tok/s decode, {s['direct_wall_tok_s']:.0f} wall; "
                    + "; ".join(f"{name}: SSE {v['stream_wall_tok_s']:.0f} wall, marginal "
                                f"{_f(v['stream']['marginal_us_per_token'])} µs/token, fixed "
                                f"{v['stream']['fixed_ms_per_request']:.2f} ms" for name, v in s["servers"].items()))
                save()
    except Exception as e:  # noqa: BLE001 - keep what was measured
        report["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        for server in servers.values():
            server.stop()
        save()
        print(markdown(report))


def _commit() -> str:
    if os.environ.get("BITMTP_COMMIT"):  # a copied tree's .git may be stale: the caller knows best
        return os.environ["BITMTP_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
