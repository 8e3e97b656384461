"""``bitmtp serve --port P``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(JSON or SSE streaming as OpenAI streams), ``GET /health`` and ``GET /metrics``
(Prometheus text).

**Batch 1, honestly.** One engine, one KV buffer: a single worker thread runs one
generation at a time, and requests wait in a FIFO queue of bounded length (full: 503 with
a message, so a client can back off). Everything a generation would refuse (unknown
model, bad sampling values, a prompt longer than the largest KV segment ...) is checked
before queueing and answered 400 with what to change. A client that disconnects sets its
job's cancel flag; the decode loop reads it before every iteration, so the engine is free
again one iteration later (or the job is dropped from the queue unrun).

The event loop never touches the engine: the worker appends each iteration's token ids
(or, when the request has stop strings to watch for, its decoded text) to the request's
``EventPipe`` and the request handler turns them into one JSON body or SSE chunks. **Per
token the decode loop does what ``Engine.generate`` does** (collect ids; detokenise only
for stop strings) **plus an append under a lock**; the reader decodes each batch of ids in
one tokenizer call when it wakes. Waking the event loop costs a
self-pipe write plus the loop's Python work, which competes with the decode loop for the
GIL right when it launches the next step (on the H200, a chunk per token slowed the 250 µs
AR step by ~17 µs; one chunk per 5 ms by ~7 µs: tools/results/serve.md). So the loop is
woken only when the reader waits for it; a streaming reader takes whatever piled up at
most once per ``stream_interval_s`` (tokens decoded faster than that share one SSE chunk,
as OpenAI's protocol allows: a chunk's text may hold several tokens), and a JSON reader
only at the end. A slow decoder (a token per interval or slower) still streams token by
token, and the request's end wakes the reader at once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here

from ..runtime.decoding import DecodeStats, DecodingError
from ..runtime.detokenize import TextStream
from . import openai_schema as oa

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from ..jetson.monitor import Sampler

log = logging.getLogger("bitmtp_edge.http")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    policy: str = "hybrid"
    max_tokens: int = 128  # when a request gives none
    max_tokens_limit: int = 4096
    max_queue: int = 16  # requests waiting behind the running one
    # Streaming: at most one SSE chunk per this many seconds (0: one per wake-up, each
    # carrying whatever the worker posted meanwhile); see EventPipe.
    stream_interval_s: float = 0.005
    sampling_defaults: dict = field(default_factory=lambda: {"temperature": 1.0})


def generation_defaults(engine: Engine) -> dict:
    """The model's sampling defaults (generation_config.json), else OpenAI's (temperature 1).
    ``do_sample: false`` makes greedy the default, as transformers does."""
    path = engine.path / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        log.warning("%s: unreadable; using OpenAI's sampling defaults", path)
        config = {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    out = {"temperature": float(config.get("temperature", 1.0))}
    for key in ("top_p", "top_k", "repetition_penalty"):
        if key in config:
            out[key] = config[key]
    return out


class QueueFull(Exception):
    pass


class BadRequest(Exception):
    """A request the server refuses: 400 unless ``status`` says otherwise (an unknown model is
    OpenAI's 404 ``model_not_found``, which clients raise as NotFoundError)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


# --- the worker ---------------------------------------------------------------------------------

FINAL_EVENTS = frozenset({"done", "error", "cancelled"})  # a job's last event is one of these


class EventPipe:
    """One job's events, from the worker thread to the event loop, in batches.

    ``post`` (worker thread) appends under a lock and wakes the loop only when a reader is
    waiting for that kind of event; ``take`` (event loop) returns everything that piled up,
    waiting first if nothing has. Events: ("ids", token ids) or ("delta", text) (the
    worker decodes the text itself only when stop strings need watching), ("done", stats),
    ("error", status, message), ("cancelled",)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple] = []
        self._ended = False  # a final event is among the items
        self._waiter: asyncio.Future | None = None
        self._final_only = False  # the waiter wants only the job's end

    def post(self, *event) -> None:
        final = event[0] in FINAL_EVENTS
        with self._lock:
            self._items.append(event)
            self._ended = self._ended or final
            waiter = self._waiter
            if waiter is None or (self._final_only and not final):
                return  # the reader will look when it comes back
            self._waiter = None
        try:
            self._loop.call_soon_threadsafe(_resolve, waiter)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    async def take(self, final_only: bool = False, timeout: float | None = None) -> list[tuple]:
        """Every event posted since the last take. Waits while there is none (``final_only``:
        until the job's end) or until ``timeout`` seconds; may then return [] or a batch
        without the end."""
        with self._lock:
            if self._items and (self._ended or not final_only):
                return self._take()
            waiter = self._waiter = self._loop.create_future()
            self._final_only = final_only
        timer = self._loop.call_later(timeout, _resolve, waiter) if timeout is not None else None
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                if self._waiter is waiter:
                    self._waiter = None
        with self._lock:
            return self._take()

    def _take(self) -> list[tuple]:
        items, self._items = self._items, []
        return items


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class Job:
    rid: str
    endpoint: str
    prompt_ids: list[int]
    decode_kw: dict  # max_new_tokens, policy, tau, min_prefix, sampling
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    tokenizer: Any  # the reader decodes ("ids", ...) events with it
    events: EventPipe = field(init=False)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # the worker took it
    finished: float | None = None  # the worker posted its end

    def __post_init__(self):
        self.events = EventPipe(self.loop)

    def post(self, *event) -> None:
        self.events.post(*event)

    def report(self, stats) -> dict:
        """The response's ``bitmtp`` field: the decoding stats plus the server's own times
        from admission (request checked and tokenised): waiting in the queue, and until the
        end was handed to the response."""
        out = stats.to_dict()
        if self.started is not None and self.finished is not None:
            out["queue_s"], out["server_s"] = self.started - self.submitted, self.finished - self.submitted
        return out


class Worker:
    """One thread, one generation at a time, FIFO."""

    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.running: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="bitmtp-generate", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            self._drop_left()
            return len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._cond:
            self._drop_left()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are already waiting for the "
                                f"one model (batch 1, --max-queue {self.max_queue}); retry in a moment")
            self._waiting.append(job)
            self._cond.notify()

    def _drop_left(self) -> None:
        """Drop the waiting jobs whose clients left (timed out, gone to retry): kept until
        their turn, they would hold queue places and turn the retry away with a 503. Called
        with ``_cond`` held."""
        if not any(job.cancel.is_set() for job in self._waiting):
            return
        left = [job for job in self._waiting if job.cancel.is_set()]
        self._waiting = collections.deque(job for job in self._waiting if not job.cancel.is_set())
        for job in left:
            self.metrics.cancelled(job)
            job.post("cancelled")

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for job in self._waiting:
                job.cancel.set()
            if self.running is not None:
                self.running.cancel.set()
            self._cond.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                self.running = job
            try:
                if job.cancel.is_set():  # the client left while queued
                    self.metrics.cancelled(job)
                    job.post("cancelled")
                else:
                    self._generate(job)
            finally:
                self.running = None

    def _generate(self, job: Job) -> None:
        job.started = time.perf_counter()
        stats = DecodeStats()
        started = time.monotonic()
        try:
            if not job.stop:
                # Nothing to watch for: the decode loop only hands the ids over (an append
                # under a lock, as Engine.generate collects them); the reader decodes the text.
                post = job.events.post
                for chunk in self.engine.stream_ids(job.prompt_ids, stats=stats, should_stop=job.cancel.is_set,
                                                    **job.decode_kw):
                    post("ids", chunk)
            else:  # a stop string ends the generation where it shows, the usage counted as AR's
                for piece in self.engine.stream(job.prompt_ids, stop=job.stop, stats=stats,
                                                should_stop=job.cancel.is_set, **job.decode_kw):
                    job.post("delta", piece)
        except DecodingError as e:  # checked before queueing; kept as a safety net
            job.post("error", 400, str(e))
            return
        except Exception as e:
            log.exception("%s failed", job.rid)
            job.post("error", 500, f"internal error ({type(e).__name__}: {e}); see the server log")
            return
        energy = self.metrics.window_energy(started, time.monotonic())
        if stats.finish_reason == "cancelled":
            self.metrics.cancelled(job)
            log.info("%s %s cancelled (the client left) after %d tokens", job.rid, job.endpoint, stats.new_tokens)
            job.post("cancelled")
            return
        self.metrics.finished(job, stats, energy)
        if log.isEnabledFor(logging.INFO):  # its arguments cost a few µs to build; none when off
            log.info("%s %s policy=%s prompt=%d completion=%d tok/s=%.1f tokens/iter=%.2f%s finish=%s "
                     "queue+total=%.0fms",
                     job.rid, job.endpoint, job.decode_kw["policy"], stats.prompt_tokens, stats.new_tokens,
                     stats.decode_tokens_per_s, stats.tokens_per_iteration, _per_pass(stats), stats.finish_reason,
                     1e3 * (time.perf_counter() - job.submitted))
        job.finished = time.perf_counter()
        job.post("done", stats)


def _per_pass(stats) -> str:
    passes = getattr(stats, "forward_passes", None)
    return f" tokens/pass={stats.new_tokens / passes:.2f}" if passes else ""


# --- metrics ------------------------------------------------------------------------------------

class Metrics:
    """Counters since start, rendered as Prometheus text."""

    def __init__(self, sampler: Sampler | None = None):
        self.sampler = sampler
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (endpoint, status) -> n
        self.totals: collections.Counter = collections.Counter()
        self.fused_passes: collections.Counter = collections.Counter()  # c -> fused passes that carried c blocks
        self.worker: Worker | None = None

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def cancelled(self, job: Job) -> None:
        with self._lock:
            self.totals["cancelled"] += 1

    def finished(self, job: Job, stats, energy_j: float | None) -> None:
        with self._lock:
            t = self.totals
            t["generations"] += 1
            t["prompt_tokens"] += stats.prompt_tokens
            t["completion_tokens"] += stats.new_tokens
            t["decode_s"] += stats.decode_s
            t["iterations"] += stats.iterations
            t["verifier_calls"] += stats.verifier_calls
            passes = getattr(stats, "forward_passes", None)
            if passes is not None:
                t["forward_passes"] += passes
            self.fused_passes.update(getattr(stats, "fused_candidates", None) or {})  # fixed c, or the chooser's mix
            t["certified_head_calls"] += getattr(stats, "certified_head_calls", 0)
            t["certified_head_int8"] += getattr(stats, "certified_head_int8", 0)
            if energy_j is not None:
                t["energy_j"] += energy_j
                t["energy_tokens"] += stats.new_tokens

    def window_energy(self, start: float, end: float) -> float | None:
        if self.sampler is None:
            return None
        try:
            return self.sampler.mark_window(start, end, wait_s=0).energy_j
        except Exception as e:  # a monitor hiccup must not fail a request
            log.warning("power monitor: %s", e)
            return None

    def render(self) -> str:
        with self._lock:
            t, requests, fused = dict(self.totals), dict(self.requests), sorted(self.fused_passes.items())
        lines: list[str] = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP bitmtp_{name} {help_text}")
            lines.append(f"# TYPE bitmtp_{name} {kind}")
            for labels, value in samples:
                lines.append(f"bitmtp_{name}{labels} {value:.6g}" if isinstance(value, float)
                             else f"bitmtp_{name}{labels} {value}")

        def ratio(a, b):
            return float(t.get(a, 0)) / t[b] if t.get(b) else 0.0

        metric("requests_total", "counter", "HTTP requests answered, by endpoint and status.",
               [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(requests.items())])
        metric("generations_total", "counter", "Generations completed.", [("", t.get("generations", 0))])
        metric("cancelled_total", "counter", "Generations cancelled by a disconnecting client.",
               [("", t.get("cancelled", 0))])
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [("", t.get("prompt_tokens", 0))])
        metric("completion_tokens_total", "counter", "Tokens generated.", [("", t.get("completion_tokens", 0))])
        metric("decode_seconds_total", "counter", "Time spent decoding (after prefill).",
               [("", float(t.get("decode_s", 0.0)))])
        metric("iterations_total", "counter", "Decoding iterations.", [("", t.get("iterations", 0))])
        metric("verifier_calls_total", "counter", "Verify steps run.", [("", t.get("verifier_calls", 0))])
        metric("decode_tokens_per_second", "gauge", "Generated tokens per decoding second, since start.",
               [("", ratio("completion_tokens", "decode_s"))])
        metric("tokens_per_iteration", "gauge", "Generated tokens per decoding iteration, since start.",
               [("", ratio("completion_tokens", "iterations"))])
        metric("verifier_call_rate", "gauge", "Verify steps per iteration, since start.",
               [("", ratio("verifier_calls", "iterations"))])
        if "forward_passes" in t:
            metric("forward_passes_total", "counter", "Model forward passes.", [("", t["forward_passes"])])
            metric("tokens_per_forward_pass", "gauge", "Generated tokens per forward pass, since start.",
                   [("", ratio("completion_tokens", "forward_passes"))])
        if fused:
            metric("fused_passes_total", "counter", "Fused passes, by the draft blocks c each carried.",
                   [(f'{{candidates="{c}"}}', n) for c, n in fused])
        if t.get("certified_head_calls"):  # head="certified": which head answered the greedy head calls
            int8 = t.get("certified_head_int8", 0)
            metric("certified_head_calls_total", "counter",
                   "Greedy head calls of the certified head, by the head that answered them.",
                   [('{answered="int8"}', int8), ('{answered="16bit"}', t["certified_head_calls"] - int8)])
        worker = self.worker
        metric("queue_depth", "gauge", "Requests waiting for the model.", [("", worker.queue_depth if worker else 0)])
        metric("busy", "gauge", "1 while a generation runs.", [("", int(bool(worker and worker.running)))])
        if self.sampler is not None:
            latest = self.sampler.latest()
            if latest is not None and latest.power_w is not None:
                metric("power_watts", "gauge", f"Latest power sample ({self.sampler.source_name}).",
                       [("", float(latest.power_w))])
            if "energy_j" in t:
                metric("energy_joules_total", "counter", "Energy over decoding windows.", [("", float(t["energy_j"]))])
                metric("joules_per_token", "gauge", "Energy per generated token, since start.",
                       [("", ratio("energy_j", "energy_tokens"))])
        return "\n".join(lines) + "\n"


# --- the app --------------------------------------------------------------------------------------

def create_app(engine: Engine, config: ServerConfig, sampler: Sampler | None = None):
    """The FastAPI app over ``engine``; its worker starts with the app and stops with it."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    metrics = Metrics(sampler)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app):
        worker = Worker(engine, config.max_queue, metrics)
        metrics.worker = state["worker"] = app.state.worker = worker
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="BitMTP Edge", lifespan=lifespan)
    app.state.metrics = metrics

    def failure(endpoint: str, status: int, message: str, param: str | None = None, kind: str | None = None,
                code: str | None = None):
        metrics.request(endpoint, status)
        log.info("%s %d %s", endpoint, status, message)
        kind = kind or {400: "invalid_request_error", 404: "invalid_request_error",
                        503: "server_busy"}.get(status, "server_error")
        return JSONResponse(oa.error(message, param, kind, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors(), request.headers.get("content-type"))
        return failure(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # Routing's own 404/405 in OpenAI's error shape, which clients parse (not FastAPI's {"detail": ...}).
        where = f"{request.method} {request.url.path}"
        message = {404: f"no such endpoint: {where}; this server serves /v1/models, /v1/completions, "
                        "/v1/chat/completions, /health and /metrics",
                   405: f"method not allowed: {where}"}.get(exc.status_code, str(exc.detail))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(oa.error(message, kind=kind), status_code=exc.status_code, headers=exc.headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        worker = state["worker"]
        return {"status": "ok", "model": config.model_name, "busy": worker.running is not None,
                "queue_depth": worker.queue_depth}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def admit(endpoint: str, build):
        """Build a request's job and queue it; (job, None), or (None, the error response) when
        the request is bad (400) or the queue is full (503)."""
        from ..runtime.chat_template import ChatTemplateError

        try:
            job = build()
            state["worker"].submit(job)
            return job, None
        except ChatTemplateError as e:
            return None, failure(endpoint, 400, str(e), "messages")
        except BadRequest as e:
            return None, failure(endpoint, e.status, str(e), e.param, code=e.code)
        except ValueError as e:
            return None, failure(endpoint, 400, str(e), getattr(e, "param", None))
        except QueueFull as e:
            return None, failure(endpoint, 503, str(e))

    def model_card() -> dict:
        from .serve import info as engine_info

        return {"id": config.model_name, "object": "model", "created": int(engine.path.stat().st_mtime),
                "owned_by": "bitmtp-edge", "max_model_len": engine.backend.max_context,
                "bitmtp": engine_info(engine)}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        metrics.request("/v1/models", 200)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")  # client.models.retrieve(id); ids may hold "/" (org/name)
    async def model(model: str):
        if model != config.model_name:
            return failure("/v1/models/{model}", 404, f"unknown model {model!r}; this server serves "
                           f"{config.model_name!r}", "model", code="model_not_found")
        metrics.request("/v1/models/{model}", 200)
        return model_card()

    async def answer(endpoint: str, build, request: Request, body, stream, respond):
        """Admit the job ``build`` makes, then answer: SSE chunks from ``stream`` or one JSON
        body from ``respond`` (the endpoint's OpenAI response builder)."""
        job, refused = admit(endpoint, build)
        if refused is not None:
            return refused
        metrics.request(endpoint, 200)
        if body.stream:
            return StreamingResponse(stream(job, config, body), media_type="text/event-stream")
        return await _collect(job, request, lambda text, stats: respond(
            job.rid, config.model_name, text, oa.finish_reason(stats.finish_reason),
            oa.usage(stats.prompt_tokens, stats.new_tokens), job.report(stats)))

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, request: Request):
        endpoint = "/v1/completions"

        def build():
            prompt = body.prompt_value()
            ids = engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            return _job(engine, config, body, body.max_tokens, ids, endpoint, "cmpl")

        return await answer(endpoint, build, request, body, _stream_completion, oa.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oa.ChatCompletionRequest, request: Request):
        endpoint = "/v1/chat/completions"

        def build():
            text = engine.render_chat([m.template_dict() for m in body.messages], body.add_generation_prompt)
            return _job(engine, config, body, body.token_limit, engine.encode(text), endpoint, "chatcmpl",
                        body.token_limit_field)

        return await answer(endpoint, build, request, body, _stream_chat, oa.chat_completion)

    return app


def _validation_message(errors, content_type: str | None = None) -> tuple[str, str | None]:
    """(message, param): what was wrong with the body, and the field at fault (the first
    error's field, or the one an ``oa.Unsupported`` names) for the error body's ``param``."""
    parts = []
    params = []
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        # the top-level field: deeper parts of loc name pydantic's union branches ("stop.str")
        params.append(getattr(err.get("ctx", {}).get("error"), "param", None) or (loc[0] if loc else None))
        if err.get("type") == "json_invalid":
            return (f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))}); "
                    "send a JSON object"), None
        if err.get("type") == "model_attributes_type" and not where:
            # FastAPI parses the body as JSON only under a JSON content type (curl -d sends a form's)
            if content_type and "json" not in content_type.lower():
                return (f"the request body was sent as {content_type.split(';')[0]!r}; send a JSON object with "
                        "the header Content-Type: application/json"), None
            return "the request body must be a JSON object", None
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field {where!r}; leave it out (see GET /v1/models for the served model)")
        elif err.get("type") == "missing":
            parts.append(f"{where or 'body'}: required field missing")
        else:
            msg = err.get("msg", "invalid").removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request body", next((p for p in params if p), None)


