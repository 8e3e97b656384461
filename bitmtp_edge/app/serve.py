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

Limits (a socket may be reachable by other local users): a request line holds at most
``MAX_LINE_BYTES`` (a longer one gets an error and, on a socket, the connection is closed);
JSON nested deeper than the parser's recursion limit gets an error; at most
``MAX_CONNECTIONS`` clients are connected at once (more get a "busy" error); a connection
idle for ``IDLE_TIMEOUT_S`` is closed; a client that hangs up while its (non-streaming)
request runs cancels that generation, so the next client does not wait for it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runtime.engine import Engine

log = logging.getLogger(__name__)

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed"}
REQUEST_KEYS = {"id", "op", "prompt", "max_new_tokens", "policy", "tau", "min_prefix", "stop", "stream"} | SAMPLING_KEYS

# A prompt as long as a 128k-token context is ~0.5 MB of text or ~1 MB of ids; 4 MiB leaves
# room and bounds what one client can make the server buffer.
MAX_LINE_BYTES = 4 << 20
# Generations run one at a time (one KV buffer), so more connections would only queue;
# each holds a thread and a descriptor.
MAX_CONNECTIONS = 32
LISTEN_BACKLOG = 128  # clients arriving together wait in the kernel, not with EAGAIN
IDLE_TIMEOUT_S = 120.0  # a connected client that sends nothing (and reads nothing) for this long is dropped
ACCEPT_BACKOFF_S = (0.05, 1.0)  # out of descriptors: wait (doubling) instead of spinning on accept()


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
            "head": engine.head, "family": m.model.family, "layers": m.model.num_layers, "vocab": m.model.vocab_size,
            "block_size": engine.block_size, "max_context": engine.backend.max_context}


def handle(engine: Engine, request: Any, defaults: ServeDefaults = ServeDefaults(),
           should_stop: Callable[[], bool] | None = None) -> Iterator[dict]:
    """Responses to one parsed request (several when it streams). ``should_stop()`` (polled
    between decode iterations) cancels the generation, e.g. when the client hung up."""
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
              "min_prefix": request.get("min_prefix"), "stop": stop, "should_stop": should_stop,
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


class LineTooLong(ValueError):
    """A request line longer than ``MAX_LINE_BYTES``."""


def read_lines(readline: Callable[[int], Any], limit: int | None = None,
               skip_long: bool = True) -> Iterator[Any]:
    """Lines from ``readline(size)`` (text or bytes), each at most ``limit`` (default
    ``MAX_LINE_BYTES``) long. A longer line yields a ``LineTooLong`` (an instance, not
    raised) and, with ``skip_long``, the rest of it is read and dropped in bounded pieces;
    without, reading ends there."""
    limit = MAX_LINE_BYTES if limit is None else limit
    while True:
        line = readline(limit + 1)
        if not line:
            return
        newline = b"\n" if isinstance(line, bytes) else "\n"
        if len(line) > limit and not line.endswith(newline):
            yield LineTooLong(f"request line longer than {limit} bytes; send one JSON object per line")
            if not skip_long:
                return
            while line and not line.endswith(newline):
                line = readline(limit)
            continue
        yield line


def parse_request(n: int, line: str) -> tuple[Any, str | None]:
    """(request, None) or (None, the error a client gets)."""
    try:
        return json.loads(line), None
    except json.JSONDecodeError as e:
        return None, f"line {n}: not valid JSON ({e.msg})"
    except RecursionError:  # "[[[[..." : the parser's depth limit, not a crash
        return None, f"line {n}: JSON nested too deeply; a request is one flat object"


