"""The OpenAI-compatible HTTP server, live: uvicorn on 127.0.0.1 (a free port), driven by
the official ``openai`` client, on a tiny templated model on the CPU."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from bitmtp_edge.app.http_server import (DeltaChunks, EventPipe, Job, Metrics, ServerConfig, Worker,  # noqa: E402
                                         _batches, _sse, create_app, make_server)
from bitmtp_edge.runtime.engine import Engine  # noqa: E402
from tests.helpers import artifact_tensors, manifest_for, random_model, reference_backend  # noqa: E402

MODEL = "tiny-chat"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}t2 {{ m['content'] }} "
    "{% elif m['role'] == 'user' %}t3 {{ m['content'] }} "
    "{% elif m['role'] == 'assistant' %}t4 {{ m['content'] }} {{ eos_token }} "
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}t4{% endif %}"
)


def write_tiny_artifact(out: Path, template: str | None, seed: int = 11, max_context: int = 512) -> Path:
    """A random tiny MTP model with a word-level tokenizer ("t0 t1 ...") and, when given,
    a chat template in tokenizer_config.json (as the exporter copies it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from bitmtp_edge.format.manifest import write_artifact

    model = random_model(seed)
    vocab = model.cfg.vocab_size
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    src = out.parent / f"{out.name}-src"
    src.mkdir(parents=True)
    tok.save(str(src / "tokenizer.json"))
    config = {"eos_token": f"t{vocab - 2}", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    plan = reference_backend(model, max_context=max_context).plan
    return write_artifact(out, manifest_for(model, 4, plan), artifact_tensors(model),
                          {"tokenizer.json": src / "tokenizer.json",
                           "tokenizer_config.json": src / "tokenizer_config.json"})


class LiveServer:
    """uvicorn in a thread on a free port; ``stop()`` ends it (bounded waits throughout)."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.app = create_app(engine, config)
        self.server = make_server(self.app, log_level="warning")
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only then (else keep-alive replies wait ~40 ms)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
            assert self.thread.is_alive(), "uvicorn died while starting"
            time.sleep(0.05)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not stop within 30 s"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return write_tiny_artifact(tmp_path_factory.mktemp("http") / "tiny", CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def oracle(artifact) -> Engine:
    """A second engine on the same artifact: what the API returns for the same request."""
    return Engine.load(artifact, backend="reference", device="cpu")


@pytest.fixture(scope="module")
def live(artifact):
    engine = Engine.load(artifact, backend="reference", device="cpu")
    server = LiveServer(engine, ServerConfig(model_name=MODEL, max_tokens=16, max_tokens_limit=512, max_queue=8))
    yield server
    server.stop()


PROMPT = "t1 t5 t7 t9 t11"


def test_models_lists_the_served_model(live):
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_greedy_speculative_completion_equals_engine_ar(live, oracle):
    expected = oracle.generate(PROMPT, max_new_tokens=12, policy="ar")
    resp = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                            extra_body={"policy": "speculative"})
    assert resp.choices[0].text == expected.text and expected.text
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.prompt_tokens == 5 and resp.usage.total_tokens == 5 + len(expected.token_ids)
    stats = resp.model_extra["bitmtp"]
    assert stats["verifier_calls"] == stats["iterations"] > 0 and stats["seed"] is None
    assert resp.choices[0].finish_reason == ("length" if len(expected.token_ids) == 12 else "stop")


def test_token_id_prompts_and_hybrid_extras(live, oracle):
    ids = oracle.encode(PROMPT)
    expected = oracle.generate(ids, max_new_tokens=10, policy="hybrid", tau=0.3, min_prefix=2)
    resp = live.client().completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                            extra_body={"policy": "hybrid", "tau": 0.3, "min_prefix": 2})
    assert resp.choices[0].text == expected.text


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.3, "top_p": 0.9, "seed": 5}])
def test_streaming_equals_non_streaming(live, sampling):
    client = live.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=20, stop=["t40", "t41 t42"], extra_body={"policy": "hybrid"},
              **sampling)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    last = chunks[-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


class _CountingLoop:
    """An event loop's stand-in for EventPipe that counts the worker's wake-ups."""

    def __init__(self, loop):
        self.loop, self.wakeups = loop, 0

    def call_soon_threadsafe(self, *a):
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(*a)

    def __getattr__(self, name):
        return getattr(self.loop, name)


def test_event_pipe_wakes_the_loop_only_for_a_waiting_reader():
    import asyncio

    async def scenario():
        loop = _CountingLoop(asyncio.get_running_loop())
        pipe = EventPipe(loop)
        # Nobody waits: 100 posts from the worker thread pile up without one wake-up.
        worker = threading.Thread(target=lambda: [pipe.post("delta", f"p{i} ") for i in range(100)])
        worker.start()
        worker.join()
        assert loop.wakeups == 0
        assert await pipe.take() == [("delta", f"p{i} ") for i in range(100)]
        # A JSON reader waits for the end only: 50 deltas and the end wake it once.
        waiting = asyncio.ensure_future(pipe.take(final_only=True))
        await asyncio.sleep(0.01)
        worker = threading.Thread(target=lambda: [pipe.post("delta", "x") for _ in range(50)] + [pipe.post("done", 7)])
        worker.start()
        batch = await asyncio.wait_for(waiting, 10)
        worker.join()
        assert loop.wakeups == 1 and len(batch) == 51 and batch[-1] == ("done", 7)
        # A rate-limited stream reader: its timeout hands over what piled up, end or not.
        pipe = EventPipe(loop)
        pipe.post("delta", "a")
        pipe.post("delta", "b")
        t0 = time.perf_counter()
        assert await pipe.take(final_only=True, timeout=0.05) == [("delta", "a"), ("delta", "b")]
        assert time.perf_counter() - t0 >= 0.04
        assert await pipe.take(final_only=True, timeout=0.01) == []  # nothing came
        later = asyncio.ensure_future(pipe.take())
        await asyncio.sleep(0.01)
        pipe.post("delta", "c")  # the reader waits for anything now: woken at once
        assert await asyncio.wait_for(later, 10) == [("delta", "c")]

    asyncio.run(scenario())


BYTE_LEVEL_TEXT = "def grüße(x):\n    return '日本語 — naïve café 🙂🚀' + x  # ∑ ≤ ∞\n"


def test_the_reader_decodes_posted_ids_in_batches_into_whole_characters():
    """The decode loop posts raw ids (no stop strings); the streaming reader decodes each
    wake-up's batch: the pieces join to the full decode and none shows a broken character."""
    import asyncio

    from tokenizers import Tokenizer

    from bitmtp_edge.runtime.engine import embedded_artifact_path

    tokenizer = Tokenizer.from_file(str(embedded_artifact_path() / "tokenizer.json"))
    ids = tokenizer.encode(BYTE_LEVEL_TEXT, add_special_tokens=False).ids
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))  # split characters exist

    async def scenario(interval_s):
        job = Job("cmpl-test", "/v1/completions", [1], {}, [], asyncio.get_running_loop(), tokenizer)

        def decode_loop():
            for i in range(0, len(ids), 2):
                job.post("ids", ids[i:i + 2])
                time.sleep(0.002)
            job.post("done", None)

        worker = threading.Thread(target=decode_loop)
        worker.start()
        pieces = [(text, end) async for text, end in _batches(job, interval_s)]
        worker.join()
        return pieces

    for interval_s in (0.0, 0.01):
        pieces = asyncio.run(scenario(interval_s))
        assert "".join(text for text, _ in pieces) == BYTE_LEVEL_TEXT
        assert not any("\ufffd" in text for text, _ in pieces)
        assert pieces[-1][1] == ("done", None) and all(end is None for _, end in pieces[:-1])


