"""``bitmtp chat`` driven as a user drives it, through stdin (found by black-box runs):
turns that must not run into the reply before them, settings no turn could use refused at
the start or at ``/policy``, and a whole scripted session without a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from bitmtp_edge.app.chat import ChatSession
from bitmtp_edge.app.cli import main

from .helpers import one_thread, random_model, write_test_artifact  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return write_test_artifact(random_model(seed=0, hidden=128, layers=1), tmp_path_factory.mktemp("chat") / "art",
                               max_context=128)


@pytest.fixture(scope="module")
def engine(artifact):
    from bitmtp_edge.runtime.engine import Engine

    return Engine.load(artifact, backend="reference", device="cpu")


def invoke(*args, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_a_reply_cut_at_max_new_tokens_does_not_run_into_the_next_turn(engine):
    # The transcript was turn + reply + next turn with nothing between: a reply stopped at
    # max_new_tokens ("... t2") ran into the next turn ("t4 t5") as "t2t4", a token nobody
    # typed (the unknown token here; with the code model "return x" + "y = 1" -> "return xy = 1").
    s = ChatSession(engine, policy="ar", max_new_tokens=4)
    first = "".join(piece for piece, _ in s.reply("t1 t2 t3"))
    assert first and not first.endswith("\n") and s.last_stats.finish_reason == "length"
    second = "".join(piece for piece, _ in s.reply("t4 t5"))
    assert s.transcript == "t1 t2 t3\n" + first + "\nt4 t5\n" + second
    # what the model read for the second turn: every token the user and the model wrote, none merged
    assert engine.encode(s.transcript) == engine.encode("t1 t2 t3\n" + first) + engine.encode("t4 t5\n" + second)


@pytest.mark.parametrize("args, error", [
    (("--policy", "fused", "--temperature", "0.7"), "not implemented for fused"),
    (("--min-prefix", "9"), "min_prefix must be in 1..4"),
])
def test_chat_refuses_at_the_start_settings_no_turn_could_use(artifact, args, error):
    # The session started, answered every turn with the same error and exited 0.
    res = invoke("chat", "-a", artifact, "-n", 3, *args, input="t1 t2\nt3\n")
    assert res.exit_code == 1, res.output
    assert error in res.output and "Traceback" not in res.output
    assert "[" not in res.stdout  # no turn was answered


def test_switching_to_fused_while_sampling_is_refused_and_the_policy_kept(artifact):
    # /policy fused was accepted under --temperature, then every turn failed.
    res = invoke("chat", "-a", artifact, "-n", 3, "-t", "0.7", "--seed", 1,
                 input="/policy fused\n/policy\nt1 t2\n")
    assert res.exit_code == 0, res.output
    assert "error: sampling (temperature > 0 or penalties) is not implemented for fused" in res.stderr
    assert "policy: hybrid (choices:" in res.stderr
    stats = [line for line in res.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 1 and stats[0].startswith("[hybrid] 3 tokens")


def test_a_scripted_session_with_every_command_and_fused(artifact, engine):
    script = "t1 t2 t3\n/help\n/policy fused\nt4 t5\n/POLICY ar\n/reset\nt6 t7\n/policy fused\n/reset\nt6 t7\n"
    res = invoke("chat", "-a", artifact, "-n", 6, input=script)  # no /quit: the session ends at end of input
    assert res.exit_code == 0 and res.exception is None, res.output
    stats = [line for line in res.stderr.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] + "]" for line in stats] == ["[hybrid]", "[fused]", "[ar]", "[fused]"]
    assert all("6 tokens" in line for line in stats)
    replies = [line for line in res.stdout.splitlines() if line.strip()]
    assert len(replies) == 4
    # after /reset both answer "t6 t7" alone; fused is lossless, so its text is AR's
    assert replies[2] == replies[3] == engine.generate("t6 t7\n", max_new_tokens=6, policy="ar").text
    assert res.stderr.count("transcript cleared") == 2 and "/policy" in res.stderr