def _job(engine: Engine, config: ServerConfig, body: oa._Body, max_tokens: int | None, prompt_ids: list[int],
         endpoint: str, prefix: str, limit_field: str = "max_tokens") -> Job:
    """Check every field against the engine (400 on any problem) and build the job."""
    from ..runtime.decoding import DecodingError
    from ..runtime.sampling import SamplingError, SamplingParams

    if body.model != config.model_name:
        raise BadRequest(f"unknown model {body.model!r}; this server serves {config.model_name!r} (GET /v1/models)",
                         "model", status=404, code="model_not_found")
    n = config.max_tokens if max_tokens is None else max_tokens
    if not 1 <= n <= config.max_tokens_limit:
        raise BadRequest(f"{limit_field} = {n}: give an integer in 1..{config.max_tokens_limit}", limit_field)
    sampled = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
               "repetition_penalty": body.repetition_penalty, "frequency_penalty": body.frequency_penalty,
               "presence_penalty": body.presence_penalty, "seed": body.seed}
    fields = {**config.sampling_defaults, **{k: v for k, v in sampled.items() if v is not None}}
    try:
        sampling = SamplingParams(**fields)
    except SamplingError as e:
        raise BadRequest(str(e), str(e).split(" ")[0]) from None
    policy = body.policy or (config.policy if engine.manifest.mtp is not None else "ar")
    try:
        engine.check_request(prompt_ids, max_new_tokens=n, policy=policy, tau=body.tau,
                             min_prefix=body.min_prefix, sampling=sampling)
    except DecodingError as e:
        raise BadRequest(str(e)) from None
    kw = {"max_new_tokens": n, "policy": policy, "tau": body.tau, "min_prefix": body.min_prefix,
          "sampling": sampling}
    return Job(oa.new_id(prefix), endpoint, prompt_ids, kw, body.stop_list, asyncio.get_running_loop(),
               engine.tokenizer)