@pytest.mark.parametrize("model", ["tiny-chat", 'odd "name" ü\\'])
def test_pre_rendered_delta_chunks_are_the_same_bytes_as_whole_chunks(model):
    import random

    from bitmtp_edge.app import openai_schema as oa

    rng = random.Random(5)
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x1f", "é", "日", "🙂", "\u2028", "a", " ", "}", "data: "]
    completion = DeltaChunks(lambda text: oa.completion_chunk("cmpl-1", model, 17, text))
    chat = DeltaChunks(lambda text: oa.chat_chunk("chatcmpl-1", model, 17, {"content": text}))
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        assert completion(text) == _sse(oa.completion_chunk("cmpl-1", model, 17, text))
        assert chat(text) == _sse(oa.chat_chunk("chatcmpl-1", model, 17, {"content": text}))


class _ScriptedEngine:
    """stream_ids yields fixed chunks; the worker's own code (and the engine's text stream,
    for stop strings) does the rest."""

    stream, _stream_text, _end_at_stop = Engine.stream, Engine._stream_text, Engine._end_at_stop

    def __init__(self, tokenizer, chunks):
        self.tokenizer, self.chunks = tokenizer, chunks

    def stream_ids(self, prompt_ids, stats, should_stop, **kw):
        def run():
            for chunk in self.chunks:
                stats.new_tokens += len(chunk)
                yield chunk
            stats.finish_reason = "length"
        return run()


