#!/usr/bin/env bash
# One device call: Nsight Compute's counters of the shipped W2A8 launches (tools/ncu_w2a8.py)
# at WIDTHS on the BitNet-2B shapes, then EXTRA (a command line, optional) under its own limit.
# Report: $OUT/ncu/ncu_w2a8.{md,json}; the raw, details and SASS-source exports in $OUT/ncu_raw.tgz.
#   OUT=/tmp/ncu WIDTHS=1,16,32 BITMTP_COMMIT=abc bash tools/h200_ncu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/h200_ncu}
WIDTHS=${WIDTHS:-1,16,32,33,80}
mkdir -p "$OUT" /tmp/ncu_exports
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
"$NCU" --version | tail -n 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
CMD="ncu --clock-control none --profile-from-start off --kernel-name regex:_w2a8_ --set full -o w2a8 \
python tools/ncu_w2a8.py launch --widths $WIDTHS --calls calls.json"
# shellcheck disable=SC2086
PYTHONPATH=. timeout -k 3 "${T_NCU:-300}" "$NCU" ${CMD#ncu } > "$OUT/ncu.log" 2>&1
echo "ncu: exit $?"; grep -E "ncu_w2a8|rror|WARN" "$OUT/ncu.log" | head -n 8 | cut -c1-200
ls -la w2a8.ncu-rep
"$NCU" --import w2a8.ncu-rep --page raw --csv > /tmp/ncu_exports/raw.csv
"$NCU" --import w2a8.ncu-rep --page details --csv > /tmp/ncu_exports/details.csv
"$NCU" --import w2a8.ncu-rep --page source --csv --print-source sass > /tmp/ncu_exports/source.csv 2> /tmp/ncu_exports/source.err
cp calls.json /tmp/ncu_exports/
PYTHONPATH=. python tools/ncu_w2a8.py summarize /tmp/ncu_exports/raw.csv --calls calls.json --out "$OUT/ncu" \
  --source /tmp/ncu_exports/source.csv --command "$CMD" > "$OUT/summary.txt" 2>&1
echo "summary: exit $?"; cut -c1-260 "$OUT/summary.txt"
tar czf "$OUT/ncu_raw.tgz" -C /tmp/ncu_exports .
ls -la "$OUT/ncu_raw.tgz"
if [ -n "${EXTRA:-}" ]; then
  timeout -k 3 "${T_EXTRA:-120}" bash -c "$EXTRA" > "$OUT/extra.log" 2>&1
  echo "extra: exit $?"; tail -n 12 "$OUT/extra.log" | cut -c1-250
fi
