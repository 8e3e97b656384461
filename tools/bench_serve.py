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

Reported per policy and server (long requests): wall tok/s of each path (prefill included);
decode-only tok/s (tokens over the decode loop's own time: ``Engine.generate``'s stats
directly, the server's ``bitmtp`` stats over HTTP); time to the first streamed token; and
the HTTP overhead paired per request, as a fixed cost per request (time outside prefill and
decode) and per token (the decode loop's extra time; the whole difference with and without
the prefill), each per-token figure as a share of one AR decode step (the issue's target:
≤ 5 % per streamed token). SSE is paired with ``Engine.generate`` and with JSON on the same
server, which isolates streaming's own cost from any difference between two processes.

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


def _outside(row: dict) -> float:
    """A request's time outside prefill and decode (client, HTTP, set-up, hand-off)."""
    return row["wall_s"] - row["prefill_s"] - row["decode_s"]


def _med(values) -> float:
    return statistics.median(list(values))


def paired(pairs: list[tuple[dict, dict]]) -> dict:
    """Path A vs path B over the same requests (long ones), medians of the pairwise differences:
    the fixed cost per request (time outside prefill and decode), the decode loop's extra time
    per token, the whole per-token overhead with prefill left out (the eager prefill varies by
    milliseconds from call to call in every path alike), and the plain wall difference."""
    def per_token(fn):
        return 1e6 * _med((fn(a) - fn(b)) / max(b["tokens"], 1) for a, b in pairs)

    return {
        "fixed_ms_per_request": 1e3 * _med(_outside(a) - _outside(b) for a, b in pairs),
        "decode_us_per_token": per_token(lambda r: r["decode_s"]),
        "no_prefill_us_per_token": per_token(lambda r: r["wall_s"] - r["prefill_s"]),
        "wall_us_per_token": per_token(lambda r: r["wall_s"]),
    }


def summarize(runs: list[dict], servers: list[str], long: int, identical: dict | None = None) -> dict:
    """Per server: rates over the long requests, SSE and JSON against ``Engine.generate``
    (the issue's comparison; two processes, two engines) and SSE against JSON on the same
    server (streaming's own cost, free of any difference between the two engines)."""
    long_runs = [r for r in runs if r["direct"]["requested"] == long]
    short_runs = [r for r in runs if r["direct"]["requested"] != long]
    direct = [r["direct"] for r in long_runs]
    out = {
        "runs": len(runs), "tokens_long": _med(d["tokens"] for d in direct),
        "direct_wall_tok_s": _rate(direct, "wall_s"), "direct_decode_tok_s": _rate(direct, "decode_s"),
        "direct_prefill_ms": 1e3 * _med(d["prefill_s"] for d in direct),
        "direct_outside_ms": 1e3 * _med(_outside(d) for d in direct),
        "direct_decode_us_per_token": 1e6 * sum(d["decode_s"] for d in direct) / max(sum(d["tokens"] for d in direct), 1),
        "servers": {},
    }
    for name in servers:
        stream = [r[f"stream@{name}"] for r in long_runs]
        js = [r[f"json@{name}"] for r in long_runs]
        texts_equal = identical.get(name) if identical is not None else all(
            r["direct"]["text"] == r[f"stream@{name}"]["text"] == r[f"json@{name}"]["text"] for r in runs)
        out["servers"][name] = {
            "stream_wall_tok_s": _rate(stream, "wall_s"), "stream_decode_tok_s": _rate(stream, "decode_s"),
            "json_wall_tok_s": _rate(js, "wall_s"), "json_decode_tok_s": _rate(js, "decode_s"),
            "first_token_ms": _median_ms([s["first_s"] for s in stream if s["first_s"] is not None]),
            "server_prefill_ms": 1e3 * _med(s["prefill_s"] for s in stream),
            "chunks_per_token": sum(s["chunks"] for s in stream) / max(sum(s["tokens"] for s in stream), 1),
            # The fixed cost split: outside the server's admission-to-end time (HTTP exchange,
            # parsing, validation, tokenising, the client) and inside it besides prefill and
            # decode (queue hand-off, set-up).
            "stream_outside_server_ms": _median_ms([s["wall_s"] - s["server_s"] for s in stream]),
            "stream_worker_rest_ms": _median_ms([s["server_s"] - s["prefill_s"] - s["decode_s"] for s in stream]),
            "stream_vs_direct": paired([(r[f"stream@{name}"], r["direct"]) for r in long_runs]),
            "json_vs_direct": paired([(r[f"json@{name}"], r["direct"]) for r in long_runs]),
            "stream_vs_json": paired([(r[f"stream@{name}"], r[f"json@{name}"]) for r in long_runs]),
            # The same fixed cost measured on the short requests: it should not depend on length.
            "stream_vs_direct_fixed_ms_short": 1e3 * _med(_outside(r[f"stream@{name}"]) - _outside(r["direct"])
                                                          for r in short_runs) if short_runs else None,
            "identical": texts_equal,
        }
    return out


COMPARISONS = (("stream_vs_direct", "SSE − Engine.generate"), ("json_vs_direct", "JSON − Engine.generate"),
               ("stream_vs_json", "SSE − JSON, same server"))


def add_shares(report: dict) -> None:
    """Each per-token overhead as a share of one AR decode step (direct, decode-only)."""
    ar = report["policies"].get("ar")
    step_us = ar["direct_decode_us_per_token"] if ar else None
    report["ar_step_us"] = step_us
    for summary in report["policies"].values():
        for server in summary["servers"].values():
            for kind, _ in COMPARISONS:
                o = server[kind]
                for key in ("decode", "no_prefill", "wall"):
                    value = o[f"{key}_us_per_token"]
                    o[f"{key}_pct_of_ar_step"] = 100 * value / step_us if step_us else None


def _f(x, fmt=".1f", unit=""):
    return "—" if x is None else f"{x:{fmt}}{unit}"


def markdown(report: dict) -> str:
    policies = report.get("policies", {})
    lines = ["# HTTP serving overhead", "", f"- device: {report['device']}", f"- date: {report['date']}",
             f"- commit: {report['commit']}", f"- command: `{report['command']}`",
             f"- backend: {report.get('backend')}, runtime: {report.get('runtime')}, HTTP stack: "
             f"{report.get('http_stack')}",
             f"- tokens per request: {report['tokens']} (tables; {report['short_tokens']}-token requests also run); "
             f"prompts: {report.get('prompts')}, repeats: {report['repeats']}; AR step (Engine.generate, decode "
             f"only): {_f(report.get('ar_step_us'), '.1f', ' µs')}"]
    if report.get("note"):
        lines += [f"- {report['note']}"]
    lines += ["", "## Rates", "",
              "| policy | server | Engine.generate tok/s wall / decode | SSE tok/s wall / server decode "
              "| JSON tok/s wall / server decode | first token ms (server prefill; direct prefill) "
              "| chunks per token | same text |",
              "|---|---|---|---|---|---|---|---|"]
    for policy, s in policies.items():
        for name, v in s["servers"].items():
            same = {True: "yes", False: "NO"}.get(v["identical"], "—")
            lines.append(f"| {policy} | {name} | {s['direct_wall_tok_s']:.0f} / {s['direct_decode_tok_s']:.0f} | "
                         f"{v['stream_wall_tok_s']:.0f} / {v['stream_decode_tok_s']:.0f} | "
                         f"{v['json_wall_tok_s']:.0f} / {v['json_decode_tok_s']:.0f} | "
                         f"{_f(v['first_token_ms'], '.2f')} ({v['server_prefill_ms']:.2f}; {s['direct_prefill_ms']:.2f}) "
                         f"| {v['chunks_per_token']:.3f} | {same} |")
    lines += ["", "## HTTP overhead, paired per request (medians of A − B)", "",
              "| policy | server | A − B | fixed ms per request | decode loop µs per token "
              "| per token, prefill left out (fixed included) | per token, wall |",
              "|---|---|---|---|---|---|---|"]
    for policy, s in policies.items():
        for name, v in s["servers"].items():
            for kind, label in COMPARISONS:
                o = v[kind]
                lines.append(f"| {policy} | {name} | {label} | {o['fixed_ms_per_request']:.2f} | "
                             f"{o['decode_us_per_token']:.1f} ({_f(o['decode_pct_of_ar_step'])} %) | "
                             f"{o['no_prefill_us_per_token']:.1f} ({_f(o['no_prefill_pct_of_ar_step'])} %) | "
                             f"{o['wall_us_per_token']:.1f} ({_f(o['wall_pct_of_ar_step'])} %) |")
    lines += ["", "## The fixed cost per request (medians, ms)", "",
              "| policy | server | Engine.generate outside prefill+decode | SSE: outside the server's admission-to-end "
              "| SSE: server set-up + hand-off |",
              "|---|---|---|---|---|"]
    for policy, s in policies.items():
        for name, v in s["servers"].items():
            lines.append(f"| {policy} | {name} | {s['direct_outside_ms']:.2f} | {_f(v['stream_outside_server_ms'], '.2f')} "
                         f"| {_f(v['stream_worker_rest_ms'], '.2f')} |")
    lines += ["", "Percentages are of one AR decode step. Fixed: time outside prefill and decode (A) minus "
              "the same for B. Decode loop: the decode time per token of A minus B's, the HTTP work beside "
              "the decode thread included; across processes it also holds the two engines' own "
              "difference (each process's host-bound decode loop runs at its own few-% different pace: "
              "compare the JSON − Engine.generate rows, where the server does no per-token HTTP work). "
              "SSE − JSON pairs the two paths of one server process, so it isolates streaming's own cost. "
              "Prefill left out: ((A wall − A prefill) − (B wall − B prefill)) / tokens; the eager prefill "
              "varies by milliseconds between calls in every path alike. Wall: (A wall − B wall) / tokens. "
              "Outside the server's admission-to-end: HTTP exchange, parsing, validation, tokenising, the "
              "client's own work. Server `interval N ms`: `--stream-interval-ms N`, at most one SSE chunk "
              "per N ms. Client and servers are separate processes on one host, each with its own engine "
              "on the GPU; only one decodes at a time."]
    if report.get("error"):
        lines += ["", f"error: {report['error']}"]
    return "\n".join(lines) + "\n"


def resummarize(path: Path) -> dict:
    """Recompute a saved report's summaries from its raw rows (texts are not kept: each
    server's same-text verdict is carried over)."""
    report = json.loads(path.read_text())
    for policy, rows in report.get("rows", {}).items():
        old = report["policies"][policy]["servers"]
        report["policies"][policy] = summarize(rows, list(old), report["tokens"],
                                               identical={k: v["identical"] for k, v in old.items()})
    add_shares(report)
    return report


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
    ap.add_argument("--resummarize", type=Path, default=None, metavar="SERVE_JSON",
                    help="only recompute the summaries and Markdown of a saved serve.json from its raw rows")
    args = ap.parse_args()
    if args.resummarize is not None:
        report = resummarize(args.resummarize)
        report["note"] = (f"summaries recomputed from this run's raw rows by `bench_serve.py --resummarize` at "
                          f"{_commit()}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve.json").write_text(json.dumps(report, indent=1))
        (args.out / "serve.md").write_text(markdown(report))
        print(markdown(report))
        return
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
                report["policies"][policy] = summarize(runs, list(servers), args.tokens)
                report.setdefault("rows", {})[policy] = [
                    {k: {f: v for f, v in row[k].items() if f != "text"} for k in row} for row in runs]
                add_shares(report)
                s = report["policies"][policy]
                log(f"{policy}: direct {s['direct_decode_tok_s']:.0f} tok/s decode, {s['direct_wall_tok_s']:.0f} wall; "
                    + "; ".join(f"{name}: SSE {v['stream_wall_tok_s']:.0f} wall, SSE − JSON "
                                f"{v['stream_vs_json']['decode_us_per_token']:.1f} µs/token, fixed vs direct "
                                f"{v['stream_vs_direct']['fixed_ms_per_request']:.2f} ms"
                                for name, v in s["servers"].items()))
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