def test_the_worker_hands_over_ids_and_decodes_itself_only_for_stop_strings(artifact):
    import asyncio

    engine = Engine.load(artifact, backend="reference", device="cpu")
    chunks = [engine.encode("t5 t6"), engine.encode("t7"), engine.encode("t8 t9 t10")]
    worker = Worker(_ScriptedEngine(engine.tokenizer, chunks), max_queue=4, metrics=Metrics())

    async def run(stop):
        job = Job("cmpl-test", "/v1/completions", [1], {"policy": "ar"}, stop, asyncio.get_running_loop(),
                  engine.tokenizer)
        worker.submit(job)
        events = []
        while not events or events[-1][0] != "done":
            events += await asyncio.wait_for(job.events.take(final_only=True), 30)
        return events

    try:
        plain = asyncio.run(run([]))
        assert [e for e in plain if e[0] != "done"] == [("ids", c) for c in chunks]  # no text made per token
        stopped = asyncio.run(run(["t9"]))
        assert {e[0] for e in stopped} == {"delta", "done"}
        full = engine.decode_ids(sum(chunks, []))
        assert "".join(e[1] for e in stopped if e[0] == "delta") == full[:full.index("t9")]
        assert stopped[-1][1].finish_reason == "stop"
        # the usage counts the tokens through the one that completes the stop, as AR's would
        assert chunks[2][:2] == engine.encode("t8 t9")
        assert stopped[-1][1].new_tokens == len(chunks[0]) + len(chunks[1]) + 2 < len(sum(chunks, []))
    finally:
        worker.stop()


@pytest.fixture(scope="module", params=[0.0, 30.0], ids=["interval0", "interval30s"])
def interval_server(request, artifact):
    engine = Engine.load(artifact, backend="reference", device="cpu")
    server = LiveServer(engine, ServerConfig(model_name=MODEL, max_tokens=16, max_tokens_limit=512,
                                             stream_interval_s=request.param))
    yield server, request.param
    server.stop()


def test_coalesced_chunks_concatenate_to_the_same_text(interval_server, oracle):
    live, interval = interval_server
    client = live.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=["t40"],
              extra_body={"policy": "speculative"})
    whole = client.completions.create(**kw)
    assert whole.choices[0].text == oracle.generate(PROMPT, max_new_tokens=24, policy="ar", stop=["t40"]).text
    t0 = time.perf_counter()
    chunks = list(client.completions.create(stream=True, **kw))
    elapsed = time.perf_counter() - t0
    texts = [c.choices[0].text for c in chunks if c.choices[0].text]
    assert "".join(texts) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    if interval:
        # The first piece goes out at once, everything after it shares one chunk, and the
        # request's end does not wait for the interval.
        assert len(texts) <= 2 and elapsed < interval / 2
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "t30 t31 t32"}], max_tokens=12, temperature=0,
                extra_body={"policy": "hybrid", "tau": 0.2, "min_prefix": 2})
    whole = client.chat.completions.create(**chat).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole and whole


def test_chat_applies_the_template(live, oracle):
    messages = [{"role": "system", "content": "t20 t21"}, {"role": "user", "content": "t30 t31 t32"}]
    assert oracle.render_chat(messages) == "t2 t20 t21 t3 t30 t31 t32 t4"
    expected = oracle.chat(messages, max_new_tokens=10, policy="ar")
    client = live.client()
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"policy": "speculative"})
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"policy": "speculative"})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_template_renders_like_transformers(oracle):
    transformers = pytest.importorskip("transformers")
    from bitmtp_edge.runtime.chat_template import ChatTemplate

    source = ("{%- for m in messages %}{%- if loop.index0 > 5 %}{% break %}{% endif %}"
              "<|{{ m.role }}|>{{ m.content | tojson }}{{ '\\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}<|assistant|>{{ bos_token }}{% endif %}")
    messages = [{"role": "user", "content": "héllo \"wörld\" <b>"}, {"role": "assistant", "content": "ok"}]
    ours = ChatTemplate(source, {"bos_token": "<s>"}, "test").render(messages)
    theirs = transformers.utils.chat_template_utils.render_jinja_template(
        conversations=[messages], chat_template=source, add_generation_prompt=True, bos_token="<s>")[0][0]
    assert ours == theirs and "héllo" in ours


