"""``bitmtp serve`` under hostile or careless clients: real UNIX sockets in a tmp folder,
bounded waits everywhere (a regression here used to be a hang or a dead server)."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bitmtp_edge.app import serve as S
from bitmtp_edge.runtime.engine import Engine

from .helpers import random_model, write_test_artifact

WAIT_S = 60.0


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return write_test_artifact(random_model(seed=4), tmp_path_factory.mktemp("serve") / "model", block_size=4)


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.load(artifact, backend="reference", device="cpu")


@pytest.fixture
def server(engine, tmp_path):
    """A running server on tmp_path/s.sock; yields it, then stops it."""
    path = tmp_path / "s.sock"
    srv = S.UnixServer(path, engine, max_connections=3)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(WAIT_S)


def connect(path) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(WAIT_S)
    c.connect(str(path))
    return c


def read_line(c: socket.socket) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = c.recv(65536)
        assert chunk, f"connection closed after {buf!r}"
        buf += chunk
    return json.loads(buf.split(b"\n")[0])


def closed(c: socket.socket) -> bool:
    try:
        return c.recv(65536) == b""
    except ConnectionResetError:
        return True


REQUEST = json.dumps({"id": 1, "prompt": [5, 17, 33], "max_new_tokens": 4, "policy": "ar"}) + "\n"


# ----------------------------------------------------------------------------- nesting and line length


def test_deep_nesting_on_stdin_is_an_error_response_and_the_server_lives(engine):
    out = io.StringIO()
    served = S.serve_lines(engine, io.StringIO("[" * 200_000 + "\n" + REQUEST), out, threading.Lock())
    first, second = [json.loads(x) for x in out.getvalue().splitlines()]
    assert served == 2 and "nested too deeply" in first["error"]
    assert len(second["token_ids"]) == 4


def test_deep_nesting_on_the_socket_is_an_error_response_and_the_connection_lives(server):
    c = connect(server.path)
    c.sendall(b"[" * 200_000 + b"\n")
    assert "nested too deeply" in read_line(c)["error"]
    c.sendall(REQUEST.encode())
    assert len(read_line(c)["token_ids"]) == 4


def test_an_over_long_line_on_stdin_is_refused_and_skipped(engine, monkeypatch):
    monkeypatch.setattr(S, "MAX_LINE_BYTES", 1024)
    out = io.StringIO()
    S.serve_lines(engine, io.StringIO("x" * 5000 + "\n" + REQUEST), out, threading.Lock())
    first, second = [json.loads(x) for x in out.getvalue().splitlines()]
    assert "longer than 1024 bytes" in first["error"] and len(second["token_ids"]) == 4


def test_an_over_long_line_on_the_socket_gets_an_error_and_the_connection_closes(server, monkeypatch):
    monkeypatch.setattr(S, "MAX_LINE_BYTES", 1024)
    c = connect(server.path)
    c.sendall(b"y" * 10_000)  # no newline: it used to be buffered without limit
    assert "longer than 1024 bytes" in read_line(c)["error"]
    assert closed(c)


# ----------------------------------------------------------------------------- backlog, pool, idle, EMFILE


def test_fifty_clients_arriving_together_are_queued_not_refused(engine, tmp_path):
    srv = S.UnixServer(tmp_path / "b.sock", engine)  # not accepting yet: all wait in the backlog
    clients = []
    try:
        for _ in range(50):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            c.connect(str(srv.path))  # EAGAIN here with a backlog of 5
            clients.append(c)
    finally:
        for c in clients:
            c.close()
        srv.server_close()
    assert len(clients) == 50


def test_connections_beyond_the_pool_get_busy_and_threads_stay_bounded(server):
    before = threading.active_count()
    idle = [connect(server.path) for _ in range(3)]
    deadline = time.monotonic() + WAIT_S
    while threading.active_count() < before + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    extra = [connect(server.path) for _ in range(5)]
    for c in extra:
        assert "server busy" in read_line(c)["error"] and closed(c)
    assert threading.active_count() <= before + 3
    for c in idle:
        c.close()
    # A freed slot serves again.
    deadline = time.monotonic() + WAIT_S
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    c = connect(server.path)
    c.sendall(REQUEST.encode())
    assert len(read_line(c)["token_ids"]) == 4


def test_an_idle_connection_is_closed_after_the_timeout(server, monkeypatch):
    monkeypatch.setattr(S._Handler, "timeout", 0.3)
    c = connect(server.path)
    t0 = time.monotonic()
    assert closed(c)
    assert 0.2 < time.monotonic() - t0 < WAIT_S


class _NoDescriptors:
    """A listening socket whose accept() fails with EMFILE (as under ``ulimit -n``)."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def accept(self):
        self.calls += 1
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_out_of_descriptors_backs_off_instead_of_spinning(engine, tmp_path):
    srv = S.UnixServer(tmp_path / "e.sock", engine)
    srv.socket = _NoDescriptors(srv.socket)
    try:
        t0, cpu0 = time.monotonic(), time.process_time()
        for _ in range(4):
            srv._handle_request_noblock()  # what serve_forever calls while the socket is readable
        waited = time.monotonic() - t0
        assert waited >= sum(S.ACCEPT_BACKOFF_S[0] * 2 ** i for i in range(4)) * 0.9
        assert time.process_time() - cpu0 < waited / 2  # slept, not spun
    finally:
        srv.socket = srv.socket.real
        srv.server_close()


