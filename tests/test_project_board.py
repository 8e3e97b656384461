"""tools/project_board.py: decoding routes' measured step sequences priced at a board's replay costs."""

from __future__ import annotations

import json

import pytest

from tools import project_board as pb


def steps_report() -> dict:
    return {"device": "test", "trained": {"D=8:model": {"full": {
        "ar": {"tokens": [3, 2], "steps": [[[1, "verify"]] * 3, [[1, "verify"]] * 2]},
        "speculative": {"tokens": [5], "steps": [[[9, "draft"], [9, "verify"], [9, "draft"], [9, "verify"]]]},
        "fused c=3": {"tokens": [7], "steps": [[[9, "draft"], [33, "fused"], [32, "fused"], [32, "fused"]]]},
        "hybrid": {"tokens": [4], "steps": [[[9, "draft"], [12, "draft"], [9, "verify"]]]},
        "prompts": 2}}}}


def replays(costs: dict) -> dict:
    return {"device": "GPU", "sms": 8, "green_context": True, "command": "bench_replay_widths.py --sms 8",
            "tables": {"board": {"replay_us": costs}}}


def test_routes_are_priced_pass_by_pass_and_compared_with_ar(tmp_path):
    steps, reps = tmp_path / "e2e.json", tmp_path / "replays.json"
    steps.write_text(json.dumps(steps_report()))
    reps.write_text(json.dumps(replays({"1": 100.0, "d9": 110.0, "32": 190.0, "33": 230.0})))
    assert pb.main(["--steps", str(steps), "--replays", str(reps), "--proxy", "v9=d9", "--out", str(tmp_path / "o")]) == 0
    report = json.loads((tmp_path / "o" / "board_projection.json").read_text())
    routes = report["routes"]
    assert routes["ar"]["us"] == 500.0 and routes["ar"]["tok_s"] == pytest.approx(1e4)
    assert routes["speculative"]["us"] == 4 * 110.0  # the verifies priced as drafts (the proxy)
    assert routes["fused c=3"]["us"] == 110.0 + 230.0 + 2 * 190.0
    assert routes["fused c=3"]["vs_ar"] == pytest.approx((7 / 720e-6) / (5 / 500e-6))
    assert routes["hybrid"]["missing"] == ["d12"] and "us" not in routes["hybrid"]
    assert report["proxies"] == {"v9": "d9"}
    text = (tmp_path / "o" / "board_projection.md").read_text()
    assert "v9 priced as d9" in text and "not priced: no replay of d12" in text and "| speculative | 4 | 5 |" in text


def test_the_automatic_c_is_the_cheapest_measured_one_of_auto_candidates():
    report = steps_report()
    per = report["trained"]["D=8:model"]["full"]
    per["fused c=1"] = {"tokens": [7], "steps": [[[9, "draft"], [16, "fused"], [9, "draft"], [16, "fused"]]]}
    per["fused c=3"] = {"tokens": [7], "steps": [[[9, "draft"], [32, "fused"], [32, "fused"]]]}  # hits more
    narrow = pb.project(report, {"1": 100.0, "d9": 110.0, "16": 120.0, "32": 300.0}, {})
    assert narrow["auto"]["c"] == 1 and narrow["auto"]["us_per_token"] == pytest.approx(460.0 / 7)
    flat = pb.project(report, {"1": 100.0, "d9": 110.0, "16": 120.0, "32": 121.0}, {})
    assert flat["auto"]["c"] == 3 and flat["auto"]["us_per_token"] == pytest.approx(352.0 / 7)
    del per["fused c=1"]  # a c of AUTO_CANDIDATES not measured: no answer rather than a guess
    assert pb.project(report, {"1": 100.0, "d9": 110.0, "32": 121.0}, {})["auto"] is None


def test_a_measured_label_is_never_replaced_by_its_proxy():
    result = pb.project(steps_report(), {"1": 100.0, "d9": 110.0, "v9": 90.0}, {"v9": "d9"})
    assert result["routes"]["speculative"]["us"] == 2 * 110.0 + 2 * 90.0 and result["proxies"] == {}


def test_step_labels_follow_bench_replay_widths():
    assert [pb.step_label(w, r) for w, r in ((1, "verify"), (9, "draft"), (9, "verify"), (32, "fused"))] == \
        ["1", "d9", "v9", "32"]


@pytest.mark.parametrize("bad,message", [("x", "LABEL=MEASURED"), ("v9=", "LABEL=MEASURED")])
def test_bad_proxies_say_what_to_give(bad, message):
    with pytest.raises(SystemExit, match=message):
        pb.parse_proxies(bad)


def test_files_it_cannot_read_are_named(tmp_path):
    steps, reps = tmp_path / "e2e.json", tmp_path / "replays.json"
    steps.write_text(json.dumps({"device": "x"}))
    reps.write_text(json.dumps(replays({"1": 1.0})))
    with pytest.raises(SystemExit, match="e2e.json: not a bench_e2e.py report"):
        pb.main(["--steps", str(steps), "--replays", str(reps), "--out", str(tmp_path / "o")])
    steps.write_text(json.dumps(steps_report()))
    two = replays({"1": 1.0})
    two["tables"]["other"] = {"replay_us": {"1": 2.0}}
    reps.write_text(json.dumps(two))
    with pytest.raises(SystemExit, match="holds board, other; name one"):
        pb.main(["--steps", str(steps), "--replays", str(reps), "--out", str(tmp_path / "o")])
    reps.write_text(json.dumps(replays({"d9": 1.0})))
    with pytest.raises(SystemExit, match="no AR step"):
        pb.main(["--steps", str(steps), "--replays", str(reps), "--out", str(tmp_path / "o")])


def test_replays_of_one_board_merge_and_of_two_boards_do_not(tmp_path):
    steps, a, b = tmp_path / "e2e.json", tmp_path / "a.json", tmp_path / "b.json"
    steps.write_text(json.dumps(steps_report()))
    a.write_text(json.dumps(replays({"1": 100.0, "d9": 110.0})))
    b.write_text(json.dumps(replays({"v9": 120.0, "d12": 130.0})))
    pb.main(["--steps", str(steps), "--replays", str(a), str(b), "--out", str(tmp_path / "o")])
    routes = json.loads((tmp_path / "o" / "board_projection.json").read_text())["routes"]
    assert routes["speculative"]["us"] == 2 * 110.0 + 2 * 120.0 and routes["hybrid"]["us"] == 110.0 + 130.0 + 120.0
    other = replays({"v9": 120.0})
    other["sms"] = 16
    b.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="merge runs of one device and SM count"):
        pb.main(["--steps", str(steps), "--replays", str(a), str(b), "--out", str(tmp_path / "o")])