def test_seeded_sampling_is_reproducible(live):
    client = live.client()

    def text(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.5, top_p=0.95,
                                         seed=seed, extra_body={"policy": "speculative", "top_k": 50}).choices[0].text

    first = text(7)
    assert text(7) == first
    assert len({first, text(8), text(9)}) > 1


def _post(live, path, body, raw=False):
    content = body if raw else json.dumps(body)
    return httpx.post(live.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("body, status, words", [
    ({"model": "gpt-4", "prompt": PROMPT}, 404, ["unknown model 'gpt-4'", MODEL]),  # OpenAI's model_not_found
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, 400, ["max_tokens = 0", "1..512"]),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 10 ** 9}, 400, ["1..512"]),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": -3}, 400, ["max_tokens = -3"]),
    ({"model": MODEL, "prompt": PROMPT, "n": 2}, 400, ["n = 2", "n = 1"]),
    ({"model": MODEL, "prompt": " ".join(["t5"] * 600)}, 400, ["600 tokens", "largest KV segment holds 512"]),
    ({"model": MODEL, "prompt": PROMPT, "temperature": -1}, 400, ["temperature must be"]),
    ({"model": MODEL, "prompt": PROMPT, "policy": "greedy"}, 400, ["unknown policy 'greedy'"]),
    ({"model": MODEL, "prompt": PROMPT, "best_of": 3}, 400, ["best_of"]),
    ({"model": MODEL, "prompt": PROMPT, "temprature": 0.5}, 400, ["unknown field 'temprature'"]),
    ({"model": MODEL}, 400, ["prompt", "required"]),
    ({"model": MODEL, "prompt": ["t1", "t2"]}, 400, ["2 prompts", "one per request"]),
])
def test_bad_completion_requests_are_400_with_a_fix(live, body, status, words):
    resp = _post(live, "/v1/completions", body)
    assert resp.status_code == status, resp.text
    message = resp.json()["error"]["message"]
    for word in words:
        assert word in message, message


def test_bad_json_and_bad_chat_requests(live):
    resp = _post(live, "/v1/completions", '{"model": "tiny-chat", "prompt": ', raw=True)
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    resp = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "t1"}]})
    assert resp.status_code == 400 and "role" in resp.json()["error"]["message"]
    resp = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "t1"}]})
    assert resp.status_code == 400 and "unknown role tool" in resp.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="tools are not supported"):
        live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t1"}],
                                              tools=[{"type": "function", "function": {"name": "f"}}])
    assert httpx.get(live.url + "/health", timeout=10).json()["status"] == "ok"  # the server lives on


def test_a_model_without_template_answers_chat_with_400(tmp_path):
    artifact = write_tiny_artifact(tmp_path / "plain", None, seed=12)
    server = LiveServer(Engine.load(artifact, backend="reference", device="cpu"), ServerConfig(model_name="plain"))
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template.*completion model"):
            server.client().chat.completions.create(model="plain", messages=[{"role": "user", "content": "t1"}])
        assert server.client().completions.create(model="plain", prompt="t1 t2", max_tokens=3, temperature=0).usage
    finally:
        server.stop()


def test_four_concurrent_clients_get_their_own_answers(live, oracle):
    prompts = [f"t{i} t{i + 3} t{i + 6}" for i in (1, 10, 20, 30)]
    expected = [oracle.generate(p, max_new_tokens=10, policy="ar").text for p in prompts]

    def ask(prompt):
        return live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                extra_body={"policy": "hybrid", "tau": 1.0}).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == expected  # hybrid at τ = 1 always verifies: greedy-lossless


def _metric(live, name: str) -> float:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
              or line.startswith(name + "{")]
    return sum(values)


def _wait_idle(live, timeout=60):
    deadline = time.monotonic() + timeout
    while httpx.get(live.url + "/health", timeout=10).json()["busy"]:
        assert time.monotonic() < deadline, "the generation did not end"
        time.sleep(0.1)


def test_a_disconnecting_client_cancels_its_generation(live):
    _wait_idle(live)
    before = _metric(live, "bitmtp_cancelled_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", live.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            first = next(resp.iter_lines())
            assert first.startswith("data: ")
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 60
    while _metric(live, "bitmtp_cancelled_total") <= before:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.1)
    _wait_idle(live)
    # Cancelled before 500 tokens: the engine is free for the next request at once.
    assert live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).usage


