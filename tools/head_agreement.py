"""What an int8 verify head would change: the 16-bit head against the artifact's int8 head on
held-out text.

On a board the AR step is bandwidth-bound and the BitNet-2B shape's 16-bit verify head is
656 MB, as much as its whole ternary stack (``tools/results/kernels.md``, "An Orin's SM
count on the H200"). The artifact already carries an int8 copy (``draft_head.int8``: per-row
scales, W8A8 with per-token activation scales), which the draft step reads. Before the verify
role could read it too, this measures what it changes on the test split, the runtime's exact
integer model, one forward per window:

* **argmax agreement**: the share of positions where the two heads pick the same next token
  (greedy AR output is the verifier's argmax, so every disagreement can change the text);
* **NTP loss** of each head on the true next token, and the int8 head's gap.

    python tools/head_agreement.py --model d8=tools/checkpoints/bitmtp-d8-27m --max-windows 32 \\
        --out tools/results/head_agreement
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.corpus import load_split  # noqa: E402
from tools.eval_quality import add_heldout_arguments, heldout_windows, named_checkpoints  # noqa: E402
from tools.hf_checkpoint import load_runtime_model  # noqa: E402
from tools.provenance import commit  # noqa: E402


@torch.no_grad()
def compare_heads(model, tokens: np.ndarray, window: int, max_windows: int, device: str, batch: int = 4) -> dict:
    """Both heads over non-overlapping ``window``-token windows of ``tokens``."""
    n, batches = heldout_windows(tokens, window, max_windows, device, batch)
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens: fewer than one window of {window} (+1)")
    same = count = 0
    ce16 = ce8 = 0.0
    for x, y, pos, mask in batches:
        y = y.reshape(-1)
        hidden = model(x, pos, mask)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        l16, l8 = model.verify_logits(hidden).double(), model.draft_logits(hidden).double()
        same += int((l16.argmax(-1) == l8.argmax(-1)).sum())
        ce16 += float(torch.nn.functional.cross_entropy(l16, y, reduction="sum"))
        ce8 += float(torch.nn.functional.cross_entropy(l8, y, reduction="sum"))
        count += y.numel()
    return {"positions": count, "windows": n, "window": window, "argmax_agreement": same / count,
            "argmax_disagreements": count - same, "ntp_loss_16bit": ce16 / count, "ntp_loss_int8": ce8 / count,
            "int8_gap_pct": 100 * (ce8 / ce16 - 1)}


def markdown(report: dict) -> str:
    lines = ["# The 16-bit verify head against the artifact's int8 head (held-out text)", "",
             f"- device: {report['device']}", f"- date: {report['date']}", f"- commit: {report['commit']}",
             f"- command: `{report['command']}`", "",
             "Test split, non-overlapping windows, the runtime's exact integer model; the int8 head is the "
             "artifact's draft head (per-row scales, int8 per-token activations).", "",
             "| model | positions | argmax agreement | disagreements | NTP loss, 16-bit head | NTP loss, int8 head | gap |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["models"].items():
        lines.append(f"| {name} | {r['positions']} | {r['argmax_agreement']:.5f} | {r['argmax_disagreements']} | "
                     f"{r['ntp_loss_16bit']:.4f} | {r['ntp_loss_int8']:.4f} | {r['int8_gap_pct']:+.3f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_heldout_arguments(ap, window=512, max_windows=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True, help="folder for head_agreement.json and .md")
    args = ap.parse_args(argv)
    named = named_checkpoints(args.model, "head_agreement")
    tokens = load_split(args.data, "test")
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
              "command": " ".join(["python tools/head_agreement.py", *(argv if argv is not None else sys.argv[1:])]),
              "models": {}}
    for name, path in named.items():
        model, _ = load_runtime_model(path, torch.float64, args.device)
        r = compare_heads(model, tokens, args.window, args.max_windows, args.device)
        report["models"][name] = {"path": path, **r}
        print(f"{name}: argmax agreement {r['argmax_agreement']:.5f} ({r['argmax_disagreements']} of "
              f"{r['positions']}), NTP {r['ntp_loss_16bit']:.4f} -> {r['ntp_loss_int8']:.4f} "
              f"({r['int8_gap_pct']:+.3f}%)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_agreement.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "head_agreement.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
