"""What the HTTP server costs: server tok/s vs ``Engine.generate`` on the same GPU, in one run.

Two modes (``--modes``, both by default). ``in-process``: the app served by uvicorn in a
thread of this process over this process's own Engine, the one ``Engine.generate`` runs,
so server minus direct is the HTTP cost alone. ``separate``: ``bitmtp serve --port`` in its
own process, as users run it, with a second Engine (two processes' host-bound decode loops
run a few % apart, so single comparisons across processes are unreliable at that level).
One server per ``--stream-intervals`` value and mode, all up at once; this process is the
HTTP client (a lean ``http.client`` one, see ``RawClient``). Both sides are
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
import http.client
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.provenance import commit  # noqa: E402

MODEL = "bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``bitmtp serve --port`` in its own process: how users run it."""

    mode = "separate"

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

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = RawClient(self.url)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server (stream interval {self.interval_ms:g} ms) exited with "
                                       f"{self.proc.returncode} while starting")
                try:
                    if client.get("/health")[0] == 200:
                        return
                except (OSError, http.client.HTTPException):  # not listening (or not answering) yet
                    client.close()
                time.sleep(0.5)
        finally:
            client.close()
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class InProcessServer:
    """The same app over the benchmark's own Engine: uvicorn in a thread of this process.
    ``Engine.generate`` and the server then run the same engine object, interleaved per
    request, so server minus direct is the HTTP cost alone (two processes each decode at
    their own few-% different pace)."""

    mode = "in-process"

    def __init__(self, engine, args, interval_ms: float):
        from bitmtp_edge.app.http_server import ServerConfig, create_app, generation_defaults, make_server

        self.interval_ms = interval_ms
        config = ServerConfig(model_name=MODEL, max_tokens=args.tokens, stream_interval_s=interval_ms / 1e3,
                              sampling_defaults=generation_defaults(engine))
        self.server = make_server(create_app(engine, config), log_level="warning")
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that name it (with
        # proto 0 every keep-alive reply waits ~40 ms for the client's delayed ACK).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"uvicorn-{interval_ms:g}ms")
        self.thread.start()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the in-process uvicorn server died while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the in-process server was not ready within {timeout_s:.0f} s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def pace_engine(engine, step_us: float, prefill_us: float = 1000.0, launch_us: float = 50.0) -> None:
    """A stand-in decode for measuring the host-side HTTP costs where no GPU is: every
    request still goes through ``Engine.stream_ids``'s own checks, then a generator spins
    ``prefill_us`` and ``step_us`` per token (counted without the waits for the GIL),
    committing one token per step from a fixed run of real ids. Like a host-bound decode loop launching kernels it holds the GIL
    while it works and lets go of it briefly every ``launch_us`` (torch releases the GIL
    around each op's dispatch), so other threads get it without waiting for the
    interpreter's 5 ms switch interval. ``Engine.generate`` and the server both call
    ``stream_ids``, so both get it."""
    from bitmtp_edge.runtime.decoding import DecodeStats

    real = engine.stream_ids
    vocab = [t for t in engine.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + "
                                      "fibonacci(n - 2)\n") if t not in engine.eos_token_ids]

    def spin(seconds: float) -> None:
        # Work counted in slices between GIL releases: time another thread holds the GIL
        # (the wait in sleep(0)) is not work, so it delays the step, as in a host-bound loop.
        left = seconds
        while left > 0:
            start = time.perf_counter()
            slice_end = start + min(launch_us * 1e-6, left)
            while time.perf_counter() < slice_end:
                pass
            left -= time.perf_counter() - start
            time.sleep(0)  # the GIL let go, as around a kernel launch

    def paced(prompt_len, max_new_tokens, stats, should_stop):
        stats.prompt_tokens = prompt_len
        t0 = time.perf_counter()
        spin(prefill_us * 1e-6)
        stats.prefill_s = time.perf_counter() - t0
        t_start = time.perf_counter()
        try:
            for i in range(max_new_tokens):
                if should_stop is not None and should_stop():
                    stats.finish_reason = "cancelled"
                    return
                spin(step_us * 1e-6)
                stats.iterations += 1
                stats.new_tokens = i + 1
                yield [vocab[i % len(vocab)]]
            stats.finish_reason = "length"
        finally:
            stats.decode_s = time.perf_counter() - t_start

    def stream_ids(prompt, *, max_new_tokens=128, stats=None, should_stop=None, **kw):
        real(prompt, max_new_tokens=max_new_tokens, stats=stats, should_stop=should_stop, **kw).close()
        return paced(len(prompt) if not isinstance(prompt, str) else 0, max_new_tokens,
                     stats if stats is not None else DecodeStats(), should_stop)

    engine.stream_ids = stream_ids


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