def test_a_client_that_gives_up_on_a_json_answer_cancels_it(live):
    _wait_idle(live)
    before = _metric(live, "bitmtp_cancelled_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "temperature": 0}  # seconds of decoding
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.2))
    deadline = time.monotonic() + 60
    while _metric(live, "bitmtp_cancelled_total") <= before:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.1)
    _wait_idle(live)


def test_a_full_queue_answers_503(live):
    worker = live.app.state.worker
    _wait_idle(live)
    saved = worker.max_queue
    worker.max_queue = 0
    try:
        with httpx.Client(timeout=60) as client:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True}
            with client.stream("POST", live.url + "/v1/completions", json=body) as resp:
                next(resp.iter_lines())  # the first one runs
                busy = _post(live, "/v1/completions", {"model": MODEL, "prompt": PROMPT})
                assert busy.status_code == 503
                assert "busy" in busy.json()["error"]["message"] and "retry" in busy.json()["error"]["message"]
    finally:
        worker.max_queue = saved
    _wait_idle(live)


def test_metrics_and_the_request_log(live, caplog):
    before_400 = _metric(live, 'bitmtp_requests_total{endpoint="/v1/completions",status="400"}')
    assert _post(live, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 3}).status_code == 400
    with caplog.at_level(logging.INFO, logger="bitmtp_edge.http"):
        live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                         extra_body={"policy": "speculative"})
        deadline = time.monotonic() + 10
        while not any("finish=" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    line = next(r.getMessage() for r in caplog.records if "finish=" in r.getMessage())
    assert "policy=speculative" in line and "prompt=5" in line and "completion=6" in line and "tok/s=" in line
    assert _metric(live, 'bitmtp_requests_total{endpoint="/v1/completions",status="200"}') >= 1
    assert _metric(live, "bitmtp_completion_tokens_total") >= 6
    assert _metric(live, "bitmtp_decode_tokens_per_second") > 0
    assert 0 < _metric(live, "bitmtp_verifier_call_rate") <= 1
    assert _metric(live, 'bitmtp_requests_total{endpoint="/v1/completions",status="400"}') == before_400 + 1
    # policy fused: its passes by the c they carried (the reference backend times nothing: the default c)
    from bitmtp_edge.format.config import DEFAULT_CANDIDATES

    fused = f'bitmtp_fused_passes_total{{candidates="{DEFAULT_CANDIDATES}"}}'
    before = _metric(live, fused)  # 0 while absent
    live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"policy": "fused"})
    deadline = time.monotonic() + 10
    while _metric(live, fused) == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _metric(live, fused) > before


# --- what real clients send (the openai client, curl) ------------------------------------------------

CHAT = [{"role": "system", "content": "t20"}, {"role": "user", "content": [{"type": "text", "text": "t30 "},
                                                                           {"type": "text", "text": "t31"}]}]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_include_usage_sends_the_usage_once_in_a_last_chunk_without_choices(live, endpoint):
    """OpenAI: with include_usage the usage comes only in a last chunk with empty choices,
    every other chunk's usage null; clients add up what they see (it was sent twice for chat,
    and ignored for completions)."""
    client = live.client()
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    kw = dict(prompt=PROMPT) if endpoint == "completions" else dict(messages=CHAT)
    whole = create(model=MODEL, max_tokens=8, temperature=0, **kw)
    chunks = list(create(model=MODEL, max_tokens=8, temperature=0, stream=True,
                         stream_options={"include_usage": True}, **kw))
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("endpoint, extra", [
    ("/v1/completions", {"prompt": PROMPT, "n": None, "stream": None, "echo": None, "logprobs": None}),
    ("/v1/chat/completions", {"messages": CHAT, "n": None, "stream": None, "logprobs": None, "top_logprobs": None}),
])
def test_null_optional_fields_mean_their_defaults(live, endpoint, extra):
    """Clients that serialise every field send null for those left unset; OpenAI takes it."""
    resp = _post(live, endpoint, {"model": MODEL, "max_tokens": 3, "temperature": 0, **extra})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("endpoint, extra, param", [
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"stop": 5}, "stop"),
    ("completions", {"n": 2}, "n"),
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"temprature": 1}, "temprature"),
])
def test_refusals_name_the_parameter(live, endpoint, extra, param):
    """An unsupported or bad field: 400 whose error body's param names it (as OpenAI's does)."""
    client = live.client()
    kw = dict(model=MODEL, max_tokens=3)
    if endpoint == "chat":
        create, kw["messages"] = client.chat.completions.create, CHAT
        if "max_completion_tokens" in extra:
            del kw["max_tokens"]
    else:
        create, kw["prompt"] = client.completions.create, PROMPT
    kw.update({k: v for k, v in extra.items() if k in ("prompt", "messages")})
    body = {k: v for k, v in extra.items() if k not in ("prompt", "messages")}
    with pytest.raises(openai.BadRequestError) as err:
        create(extra_body=body, **kw)
    assert err.value.param == param, err.value.body
    assert param in err.value.message


