"""``bitmtp serve``: one resident model answering JSON-lines requests.

The process pays the start-up cost once (weights, KV segments, captured CUDA graphs, one
warm-up generation per policy for the kernels' first-call costs) and then serves requests
from stdin (responses on stdout) or from a UNIX socket (jetson/bitmtp.service). Requests
run one at a time (batch 1, one KV buffer); concurrent socket clients queue.

Request, one JSON object per line::

    {"id": 7, "prompt": "def add(a, b):\\n", "max_new_tokens": 64, "policy": "hybrid",
     "tau": 0.9, "min_prefix": 3, "stop": ["\\n\\n"], "stream": false}
    {"id": 9, "prompt": "def f(x):", "temperature": 0.8, "top_p": 0.95, "seed": 1}  (sampled)
    {"id": 8, "op": "info"}

Only ``prompt`` is required (text, or a list of token ids). Responses::

    {"id": 7, "text": "...", "token_ids": [...], "stats": {...}}
    {"id": 7, "delta": "..."} ... {"id": 7, "done": true, "text": "...", "stats": {...}}  (stream)
    {"id": 7, "error": "what was wrong"}
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runtime.engine import Engine

log = logging.getLogger(__name__)

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed"}
REQUEST_KEYS = {"id", "op", "prompt", "max_new_tokens", "policy", "tau", "min_prefix", "stop", "stream"} | SAMPLING_KEYS


@dataclass(frozen=True)
class ServeDefaults:
    policy: str = "hybrid"
    max_new_tokens: int = 128
    max_new_tokens_limit: int = 4096


def warm_up(engine: Engine) -> None:
    """First-call costs (allocator, Triton JIT for each width) paid before the first request."""
    policies = ["ar"] if engine.manifest.mtp is None else ["ar", "confidence", "speculative", "hybrid"]
    ids = engine.encode("def f(x):\n") or [0]
    for policy in policies:
        engine.generate(ids, max_new_tokens=8, policy=policy)
        engine.generate(ids, max_new_tokens=8, policy=policy, temperature=1.0, seed=0)  # the sampled graphs


def info(engine: Engine) -> dict:
    m = engine.manifest
    return {"artifact": str(engine.path), "backend": engine.backend.name, "device": str(engine.device),
            "family": m.model.family, "layers": m.model.num_layers, "vocab": m.model.vocab_size,
            "block_size": engine.block_size, "max_context": engine.backend.max_context}


def handle(engine: Engine, request: Any, defaults: ServeDefaults = ServeDefaults()) -> Iterator[dict]:
    """Responses to one parsed request (several when it streams)."""
    from ..runtime.decoding import DecodeStats, DecodingError

    rid = request.get("id") if isinstance(request, dict) else None
    try:
        if not isinstance(request, dict):
            raise TypeError("a request must be a JSON object, e.g. {\"prompt\": \"def f(x):\"}")
        unknown = set(request) - REQUEST_KEYS
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(REQUEST_KEYS))}")
        op = request.get("op", "generate")
        if op == "info":
            yield {"id": rid, "info": info(engine)}
            return
        if op != "generate":
            raise ValueError(f"unknown op {op!r}; use \"generate\" (the default) or \"info\"")
        prompt = request.get("prompt")
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise ValueError("\"prompt\" must be a non-empty string or a list of token ids")
        n = request.get("max_new_tokens", defaults.max_new_tokens)
        if not isinstance(n, int) or not 1 <= n <= defaults.max_new_tokens_limit:
            raise ValueError(f"\"max_new_tokens\" must be an integer in 1..{defaults.max_new_tokens_limit}")
        stop = request.get("stop")
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ValueError("\"stop\" must be a list of strings")
        kw = {"max_new_tokens": n, "policy": request.get("policy", defaults.policy), "tau": request.get("tau"),
              "min_prefix": request.get("min_prefix"), "stop": stop,
              **{k: request[k] for k in SAMPLING_KEYS if request.get(k) is not None}}
        if request.get("stream"):
            stats = DecodeStats()
            text = []
            for piece in engine.stream(prompt, stats=stats, **kw):
                text.append(piece)
                yield {"id": rid, "delta": piece}
            yield {"id": rid, "done": True, "text": "".join(text), "stats": stats.to_dict()}
        else:
            res = engine.generate(prompt, **kw)
            yield {"id": rid, "text": res.text, "token_ids": res.token_ids, "stats": res.stats.to_dict()}
    except (DecodingError, ValueError, TypeError) as e:
        yield {"id": rid, "error": str(e)}
    except Exception as e:
        log.exception("request %r failed", rid)
        yield {"id": rid, "error": f"internal error ({type(e).__name__}: {e}); see the server log"}


def serve_lines(engine: Engine, infile: IO[str], outfile: IO[str], lock: threading.Lock,
                defaults: ServeDefaults = ServeDefaults()) -> int:
    """Answer every line of ``infile`` on ``outfile`` until end of input; returns requests served."""
    served = 0
    for n, line in enumerate(infile, start=1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except json.JSONDecodeError as e:
            responses: Iterator[dict] = iter([{"id": None, "error": f"line {n}: not valid JSON ({e.msg})"}])
        else:
            responses = handle(engine, request, defaults)
        with lock:  # one generation at a time: the engine owns one KV buffer
            for response in responses:
                outfile.write(json.dumps(response) + "\n")
                outfile.flush()
        served += 1
    return served


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: UnixServer = self.server  # type: ignore[assignment]
        infile = (line.decode("utf-8", errors="replace") for line in self.rfile)
        out = _TextWriter(self.wfile)
        try:
            serve_lines(server.engine, infile, out, server.lock, server.defaults)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away mid-reply


class _TextWriter:
    def __init__(self, raw):
        self.raw = raw

    def write(self, s: str) -> None:
        self.raw.write(s.encode("utf-8"))

    def flush(self) -> None:
        self.raw.flush()


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str | os.PathLike, engine: Engine, defaults: ServeDefaults = ServeDefaults(),
                 mode: int = 0o660):
        self.engine, self.defaults, self.lock = engine, defaults, threading.Lock()
        self.path = Path(path)
        _clear_stale_socket(self.path)
        super().__init__(str(self.path), _Handler)
        os.chmod(self.path, mode)  # the service's group may connect, nobody else

    def server_close(self) -> None:
        super().server_close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _clear_stale_socket(path: Path) -> None:
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise OSError(f"{path} exists and is not a socket; remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:  # nobody listening: left behind by a process that died
        path.unlink()
        return
    finally:
        probe.close()
    raise OSError(f"{path}: another server is already listening there; stop it or choose another --socket")
