"""What the HTTP server costs: server tok/s vs ``Engine.generate`` on the same GPU, in one run.

The server runs as users run it (``bitmtp serve --port``, its own process); this process
holds a second Engine on the same artifact and device and is the HTTP client. For each
policy and prompt, interleaved and repeated: ``Engine.generate`` directly, the same
request streamed over SSE, and non-streamed. Greedy, so all three produce the same tokens
(checked: ``identical``). Reported per policy: tok/s of each path (tokens over wall time,
prefill included), the HTTP overhead per streamed token (stream wall − direct wall, over
tokens, medians) and that overhead as a share of one AR decode step (the issue's target:
≤ 5 % at the AR rate), plus the time to the first streamed token.

    python tools/bench_serve.py                      # embedded model, backend auto
    python tools/bench_serve.py --artifact OUT/ --policies ar,hybrid --tokens 128 --repeats 5

Writes ``tools/results/serve.json`` and ``serve.md`` (or under ``--out``).
"""

from __future__ import annotations

import argparse
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


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bitmtp_edge.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model-name", MODEL, "--backend", args.backend, "--device", args.device, "--log-level", "warning",
           "--max-new-tokens", str(args.tokens)]
    if args.artifact:
        cmd += ["--artifact", str(args.artifact)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log("server: " + " ".join(cmd[1:]))
    return subprocess.Popen(cmd, env=env, cwd=ROOT)


def wait_ready(client, url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            if client.get(url + "/health", timeout=2).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")


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
    return {"wall_s": time.perf_counter() - t0, "tokens": len(res.token_ids), "text": res.text}


def timed_stream(client, url: str, prompt: str, policy: str, tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "policy": policy}
    pieces, first, usage, events = [], None, None, 0
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            events += 1
            text = chunk["choices"][0]["text"]
            if text and first is None:
                first = time.perf_counter() - t0
            pieces.append(text)
            usage = chunk.get("usage") or usage
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": usage["completion_tokens"], "text": "".join(pieces), "first_s": first,
            "events": events}


def timed_json(client, url: str, prompt: str, policy: str, tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "policy": policy}
    t0 = time.perf_counter()
    resp = client.post(url + "/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    data = resp.json()
    return {"wall_s": time.perf_counter() - t0, "tokens": data["usage"]["completion_tokens"],
            "text": data["choices"][0]["text"]}


def summarize(runs: list[dict], ar_step_s: float | None) -> dict:
    def rate(kind):
        tokens = sum(r[kind]["tokens"] for r in runs)
        return tokens / sum(r[kind]["wall_s"] for r in runs)

    per_token = [(r["stream"]["wall_s"] - r["direct"]["wall_s"]) / max(r["direct"]["tokens"], 1) for r in runs]
    per_token_json = [(r["json"]["wall_s"] - r["direct"]["wall_s"]) / max(r["direct"]["tokens"], 1) for r in runs]
    overhead = statistics.median(per_token)
    return {
        "runs": len(runs), "tokens": sum(r["direct"]["tokens"] for r in runs),
        "direct_tok_s": rate("direct"), "stream_tok_s": rate("stream"), "json_tok_s": rate("json"),
        "stream_overhead_ms_per_token": 1e3 * overhead,
        "json_overhead_ms_per_token": 1e3 * statistics.median(per_token_json),
        "stream_overhead_vs_ar_step_pct": 100 * overhead / ar_step_s if ar_step_s else None,
        "first_token_ms": 1e3 * statistics.median(r["stream"]["first_s"] for r in runs if r["stream"]["first_s"]),
        "events_per_token": sum(r["stream"]["events"] for r in runs) / max(sum(r["stream"]["tokens"] for r in runs), 1),
        "identical": all(r["direct"]["text"] == r["stream"]["text"] == r["json"]["text"] for r in runs),
    }


def markdown(report: dict) -> str:
    lines = ["# HTTP serving overhead", "", f"- device: {report['device']}", f"- date: {report['date']}",
             f"- commit: {report['commit']}", f"- command: `{report['command']}`",
             f"- backend: {report.get('backend')}, tokens per request: {report['tokens']}, "
             f"repeats: {report['repeats']}", "",
             "| policy | Engine.generate tok/s | SSE stream tok/s | JSON tok/s | overhead ms/token (stream) "
             "| overhead vs AR step | first token ms | same text |",
             "|---|---|---|---|---|---|---|---|"]
    for policy, s in report.get("policies", {}).items():
        pct = s["stream_overhead_vs_ar_step_pct"]
        lines.append(f"| {policy} | {s['direct_tok_s']:.1f} | {s['stream_tok_s']:.1f} | {s['json_tok_s']:.1f} | "
                     f"{s['stream_overhead_ms_per_token']:.3f} | {'' if pct is None else f'{pct:.1f} %'} | "
                     f"{s['first_token_ms']:.1f} | {'yes' if s['identical'] else 'NO'} |")
    lines += ["", "Overhead = (streamed request wall time − Engine.generate wall time) / tokens, median over "
              "prompts and repeats; 'vs AR step' divides it by one AR decode step (1 / AR tok/s). "
              "Client and server are separate processes on the same host."]
    if report.get("error"):
        lines += ["", f"error: {report['error']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=None, help="artifact folder [default: the embedded model]")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--policies", default="ar,hybrid", help="comma-separated; ar first gives the AR step time")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    args = ap.parse_args()
    # On a CPU the two processes share cores: OpenMP threads spinning after the other
    # process's last op would be charged to whichever path runs next.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import httpx
    import torch

    from bitmtp_edge.runtime.engine import Engine
    from bitmtp_edge.app.serve import warm_up

    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "tokens": args.tokens,
              "repeats": args.repeats, "policies": {}}

    def save():
        (args.out / "serve.json").write_text(json.dumps(report, indent=1))
        (args.out / "serve.md").write_text(markdown(report))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: keep what was measured
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    try:
        with httpx.Client() as client:
            engine = Engine.load(args.artifact, backend=args.backend, device=args.device)
            report["backend"] = engine.backend.name
            warm_up(engine)
            wait_ready(client, url, proc, args.start_timeout)
            texts = prompts(engine, args.prompts)
            ar_step_s = None
            for policy in args.policies.split(","):
                if policy != "ar" and engine.manifest.mtp is None:
                    continue
                timed_stream(client, url, texts[0], policy, 8)  # the server's first-request costs
                runs = []
                for _ in range(args.repeats):
                    for text in texts:
                        runs.append({"direct": timed_direct(engine, text, policy, args.tokens),
                                     "stream": timed_stream(client, url, text, policy, args.tokens),
                                     "json": timed_json(client, url, text, policy, args.tokens)})
                summary = summarize(runs, ar_step_s)
                if policy == "ar":
                    ar_step_s = 1 / summary["direct_tok_s"]
                    summary = summarize(runs, ar_step_s)
                report["policies"][policy] = summary
                log(f"{policy}: {json.dumps(summary)}")
                save()
    except Exception as e:  # noqa: BLE001 - keep what was measured
        report["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
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