# ----------------------------------------------------------------------------- cancellation


def test_should_stop_cancels_between_iterations(engine):
    polls = []

    def stop_after_two():
        polls.append(1)
        return len(polls) > 2

    res = engine.generate([5, 17, 33], max_new_tokens=50, policy="ar", should_stop=stop_after_two)
    assert res.stats.finish_reason == "cancelled" and len(res.token_ids) == 2


def test_a_client_that_hangs_up_cancels_its_generation(server, engine, monkeypatch):
    done = []
    real = engine.generate

    def spy(*args, **kw):
        res = real(*args, **kw)
        done.append(res.stats)
        return res
    monkeypatch.setattr(engine, "generate", spy)
    c = connect(server.path)
    c.sendall((json.dumps({"prompt": [5, 17, 33], "max_new_tokens": 400, "policy": "ar"}) + "\n").encode())
    c.close()
    deadline = time.monotonic() + WAIT_S
    while not done and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done and done[0].finish_reason == "cancelled" and done[0].new_tokens < 400


def test_a_client_that_only_half_closes_still_gets_its_reply(server):
    c = connect(server.path)
    c.sendall(REQUEST.encode())
    c.shutdown(socket.SHUT_WR)  # nc -N / socat: end of request, still reading
    reply = read_line(c)
    assert len(reply["token_ids"]) == 4 and reply["stats"]["finish_reason"] == "length"


# ----------------------------------------------------------------------------- the socket file


def test_close_unlinks_only_the_socket_it_created(engine, tmp_path):
    path = tmp_path / "own.sock"
    S.UnixServer(path, engine).server_close()
    assert not path.exists()
    srv = S.UnixServer(path, engine)
    path.unlink()
    path.write_text("someone else's file")
    srv.server_close()
    assert path.read_text() == "someone else's file"


def test_sigterm_leaves_a_file_that_replaced_the_socket(artifact, tmp_path):
    path = tmp_path / "term.sock"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "bitmtp_edge.app.cli", "serve", "-a", str(artifact),
                             "--device", "cpu", "--backend", "reference", "--no-warmup", "--socket", str(path)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not path.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert path.exists(), proc.stderr.read().decode() if proc.poll() is not None else "no socket"
        path.unlink()
        path.write_text("not a socket")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        assert path.read_text() == "not a socket"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