async def _collect(job: Job, request, respond):
    """Wait for the job's end (cancelling it if the client goes away); one JSON body. The
    worker never wakes this handler before the end."""
    from fastapi.responses import JSONResponse, Response

    async def watch_disconnect():
        # The body is read: the next ASGI message can only be the client's disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel.set()

    watcher = asyncio.create_task(watch_disconnect())
    pieces: list[str] = []
    ids: list[int] = []
    try:
        while True:
            for event in await job.events.take(final_only=True):
                if event[0] == "ids":
                    ids.extend(event[1])
                elif event[0] == "delta":
                    pieces.append(event[1])
                elif event[0] == "done":
                    # The ids decoded at once, as Engine.generate does (the worker posts either
                    # ids or text pieces, never both).
                    text = job.tokenizer.decode(ids, skip_special_tokens=False) if ids else "".join(pieces)
                    return JSONResponse(respond(text, event[1]))
                elif event[0] == "error":
                    return JSONResponse(oa.error(event[2], kind="invalid_request_error" if event[1] == 400
                                                 else "server_error"), status_code=event[1])
                else:  # cancelled (the client left while queued or running)
                    return Response(status_code=499)
    finally:
        watcher.cancel()
        job.cancel.set()  # a no-op once done; stops the generation when the handler is torn down


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class DeltaChunks:
    """One stream's text-delta SSE events with the JSON around the text rendered once: an
    event is the constant head, the text as a JSON string, the constant tail (the same bytes
    as ``_sse`` of the whole chunk; only the text is encoded per chunk)."""

    _MARK = "\x00bitmtp-delta\x00"

    def __init__(self, make_chunk):
        """``make_chunk(text)``: the chunk object for a delta ``text``."""
        whole = _sse(make_chunk(self._MARK))
        self.head, _, self.tail = whole.partition(json.dumps(self._MARK, ensure_ascii=False))

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


