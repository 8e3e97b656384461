"""Session 12, CPU: does a softmax temperature fitted on held-out data close the NTP gap?

For the release BitMTP model and the SFT baseline (``tools/checkpoints``), the NTP cross-entropy
over test-split windows of 512 tokens (the reference runtime model in float64, as
``tools/eval_quality.py --sections heldout`` computes it) at several temperatures T (logits / T);
T is fitted on windows the report does not use (``--fit-from``), the loss reported on the report's
windows 0..127. A temperature leaves every argmax, so every greedy output, unchanged.

    python tools/results/session12/cpu_ntp_temperature/ntp_temperature.py --windows 128 --fit-windows 64
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from tools.eval_quality import runtime  # noqa: E402

TEMPS = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.3)


@torch.no_grad()
def losses(path: str, tokens: np.ndarray, first: int, count: int, window: int = 512, batch: int = 4) -> dict:
    model, _, _ = runtime(path, "cpu")
    pos = torch.arange(window).unsqueeze(0)
    mask = torch.ones(window, window, dtype=torch.bool).tril().unsqueeze(0)
    total = {t: 0.0 for t in TEMPS}
    n = 0
    for i in range(first, first + count, batch):
        rows = range(i, min(i + batch, first + count))
        x = torch.stack([torch.from_numpy(tokens[r * window:(r + 1) * window].astype(np.int64)) for r in rows])
        y = torch.stack([torch.from_numpy(tokens[r * window + 1:(r + 1) * window + 1].astype(np.int64)) for r in rows])
        logits = model.verify_logits(model(x, pos.expand(len(rows), -1), mask)).double()
        logits = logits.reshape(-1, logits.shape[-1])
        for t in TEMPS:
            total[t] += float(torch.nn.functional.cross_entropy(logits / t, y.reshape(-1), reduction="sum"))
        n += y.numel()
    return {str(t): v / n for t, v in total.items()}


def add_gaps(report: dict) -> None:
    """The BitMTP model's NTP loss over the SFT model's, minus one: both at T = 1, both at their
    fitted T, and the BitMTP model fitted against the SFT model as it is."""
    s, m = report["models"]["sft-27m"], report["models"]["bitmtp-d8-27m"]
    report["gap_at_1"] = m["test_at_1"] / s["test_at_1"] - 1
    report["gap_each_fitted"] = m["test_at_fit"] / s["test_at_fit"] - 1
    report["gap_bitmtp_fitted_vs_sft_raw"] = m["test_at_fit"] / s["test_at_1"] - 1
    print(json.dumps({k: v for k, v in report.items() if k.startswith("gap")}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--fit-from", type=int, default=1000)
    ap.add_argument("--fit-windows", type=int, default=64)
    ap.add_argument("--models", default="sft-27m,bitmtp-d8-27m", help="folders of tools/checkpoints")
    ap.add_argument("--out", default=str(Path(__file__).with_name("ntp_temperature.json")))
    ap.add_argument("--merge", nargs=2, default=None, help="two one-model reports -> one with the gaps")
    args = ap.parse_args()
    if args.merge:
        a, b = (json.loads(Path(f).read_text()) for f in args.merge)
        report = {**a, "command": [a["command"], b["command"]], "models": {**a["models"], **b["models"]}}
        add_gaps(report)
        Path(args.out).write_text(json.dumps(report, indent=1))
        return
    torch.set_num_threads(1)
    tokens = np.fromfile(ROOT / "tools/checkpoints/data/test_000.bin", dtype=np.uint16)
    report = {"command": "python " + " ".join(sys.argv), "windows": args.windows,
              "fit_windows": [args.fit_from, args.fit_from + args.fit_windows], "models": {}}
    for name in args.models.split(","):
        path = str(ROOT / "tools/checkpoints" / name)
        t0 = time.perf_counter()
        fit = losses(path, tokens, args.fit_from, args.fit_windows)
        best = min(fit, key=fit.get)
        test = losses(path, tokens, 0, args.windows)
        report["models"][name] = {"fit": fit, "test": test, "t_fit": float(best), "test_at_1": test["1.0"],
                                  "test_at_fit": test[best], "s": round(time.perf_counter() - t0)}
        print(name, json.dumps(report["models"][name]), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    if set(report["models"]) != {"sft-27m", "bitmtp-d8-27m"}:
        return  # one model per process: merge the two files with --merge
    add_gaps(report)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