class RawClient:
    """A lean HTTP/1.1 client for the timed requests (``http.client``, one kept-alive
    connection per server): the request bytes are built before the clock starts, the
    streamed body is read in whole socket reads with a timestamp each and parsed only after
    the last byte, so the client adds as little as possible to what is measured. It runs in
    its own process (``ClientProcess``): in the benchmark's process its every wake-up would
    take the GIL from the in-process server's decode loop. The tests drive the server with
    the official ``openai`` client; this one measures."""

    IDLE_S = 2.0  # reconnect (untimed) after this long idle: uvicorn closes idle connections after 5 s

    def __init__(self, url: str):
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self._connect = lambda: http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        self.conn, self.last_used = None, 0.0

    def get(self, path: str) -> tuple[int, bytes]:
        status, _, body, _ = self.request("GET", path, None)
        return status, body

    def request(self, method: str, path: str, body: bytes | None) -> tuple[int, list, bytes, float]:
        """(status, [(seconds since the start, bytes so far) per read], body, seconds until the
        request was written)."""
        if self.conn is None or time.monotonic() - self.last_used > self.IDLE_S:
            self.close()
            self.conn = self._connect()
            self.conn.connect()
            # As httpx does: a request written in two segments must not wait for a delayed ACK.
            self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        t0 = time.perf_counter()
        try:
            self.conn.request(method, path, body=body, headers=headers)
            sent = time.perf_counter() - t0
            resp = self.conn.getresponse()
            reads, parts, size = [], [], 0
            while True:
                part = resp.read1(1 << 16)
                if not part:
                    break
                size += len(part)
                parts.append(part)
                reads.append((time.perf_counter() - t0, size))
            resp.read()  # marks the response done: the connection takes the next request
            resp.close()
        except Exception:
            self.close()
            raise
        self.last_used = time.monotonic()
        if resp.will_close:
            self.close()
        return resp.status, reads, b"".join(parts), sent

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def request_body(prompt: str, policy: str, tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "stream": stream, "policy": policy}).encode()


def parse_sse(body: bytes, reads: list) -> dict:
    """A completions SSE body -> text, chunk count, the last chunk (usage, bitmtp) and when
    the first text arrived (the read that completed its event)."""
    pieces, chunks, last, first, offset = [], 0, None, None, 0
    for event in body.split(b"\n\n"):
        offset += len(event) + 2
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        chunk = json.loads(event[6:])
        if "error" in chunk:
            raise RuntimeError(f"the server streamed an error: {chunk['error']}")
        chunks += 1
        text = chunk["choices"][0]["text"]
        if text and first is None:
            first = next((t for t, size in reads if size >= offset - 2), None)
        pieces.append(text)
        if chunk.get("usage"):
            last = chunk
    if last is None:
        raise RuntimeError(f"the stream ended without a usage chunk: {body[-300:]!r}")
    return {"text": "".join(pieces), "chunks": chunks, "first_s": first, "last": last}


def timed_stream(client: RawClient, body: bytes) -> dict:
    status, reads, raw, sent = client.request("POST", "/v1/completions", body)
    wall = reads[-1][0] if reads else 0.0
    t0 = time.perf_counter()
    if status != 200:
        raise RuntimeError(f"POST /v1/completions (stream): HTTP {status}: {raw[:300]!r}")
    sse = parse_sse(raw, reads)
    return {"wall_s": wall, "tokens": sse["last"]["usage"]["completion_tokens"], "text": sse["text"],
            "first_s": sse["first_s"], "chunks": sse["chunks"], "client_send_s": sent,
            "client_parse_s": time.perf_counter() - t0, **_server_times(sse["last"]["bitmtp"])}


class ClientProcess:
    """The HTTP client in a child process of its own, one request per JSON line on its stdin
    (url, kind: stream or json, body), the timings as one JSON line back. Waiting on the
    pipe holds no GIL, and perf_counter is the same monotonic clock in both processes."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client-worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def call(self, url: str, kind: str, body: bytes) -> dict:
        self.proc.stdin.write(json.dumps({"url": url, "kind": kind, "body": body.decode()}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process exited ({self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{kind} request to {url}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def client_worker() -> None:
    """``--client-worker``: ClientProcess's other end."""
    clients: dict[str, RawClient] = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            client = clients.setdefault(req["url"], RawClient(req["url"]))
            timed = timed_stream if req["kind"] == "stream" else timed_json
            out = timed(client, req["body"].encode())
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            out = {"error": f"{type(e).__name__}: {e}"[:2000]}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    for client in clients.values():
        client.close()