async def _batches(job: Job, interval_s: float):
    """(text, end) per wake-up: the text posted since the last one, joined, and the job's
    final event once it came (else None). At most one per ``interval_s`` seconds, except
    that the end comes at once. Token ids are decoded here, once per wake-up (one decoder
    call for the whole batch). Leaving early (the client went away) cancels the job."""
    loop = asyncio.get_running_loop()
    text = TextStream(job.tokenizer)  # for ("ids", ...) events; no stop strings there
    next_at = 0.0
    try:
        while True:
            wait = next_at - loop.time()
            events = await job.events.take(final_only=True, timeout=wait) if wait > 0 else []
            if not events:
                events = await job.events.take()
            next_at = loop.time() + interval_s
            end = next((e for e in events if e[0] in FINAL_EVENTS), None)
            ids = [t for e in events if e[0] == "ids" for t in e[1]]
            piece = text.push(ids) if ids else "".join(e[1] for e in events if e[0] == "delta")
            if end is not None and end[0] == "done":
                piece += text.finish()
            yield piece, end
            if end is not None:
                return
    finally:
        job.cancel.set()


def _usage_tail(job: Job, stats, body: oa._Body, chunk) -> str:
    """A stream's end: the chunk with the finish reason, the usage, ``[DONE]``.
    ``chunk(reason, use, stats, choices=...)`` makes the endpoint's chunk. Asked for
    (``include_usage``), the usage comes as OpenAI sends it: only in a last chunk with no
    choices, every other chunk's usage null (clients add up the usage they see: it must come
    once). Not asked for, it rides on the finish chunk (BitMTP's stats with it)."""
    use = oa.usage(stats.prompt_tokens, stats.new_tokens)
    reason = oa.finish_reason(stats.finish_reason)
    if not body.include_usage:
        return _sse(chunk(reason, use, job.report(stats))) + "data: [DONE]\n\n"
    return (_sse(chunk(reason)) + _sse(chunk(None, use, job.report(stats), choices=False))
            + "data: [DONE]\n\n")


