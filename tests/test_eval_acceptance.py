"""tools.eval_acceptance replays speculative (and hybrid) decoding from two passes per prompt:
its counts must be the real decode's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_train import data, one_thread, trained  # noqa: F401  (module fixtures)
from tools.prompts import Prompt


def real_decode(path: Path, prompt: str, policy: str, tau: float, m: int, n: int):
    from bitmtp_edge.backends.reference import ReferenceBackend
    from bitmtp_edge.format.segments import plan_segments
    from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, decode
    from tools.hf_checkpoint import load_runtime_model
    from tools.tokenizer import load_tokenizer

    model, ck = load_runtime_model(path)
    backend = ReferenceBackend(model, plan_segments(ck.model, 256, workspace=9), ck.mtp.mask_token_id,
                               torch.float64, "cpu")
    ids = load_tokenizer(path).encode(prompt, add_special_tokens=False).ids
    opts = DecodeOptions(policy=policy, max_new_tokens=n, block_size=ck.mtp.block_size, tau=tau, min_prefix=m,
                         stop_token_ids=frozenset(ck.model.eos_token_ids))
    stats = DecodeStats()
    out = [t for chunk in decode(backend, ids, opts, stats) for t in chunk]
    return out, stats


@pytest.mark.parametrize("tau", [0.9, 0.05])
def test_replay_counts_equal_the_real_decode(trained, tau):  # noqa: F811
    from tools.eval_acceptance import evaluate

    path = trained / "compact"
    texts = ["def scale(values, factor):", "class Point:\n    def __init__(self, x, y):", "import os"]
    prompts = [Prompt(id=f"p{i}", path="", name="", kind="first_lines", prompt=t, reference="")
               for i, t in enumerate(texts)]
    got = evaluate(str(path), prompts, tau, 2, 24, log=lambda m: None, dtype=torch.float64)
    for policy in ("speculative", "hybrid"):
        want = {"tokens": 0, "iterations": 0, "forward_passes": 0, "verifier_calls": 0}
        for t in texts:
            out, s = real_decode(path, t, policy, tau, 2, 24)
            want["tokens"] += len(out)
            want["iterations"] += s.iterations
            want["forward_passes"] += s.forward_passes
            want["verifier_calls"] += s.verifier_calls
        if policy == "hybrid" and got[policy]["unverified_mistakes"]:
            continue  # the real decode left the AR text there; the replay does not claim to follow it
        assert {k: got[policy][k] for k in want} == want, policy
    if tau == 0.05:
        assert got["hybrid"]["verifier_call_rate"] < 1.0, "τ 0.05 takes the unverified branch"


def test_replay_in_worker_processes_sums_to_the_same_counts(trained):  # noqa: F811
    """--jobs: every jobs-th prompt per spawned process, the counts summed — the numbers of
    one process (each prompt's replay is independent of the others)."""
    from tools.eval_acceptance import evaluate, evaluate_in_slices

    path = str(trained / "compact")
    texts = ["def scale(values, factor):", "import os", "class Point:", "for i in range(3):", "x = [1, 2]"]
    prompts = [Prompt(id=f"p{i}", path="", name="", kind="first_lines", prompt=t, reference="")
               for i, t in enumerate(texts)]
    one = evaluate(path, prompts, 0.9, 2, 16, log=lambda m: None)
    logged = []
    two = evaluate_in_slices(path, prompts, 0.9, 2, 16, jobs=2, log=logged.append)
    assert two == one and "in 2 processes" in logged[-1]
    assert evaluate_in_slices(path, prompts[:1], 0.9, 2, 16, jobs=4, log=logged.append) == evaluate(
        path, prompts[:1], 0.9, 2, 16, log=lambda m: None)  # one slice: no worker processes
