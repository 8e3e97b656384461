"""tools/bench_serve.py's summaries: synthetic requests with known costs come out as those costs."""

from __future__ import annotations

import json
import random

import pytest

from tools.bench_serve import (ClientProcess, InProcessServer, markdown, measure_policy, paired, parse_sse,
                               resummarize, summarize)


def _row(rng, tokens, requested, prefill, decode_per_token, outside, chunks=None, first=None):
    decode = tokens * decode_per_token
    row = {"wall_s": prefill + decode + outside, "tokens": tokens, "requested": requested, "prefill_s": prefill,
           "decode_s": decode, "text": "same"}
    if chunks is not None:
        row.update(chunks=chunks, first_s=first, server_s=prefill + decode + 0.0007)
    return row


def synthetic_runs(seed=0, long=256, short=16):
    """Engine.generate: 250 µs/token, 0.6 ms outside; the server: 2.5 ms more outside, its
    JSON decode 5 µs/token slower than this process's engine, SSE 3 µs/token slower again.
    The eager prefill jitters by milliseconds in every path alike."""
    rng = random.Random(seed)
    runs = []
    for _ in range(30):
        for n in (short, long):
            jitter = lambda: rng.uniform(0.011, 0.018)  # noqa: E731
            runs.append({
                "direct": _row(rng, n, n, jitter(), 250e-6, 0.0006),
                "stream@s": _row(rng, n, n, jitter(), 258e-6, 0.0031, chunks=n // 16, first=0.02),
                "json@s": _row(rng, n, n, jitter(), 255e-6, 0.0031, chunks=None),
            })
            runs[-1]["json@s"]["server_s"] = runs[-1]["json@s"]["wall_s"] - 0.0024
    return runs


def test_paired_recovers_known_costs():
    summary = summarize(synthetic_runs(), ["s"], 256)
    v = summary["servers"]["s"]
    assert abs(v["stream_vs_direct"]["fixed_ms_per_request"] - 2.5) < 1e-6
    assert abs(v["stream_vs_direct_fixed_ms_short"] - 2.5) < 1e-6
    assert abs(v["stream_vs_json"]["fixed_ms_per_request"]) < 1e-6
    assert abs(v["stream_vs_json"]["decode_us_per_token"] - 3.0) < 1e-6
    assert abs(v["json_vs_direct"]["decode_us_per_token"] - 5.0) < 1e-6
    # Prefill left out: decode difference plus the fixed cost spread over 256 tokens.
    assert abs(v["stream_vs_direct"]["no_prefill_us_per_token"] - (8.0 + 2500 / 256)) < 1e-6
    assert abs(summary["direct_decode_us_per_token"] - 250.0) < 1e-6
    assert v["identical"] is True
    assert abs(v["chunks_per_token"] - 1 / 16) < 1e-9


def test_paired_takes_medians_of_differences():
    a = [{"wall_s": w, "prefill_s": 0.0, "decode_s": d, "tokens": 10} for w, d in [(1.0, 0.5), (2.0, 0.5), (9.0, 8.5)]]
    b = [{"wall_s": 0.5, "prefill_s": 0.0, "decode_s": 0.4, "tokens": 10}] * 3
    out = paired(list(zip(a, b)))
    assert abs(out["fixed_ms_per_request"] - 1e3 * 0.4) < 1e-9  # outside: 0.5, 1.5, 0.5 vs 0.1
    assert abs(out["decode_us_per_token"] - 1e6 * 0.01) < 1e-6  # 0.1, 0.1, 8.1 s over 10 tokens


def test_resummarize_reproduces_the_saved_summaries(tmp_path):
    runs = synthetic_runs(seed=3)
    summary = summarize(runs, ["s"], 256)
    rows = [{k: {f: x for f, x in row[k].items() if f != "text"} for k in row} for row in runs]
    report = {"device": "cpu", "date": "d", "commit": "c", "command": "x", "tokens": 256, "short_tokens": 16,
              "repeats": 1, "policies": {"ar": summary}, "rows": {"ar": rows}}
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(report))
    again = resummarize(path)
    recomputed, saved = again["policies"]["ar"]["servers"]["s"], summary["servers"]["s"]
    for kind in ("stream_vs_json", "stream_vs_direct", "json_vs_direct"):
        assert {k: recomputed[kind][k] for k in saved[kind]} == saved[kind]
    assert abs(recomputed["stream_vs_json"]["decode_pct_of_ar_step"] - 100 * 3 / 250) < 1e-6
    assert again["policies"]["ar"]["servers"]["s"]["identical"] is True
    assert again["ar_step_us"] == summary["direct_decode_us_per_token"]
    text = markdown(again)
    assert "SSE − JSON, same server" in text and "| ar | s |" in text