async def _stream_completion(job: Job, config: ServerConfig, body: oa.CompletionRequest):
    created = int(time.time())
    delta = DeltaChunks(lambda text: oa.completion_chunk(job.rid, config.model_name, created, text))
    async for text, end in _batches(job, config.stream_interval_s):
        out = delta(text) if text else ""
        if end is not None and end[0] == "done":
            out += _usage_tail(job, end[1], body, lambda *a, **kw: oa.completion_chunk(
                job.rid, config.model_name, created, "", *a, **kw))
        elif end is not None and end[0] == "error":
            out += _sse(oa.error(end[2], kind="server_error")) + "data: [DONE]\n\n"
        if out:  # one write per wake-up
            yield out


async def _stream_chat(job: Job, config: ServerConfig, body: oa.ChatCompletionRequest):
    created = int(time.time())
    yield _sse(oa.chat_chunk(job.rid, config.model_name, created, {"role": "assistant", "content": ""}))
    delta = DeltaChunks(lambda text: oa.chat_chunk(job.rid, config.model_name, created, {"content": text}))
    async for text, end in _batches(job, config.stream_interval_s):
        out = delta(text) if text else ""
        if end is not None and end[0] == "done":
            out += _usage_tail(job, end[1], body, lambda *a, **kw: oa.chat_chunk(
                job.rid, config.model_name, created, {}, *a, **kw))
        elif end is not None and end[0] == "error":
            out += _sse(oa.error(end[2], kind="server_error")) + "data: [DONE]\n\n"
        if out:
            yield out


# --- running it -----------------------------------------------------------------------------------

def make_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """A uvicorn server for ``app`` (run it with ``.run()``, stop it with ``.should_exit``)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                         access_log=False, timeout_graceful_shutdown=5))