def _server_times(stats: dict) -> dict:
    return {key: stats[key] for key in ("prefill_s", "decode_s", "server_s")}


def timed_json(client: RawClient, body: bytes) -> dict:
    status, reads, raw, sent = client.request("POST", "/v1/completions", body)
    wall = reads[-1][0] if reads else 0.0
    t0 = time.perf_counter()
    if status != 200:
        raise RuntimeError(f"POST /v1/completions: HTTP {status}: {raw[:300]!r}")
    data = json.loads(raw)
    return {"wall_s": wall, "tokens": data["usage"]["completion_tokens"], "text": data["choices"][0]["text"],
            "client_send_s": sent, "client_parse_s": time.perf_counter() - t0, **_server_times(data["bitmtp"])}


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
            # The client's own work, outside the wall: writing the request, parsing the reply.
            "client_send_us": 1e6 * _med(s.get("client_send_s", 0.0) for s in stream),
            "client_parse_us": 1e6 * _med(s.get("client_parse_s", 0.0) for s in stream),
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
              "| SSE: server set-up + hand-off | client µs: write request / parse reply |",
              "|---|---|---|---|---|---|"]
    for policy, s in policies.items():
        for name, v in s["servers"].items():
            lines.append(f"| {policy} | {name} | {s['direct_outside_ms']:.2f} | {_f(v['stream_outside_server_ms'], '.2f')} "
                         f"| {_f(v['stream_worker_rest_ms'], '.2f')} | {_f(v.get('client_send_us'), '.0f')} / "
                         f"{_f(v.get('client_parse_us'), '.0f')} |")
    lines += ["", "Percentages are of one AR decode step. Fixed: time outside prefill and decode (A) minus "
              "the same for B. Decode loop: the decode time per token of A minus B's, the HTTP work beside "
              "the decode thread included; across processes it also holds the two engines' own "
              "difference (each process's host-bound decode loop runs at its own few-% different pace: "
              "compare the JSON − Engine.generate rows, where the server does no per-token HTTP work). "
              "SSE − JSON pairs the two paths of one server process, so it isolates streaming's own cost. "
              "Prefill left out: ((A wall − A prefill) − (B wall − B prefill)) / tokens; the eager prefill "
              "varies by milliseconds between calls in every path alike. Wall: (A wall − B wall) / tokens. "
              "Outside the server's admission-to-end: HTTP exchange, parsing, validation, tokenising, the "
              "client's own work (the client's own CPU work outside the wall: the client columns). Server "
              "`interval N ms`: `--stream-interval-ms N`, at most one SSE chunk per N ms. `in-process`: "
              "uvicorn in a thread of the benchmark process over the same Engine object that "
              "Engine.generate runs, so A − B is the HTTP cost alone; `separate`: `bitmtp serve --port` "
              "in its own process with its own engine (as users run it; A − B also holds the two engines' "
              "few-% difference in pace). Only one path decodes at a time; the client is a lean "
              "http.client one in a process of its own."]
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
    if sys.argv[1:] == ["--client-worker"]:
        client_worker()
        return
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
                    help="comma-separated --stream-interval-ms values, one server each (per mode)")
    ap.add_argument("--modes", default="in-process,separate",
                    help="in-process: uvicorn in a thread of this process over its own Engine (the HTTP cost "
                         "alone); separate: `bitmtp serve --port` in its own process (as users run it)")
    ap.add_argument("--fake-step-us", type=float, default=None,
                    help="no model decode: a spin of this many µs per token, the GIL let go every 50 µs as around "
                         "kernel launches (host-side costs on a machine without the GPU; in-process mode only)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    ap.add_argument("--name", default="serve", help="output file stem [default: serve]")
    ap.add_argument("--resummarize", type=Path, default=None, metavar="SERVE_JSON",
                    help="only recompute the summaries and Markdown of a saved serve.json from its raw rows")
    args = ap.parse_args()
    if args.resummarize is not None:
        report = resummarize(args.resummarize)
        report["note"] = (f"summaries recomputed from this run's raw rows by `bench_serve.py --resummarize` at "
                          f"{commit()}")
        write_report(report, args.out, args.name)
        print(markdown(report))
        return
    if not 0 < args.short_tokens < args.tokens:
        ap.error(f"--short-tokens {args.short_tokens} must be in 1..--tokens-1 ({args.tokens - 1})")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"in-process", "separate"}:
        ap.error(f"--modes {args.modes!r}: give in-process, separate or both (comma-separated)")
    if args.fake_step_us is not None and "separate" in modes:
        ap.error("--fake-step-us paces this process's engine only; use --modes in-process")
    intervals = [float(x) for x in args.stream_intervals.split(",")]
    # On a CPU the processes share cores: OpenMP threads spinning after the other
    # process's last op would be charged to whichever path runs next.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch

    from bitmtp_edge.app.serve import warm_up
    from bitmtp_edge.runtime.engine import Engine

    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "tokens": args.tokens,
              "short_tokens": args.short_tokens, "repeats": args.repeats, "runtime": args.runtime,
              "modes": modes, "fake_step_us": args.fake_step_us, "http_stack": http_stack(), "policies": {}}
    if args.fake_step_us is not None:
        report["note"] = (f"fake decode: a {args.fake_step_us:g} µs spin per token (the GIL let go every 50 µs of it), "
                          "no model (host-side HTTP costs only)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: keep what was measured
    servers: dict[str, object] = {}
    client = None
    try:
        t0 = time.perf_counter()
        if "separate" in modes:  # their engines load while this one does
            servers.update({f"separate {ms:g} ms": Server(args, ms) for ms in intervals})
        engine = Engine.load(args.artifact, backend=args.backend, device=args.device, runtime=args.runtime)
        report["backend"] = engine.backend.name
        if args.fake_step_us is not None:
            pace_engine(engine, args.fake_step_us)
        warm_up(engine)
        if "in-process" in modes:
            servers.update({f"in-process {ms:g} ms": InProcessServer(engine, args, ms) for ms in intervals})
        for server in servers.values():
            server.wait_ready(args.start_timeout)
        client = ClientProcess()
        log(f"engine and {len(servers)} server(s) ready in {time.perf_counter() - t0:.1f} s")
        texts = prompts(engine, args.prompts)
        report["prompts"] = len(texts)
        lengths = (args.short_tokens, args.tokens)
        for policy in args.policies.split(","):
            if policy != "ar" and engine.manifest.mtp is None:
                continue
            t_policy = time.perf_counter()
            runs = measure_policy(engine, client, {name: s.url for name, s in servers.items()}, texts, policy,
                                  lengths, args.repeats)
            report["policies"][policy] = summarize(runs, list(servers), args.tokens)
            report.setdefault("rows", {})[policy] = [
                {k: {f: v for f, v in row[k].items() if f != "text"} for k in row} for row in runs]
            add_shares(report)
            s = report["policies"][policy]
            log(f"{policy} ({time.perf_counter() - t_policy:.1f} s): direct {s['direct_decode_tok_s']:.0f} tok/s "
                f"decode, {s['direct_wall_tok_s']:.0f} wall; "
                + "; ".join(f"{name}: SSE − direct decode {v['stream_vs_direct']['decode_us_per_token']:.1f} "
                            f"µs/token, all-in {v['stream_vs_direct']['no_prefill_us_per_token']:.1f}, fixed "
                            f"{v['stream_vs_direct']['fixed_ms_per_request']:.2f} ms"
                            for name, v in s["servers"].items()))
            write_report(report, args.out, args.name)
    except BaseException as e:  # noqa: BLE001 - keep what was measured (SIGTERM from `timeout` too)
        report["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        if client is not None:
            client.close()
        for server in servers.values():
            server.stop()
        write_report(report, args.out, args.name)
        print(markdown(report))


def measure_policy(engine, client: ClientProcess, urls: dict, texts: list[str], policy: str, lengths: tuple,
                   repeats: int) -> list:
    """Every path once untimed (each prompt length's first prefill compiles kernels), then
    ``repeats`` rounds; within a row the paths run back to back in an order that rotates."""
    paths = {"direct": lambda text, n: timed_direct(engine, text, policy, n)}
    bodies = {(text, n, stream): request_body(text, policy, n, stream)
              for text in texts for n in lengths for stream in (True, False)}
    for name, url in urls.items():
        paths[f"stream@{name}"] = lambda text, n, u=url: client.call(u, "stream", bodies[text, n, True])
        paths[f"json@{name}"] = lambda text, n, u=url: client.call(u, "json", bodies[text, n, False])
    order = list(paths)
    for text in texts:
        for n in lengths:
            for run in paths.values():
                run(text, n)
    runs = []
    for rep in range(repeats):
        for i, text in enumerate(texts):
            for n in lengths:
                k = (rep + i + (n == lengths[1])) % len(order)  # rotate which path goes first
                row = {}
                for key in order[k:] + order[:k]:
                    row[key] = {**paths[key](text, n), "requested": n}
                runs.append(row)
    return runs


def write_report(report: dict, out: Path, name: str) -> None:
    """``NAME.json`` and ``NAME.md`` under ``out``, each replaced whole."""
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=1)), (".md", markdown(report))):
        tmp = out / f".{name}{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(out / f"{name}{suffix}")


if __name__ == "__main__":
    main()