def serve_lines(engine: Engine, infile: IO[str], outfile: IO[str], lock: threading.Lock,
                defaults: ServeDefaults = ServeDefaults(), should_stop: Callable[[], bool] | None = None,
                lines: Iterator[Any] | None = None) -> int:
    """Answer every line of ``infile`` (or of ``lines``) on ``outfile`` until end of input;
    returns requests served. A line over ``MAX_LINE_BYTES`` gets an error response and is
    skipped (``lines`` decides whether reading goes on)."""
    served = 0
    if lines is None:
        lines = read_lines(infile.readline)
    for n, line in enumerate(lines, start=1):
        if isinstance(line, LineTooLong):
            request, error = None, f"line {n}: {line}"
        elif not line.strip():
            continue
        else:
            request, error = parse_request(n, line)
        responses: Iterator[dict] = iter([{"id": None, "error": error}]) if error else \
            handle(engine, request, defaults, should_stop)
        with lock:  # one generation at a time: the engine owns one KV buffer
            for response in responses:
                outfile.write(json.dumps(response) + "\n")
                outfile.flush()
        served += 1
    return served


class _Handler(socketserver.StreamRequestHandler):
    timeout = IDLE_TIMEOUT_S  # applied to the connection's socket: idle reads and stuck writes end it

    def handle(self) -> None:
        server: UnixServer = self.server  # type: ignore[assignment]
        # A line over the limit ends the connection: the rest of it is not worth reading.
        lines = (x if isinstance(x, LineTooLong) else x.decode("utf-8", errors="replace")
                 for x in read_lines(self.rfile.readline, skip_long=False))
        out = _TextWriter(self.wfile)
        try:
            serve_lines(server.engine, None, out, server.lock, server.defaults,
                        should_stop=client_gone(self.connection), lines=lines)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the client went away mid-reply, or stayed idle too long


def client_gone(conn: socket.socket) -> Callable[[], bool]:
    """``should_stop`` for a connection: True once the peer has closed it (POLLHUP/POLLERR).
    A peer that only shut down its sending side (``nc -N``, ``socat``) still waits for the
    reply, so end-of-input alone does not cancel. One non-blocking poll per decode iteration."""
    poller = select.poll()
    poller.register(conn, select.POLLHUP | select.POLLERR)

    def gone() -> bool:
        return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in poller.poll(0))
    return gone


class _TextWriter:
    def __init__(self, raw):
        self.raw = raw

    def write(self, s: str) -> None:
        self.raw.write(s.encode("utf-8"))

    def flush(self) -> None:
        self.raw.flush()


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, path: str | os.PathLike, engine: Engine, defaults: ServeDefaults = ServeDefaults(),
                 mode: int = 0o660, max_connections: int = MAX_CONNECTIONS):
        self.engine, self.defaults, self.lock = engine, defaults, threading.Lock()
        self.path = Path(path)
        self.slots = threading.BoundedSemaphore(max_connections)
        self._backoff = ACCEPT_BACKOFF_S[0]
        _clear_stale_socket(self.path)
        super().__init__(str(self.path), _Handler)
        os.chmod(self.path, mode)  # the service's group may connect, nobody else
        st = os.lstat(self.path)
        self._bound = (st.st_dev, st.st_ino)  # what we created: the only thing we remove at exit

    def get_request(self):
        try:
            request = super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # The pending connection stays in the backlog and the socket stays readable:
                # returning at once would spin at 100% CPU until a descriptor frees up.
                log.warning("accept: %s; retrying in %.2f s", os.strerror(e.errno), self._backoff)
                time.sleep(self._backoff)
                self._backoff = min(2 * self._backoff, ACCEPT_BACKOFF_S[1])
            raise
        self._backoff = ACCEPT_BACKOFF_S[0]
        return request

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):  # bounded: no thread per idle connection
            try:
                request.sendall((json.dumps({"id": None, "error": f"server busy: {MAX_CONNECTIONS} clients "
                                             "connected; retry later"}) + "\n").encode())
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def server_close(self) -> None:
        super().server_close()
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._bound:
            self.path.unlink()
        else:  # someone replaced it (a file, another server's socket): not ours to delete
            log.warning("%s is no longer the socket this server created; left in place", self.path)


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