def test_a_body_not_sent_as_json_gets_told_the_content_type(live):
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d's default; a raw client's
        resp = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": content_type},
                          timeout=60)
        assert resp.status_code == 400
        message = resp.json()["error"]["message"]
        assert content_type in message and "Content-Type: application/json" in message, message
    resp = _post(live, "/v1/completions", "[1, 2]", raw=True)
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "the request body must be a JSON object"
    assert _post(live, "/v1/completions", body, raw=True).status_code == 200


def test_models_retrieve(live):
    client = live.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found" and MODEL in err.value.message


def test_an_unknown_model_is_openais_404_on_the_generation_endpoints_too(live):
    client = live.client()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="t1", max_tokens=2)
    assert err.value.code == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "t1"}], max_tokens=2)


def test_unknown_routes_answer_openai_errors(live):
    client = live.client()
    with pytest.raises(openai.NotFoundError, match="no such endpoint: POST /v1/embeddings"):
        client.embeddings.create(model=MODEL, input="t1")
    resp = httpx.delete(live.url + "/v1/models", timeout=10)
    assert resp.status_code == 405 and resp.json()["error"]["type"] == "invalid_request_error"
    assert "GET" in resp.headers["allow"]


def test_head_requests_on_the_get_endpoints(live):
    for path in ("/health", "/metrics", "/v1/models"):  # uptime checks probe with HEAD
        resp = httpx.head(live.url + path, timeout=10)
        assert resp.status_code == 200 and resp.content == b"", path



class _GatedEngine:
    """stream_ids blocks until ``gate`` is set: a generation that runs as long as a test wants."""

    def __init__(self, tokenizer):
        self.tokenizer, self.gate = tokenizer, threading.Event()

    def stream_ids(self, prompt_ids, stats, should_stop, **kw):
        def run():
            while not self.gate.wait(0.01):
                if should_stop():
                    stats.finish_reason = "cancelled"
                    return
            stats.new_tokens, stats.finish_reason = 1, "length"
            yield [5]
        return run()


def test_clients_that_left_the_queue_do_not_hold_its_places(artifact):
    """A client that gives up while queued (a timeout, then a retry) must not make the next
    one a 503: its job leaves the queue at once, not only when its turn would come."""
    import asyncio

    from bitmtp_edge.app.http_server import QueueFull

    engine = Engine.load(artifact, backend="reference", device="cpu")
    gated = _GatedEngine(engine.tokenizer)
    metrics = Metrics()
    worker = Worker(gated, max_queue=1, metrics=metrics)

    async def scenario():
        loop = asyncio.get_running_loop()
        jobs = [Job(f"cmpl-{i}", "/v1/completions", [1], {"policy": "ar"}, [], loop, engine.tokenizer)
                for i in range(4)]
        worker.submit(jobs[0])
        deadline = time.monotonic() + 10
        while worker.running is not jobs[0]:  # the first one runs (blocked at the gate) ...
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        worker.submit(jobs[1])  # ... the second waits, and its client leaves
        jobs[1].cancel.set()
        assert worker.queue_depth == 0
        worker.submit(jobs[2])  # its place is free
        assert worker.queue_depth == 1
        with pytest.raises(QueueFull):
            worker.submit(jobs[3])
        assert await asyncio.wait_for(jobs[1].events.take(final_only=True), 10) == [("cancelled",)]
        gated.gate.set()
        for job in (jobs[0], jobs[2]):
            events = await asyncio.wait_for(job.events.take(final_only=True), 10)
            assert events[-1][0] == "done"

    try:
        asyncio.run(scenario())
        assert metrics.totals["cancelled"] == 1 and metrics.totals["generations"] == 2
    finally:
        gated.gate.set()
        worker.stop()
