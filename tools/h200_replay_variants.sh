#!/usr/bin/env bash
# One device call: the 2B-shape replay widths (AR = 1, fused 16, 32, 33, 40) under variants of
# the shipped H200 table that change only the BitNet-2B W2A8 launches of the 32- and 64-row
# tiles (widths 17-32 and 33-64), in one run, plus the shipped table captured without
# programmatic launch (its kernels then run one after another: a per-kernel profile whose
# durations add up). Variants (written below from the shipped table):
#   mma32x2   widths 33-64 on the 32-row tile's mma launches in 32-row tiles (two tiles side by side)
#   mma64     widths 33-64 on the same mma launches over the whole width (one 64-row tile)
#   mma16     widths 33-64 on the same mma launches in 16-row tiles
#   nosplit   no K slices at widths 9-64 (no reduction launches): mma at 9-32, dot at 33-64
#   ir        (run at commit 4161478 only: the shipped launches with split-K reduced by the last slice
#             inside the kernel, LinearConfig.inline_reduce, since removed: it lost at every width)
#   tuned33   widths 33-64 on the per-shape picks of the stack sweep at M = 33 (timed alone, cold L2)
#   OUT=/tmp/rv bash tools/h200_replay_variants.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_replay_variants}
V=${VARIANTS_DIR:-/tmp/bitmtp_table_variants}
mkdir -p "$OUT" "$V"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/smi.txt"
python - "$V" <<'EOF'
import copy, json, sys
from dataclasses import asdict, replace
from pathlib import Path
from kernels_ampere import tuning
from kernels_ampere.autotune import MODEL_SHAPES
from kernels_ampere.tuning import DOT, MMA, LinearConfig

out = Path(sys.argv[1])
base = json.loads((tuning.TUNED_DIR / "nvidia_h200.json").read_text())
shapes = {(n, k) for _, n, k, _ in MODEL_SHAPES["bitnet-2b"]}
ours = lambda e: e["op"] == "w2a8_linear" and (e["key"]["N"], e["key"]["K"]) in shapes and e["key"]["scales"] == "row"
tile32 = {(e["key"]["N"], e["key"]["K"]): LinearConfig(**e["config"]) for e in base["entries"] if ours(e) and e["key"]["M"] == 27}

def variant(name, change):
    t = copy.deepcopy(base)
    for e in t["entries"]:
        if ours(e):
            cfg = change(e["key"]["M"], (e["key"]["N"], e["key"]["K"]), LinearConfig(**e["config"]))
            e["config"] = asdict(cfg)
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / "nvidia_h200.json").write_text(json.dumps(t, indent=1))

wide = lambda m: 33 <= m <= 64
variant("mma32x2", lambda m, s, c: replace(tile32[s], block_m=32) if wide(m) else c)
variant("mma64", lambda m, s, c: replace(tile32[s], block_m=0) if wide(m) else c)
variant("mma16", lambda m, s, c: replace(tile32[s], block_m=16) if wide(m) else c)
variant("nosplit", lambda m, s, c: replace(c, split_k=1) if 9 <= m <= 64 else c)
# the per-shape picks of the sweep at M = 33 (tools/results/kernels.md, 2026-12-01 05:32 run), for widths 33-64
picks33 = {(3840, 2560): LinearConfig(DOT, 64, 64, num_warps=4, num_stages=3, split_k=2),
           (2560, 2560): LinearConfig(DOT, 64, 64, num_warps=4, num_stages=3, split_k=4),
           (13824, 2560): LinearConfig(DOT, 128, 64, num_warps=8, num_stages=3, split_k=1),
           (2560, 6912): LinearConfig(MMA, 64, 64, num_warps=4, num_stages=3, split_k=4, block_m=16)}
variant("tuned33", lambda m, s, c: picks33[s] if wide(m) else c)
print("variants:", sorted(p.name for p in out.iterdir()))
EOF
TABLES="before=shipped,before-nopdl=shipped"
for v in mma32x2 mma64 mma16 nosplit tuned33; do TABLES="$TABLES,$v=$V/$v"; done
timeout -k 3 "${T_REPLAY:-240}" python tools/bench_replay_widths.py --tables "$TABLES" \
  --widths "${WIDTHS:-1,16,32,33,40}" --profile "${PROFILE:-1,32,33}" --profile-tables before-nopdl \
  --jobs 14 --out "$OUT" > "$OUT/replays_log.txt" 2>&1
grep -vE "^\|" "$OUT/replays_log.txt" | grep -E "us|rror|Trace" | tail -n 12 | cut -c1-220
sed -n '/^| table/,/^$/p' "$OUT/replay_widths.md"
find "$OUT" -maxdepth 2 -type f | sort