def test_parse_sse_finds_the_read_that_completed_the_first_text():
    chunk = lambda text, usage=None: "data: " + json.dumps(  # noqa: E731
        {"choices": [{"text": text}], **({"usage": usage, "bitmtp": {"x": 1}} if usage else {})}) + "\n\n"
    body = (chunk("") + chunk("def") + chunk(" f") + chunk("", {"completion_tokens": 2}) + "data: [DONE]\n\n").encode()
    first_end = len((chunk("") + chunk("def")).encode())
    reads = [(0.001, first_end - 3), (0.002, first_end), (0.003, len(body))]
    out = parse_sse(body, reads)
    assert out["text"] == "def f" and out["chunks"] == 4 and out["first_s"] == 0.002
    assert out["last"]["usage"]["completion_tokens"] == 2


def test_in_process_and_separate_paths_time_the_same_request(tmp_path):
    """The benchmark end to end on a tiny model on the CPU: the in-process server over the
    benchmark's own engine, the client in its own process; every path gives the same text
    and the summaries come out."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import argparse

    from bitmtp_edge.runtime.engine import Engine
    from tests.test_http_server import write_tiny_artifact

    engine = Engine.load(write_tiny_artifact(tmp_path / "tiny", None), backend="reference", device="cpu")
    server = InProcessServer(engine, argparse.Namespace(tokens=6), 0.0)
    client = None
    try:
        server.wait_ready(30)
        client = ClientProcess()
        runs = measure_policy(engine, client, {"in-process 0 ms": server.url}, ["t1 t2 t3"], "speculative", (2, 6), 2)
    finally:
        if client is not None:
            client.close()
        server.stop()
    assert len(runs) == 4 and set(runs[0]) == {"direct", "stream@in-process 0 ms", "json@in-process 0 ms"}
    for row in runs:
        texts = {row[k]["text"] for k in row}
        assert len(texts) == 1 and texts != {""}
        assert row["stream@in-process 0 ms"]["client_send_s"] > 0 and row["json@in-process 0 ms"]["server_s"] > 0
    summary = summarize(runs, ["in-process 0 ms"], 6)
    assert summary["servers"]["in-process 0 ms"]["identical"] is True


def test_the_paced_fake_decode_keeps_the_engine_checks_and_its_pace(tmp_path):
    from bitmtp_edge.runtime.decoding import DecodingError
    from bitmtp_edge.runtime.engine import Engine
    from tests.test_http_server import write_tiny_artifact

    from tools.bench_serve import pace_engine

    engine = Engine.load(write_tiny_artifact(tmp_path / "tiny", None), backend="reference", device="cpu")
    pace_engine(engine, step_us=2000, prefill_us=3000)
    res = engine.generate("t1 t2 t3", max_new_tokens=5, policy="ar")
    assert len(res.token_ids) == 5 and res.stats.new_tokens == 5 and res.stats.finish_reason == "length"
    assert res.stats.decode_s >= 5 * 2e-3 and res.stats.prefill_s >= 3e-3
    assert res.text == engine.decode_ids(res.token_ids)
    with pytest.raises(DecodingError, match="unknown policy"):  # the real checks still run first
        engine.generate("t1", max_new_tokens=5, policy="greedy")
