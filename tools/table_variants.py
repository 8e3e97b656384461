"""Candidate W2A8 tables for ``bench_replay_widths.py``: a tuned table with the ``w2a8_linear``
entries of chosen widths replaced, one folder per candidate (each holding ``<gpu>.json``).

    python tools/table_variants.py --out /tmp/tables --widths 32,33 \\
        --variant more=128:8:4/4/2/4 --variant most=128:8:5/5/3/6:32
    python tools/bench_replay_widths.py --widths 1,32,33 \\
        --tables shipped=shipped,more=/tmp/tables/more,most=/tmp/tables/most

A variant is ``name=BLOCK_N:WARPS:SLICES[:BLOCK_M]``: the folded ``mma`` kernel (64-byte K
steps, three stages) with BLOCK_N weight rows over WARPS warps, ``split_k`` per projection
from SLICES (``/``-separated, in the order of ``--shapes``: by default the BitNet-2B
projections QKV, O, gate+up, down) and BLOCK_M rows per tile (0, the default: the whole
width). Session 10 chose the H200 entries at widths 25, 32, 33 and 40 this way
(``tools/results/kernels.md``, "Split-K sums in the kernel; fused widths re-sliced").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels_ampere import tuning  # noqa: E402
from kernels_ampere.autotune import MODEL_SHAPES  # noqa: E402
from kernels_ampere.tuning import MMA, LinearConfig  # noqa: E402

# N x K of QKV, O, gate+up, down
BITNET_2B_SHAPES = ",".join(f"{n}x{k}" for _, n, k, _ in MODEL_SHAPES["bitnet-2b"])


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(n), int(k)) for n, k in (item.split("x") for item in text.split(","))]
    except ValueError:
        raise SystemExit(f"table_variants: --shapes {text!r} is not a comma list of NxK") from None


def parse_variant(text: str, projections: int) -> tuple[str, list[LinearConfig]]:
    """``name=BLOCK_N:WARPS:S1/S2/..[:BLOCK_M]`` -> (name, one config per projection)."""
    name, _, spec = text.partition("=")
    fields = spec.split(":")
    try:
        if not name or len(fields) not in (3, 4):
            raise ValueError
        block_n, warps = int(fields[0]), int(fields[1])
        slices = [int(s) for s in fields[2].split("/")]
        block_m = int(fields[3]) if len(fields) == 4 else 0
    except ValueError:
        raise SystemExit(f"table_variants: --variant {text!r} is not name=BLOCK_N:WARPS:S1/S2/..[:BLOCK_M]") from None
    if len(slices) != projections:
        raise SystemExit(f"table_variants: --variant {name}: {len(slices)} slice counts for {projections} shapes")
    if block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8) or min(slices) < 1:
        raise SystemExit(f"table_variants: --variant {name}: BLOCK_N must be a power of two >= 16, WARPS 1, 2, 4 "
                         f"or 8, every slice count >= 1 (got {block_n}, {warps}, {slices})")
    try:  # LinearConfig validates the rest (block sizes, warps)
        configs = [LinearConfig(MMA, block_n, 64, num_warps=warps, num_stages=3, split_k=s, block_m=block_m,
                                fold_lanes=True) for s in slices]
    except ValueError as e:
        raise SystemExit(f"table_variants: --variant {name}: {e}") from None
    return name, configs


def replaced(table: dict, shapes: list[tuple[int, int]], widths: list[int], configs: list[LinearConfig],
             why: str) -> dict:
    """``table`` with its row-scale ``w2a8_linear`` entries at ``widths`` for ``shapes`` replaced."""
    keys = [tuning.linear_key(n, k, m, False) for m in widths for n, k in shapes]
    entries = [e for e in table["entries"] if not (e["op"] == "w2a8_linear" and e["key"] in keys)]
    entries += [{**tuning.record("w2a8_linear", tuning.linear_key(n, k, m, False), cfg, 0.0), "us": None,
                 "chosen_by": why} for m in widths for (n, k), cfg in zip(shapes, configs)]  # not timed alone
    return {**table, "entries": entries}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=tuning.TUNED_DIR / "nvidia_h200.json", help="the table to start from")
    ap.add_argument("--widths", required=True, help="comma list of the widths M whose entries are replaced")
    ap.add_argument("--shapes", default=BITNET_2B_SHAPES, help="comma list of NxK (default: the BitNet-2B projections)")
    ap.add_argument("--variant", action="append", required=True, help="name=BLOCK_N:WARPS:S1/S2/..[:BLOCK_M]")
    ap.add_argument("--out", type=Path, required=True, help="a folder per variant is written under it")
    args = ap.parse_args(argv)
    if not args.base.is_file():
        raise SystemExit(f"table_variants: --base {args.base} is not a file (a tuned table, <gpu>.json)")
    table = json.loads(args.base.read_text())
    shapes = parse_shapes(args.shapes)
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise SystemExit(f"table_variants: --widths {args.widths!r} is not a comma list of integers") from None
    variants = [parse_variant(v, len(shapes)) for v in args.variant]
    for name, configs in variants:
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        out = replaced(table, shapes, widths, configs, f"candidate {name} (tools/table_variants.py)")
        (folder / args.base.name).write_text(json.dumps(out, indent=1) + "\n")
        print(f"{folder / args.base.name}: widths {widths}, slices {[c.split_k for c in configs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
