#!/usr/bin/env bash
# One device call for the HTTP serving benchmark (issue 17) on the H200. The serving packages
# the image lacks (fastapi, starlette, pydantic, uvicorn and their newer needs) travel as wheels
# in WHEELS and are installed into /tmp/site; then bench_serve.py runs, once per mode:
# in-process (uvicorn in a thread over the benchmark's own Engine: the HTTP cost alone) and
# separate (`bitmtp serve --port` in its own process, as users run it), each under its own
# timeout so one part's overrun leaves the other's results.
#   WHEELS=.dev/serve/wheels BITMTP_COMMIT=$(git rev-parse --short HEAD) bash tools/h200_serve.sh
# Knobs: POLICIES, PROMPTS, REPEATS, INTERVALS (ms, comma-separated; *_SEPARATE for that part), MODES,
# TOKENS, SHORT_TOKENS, EXTRA (more bench_serve.py arguments), T_INPROC / T_SEPARATE (seconds per part).
set -uo pipefail
export PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_serve}
mkdir -p "$OUT"
# WHEELS/*.whl are installed; WHEELS/if_old/NAME-*.whl only where the image's NAME is missing or
# older than fastapi/starlette need (anyio >= 4.1, annotated-doc >= 0.0.2), so the image's own
# versions are not shadowed needlessly.
if [ -n "${WHEELS:-}" ]; then
  extra=$(python3 - "$WHEELS" <<'PY'
import glob, importlib.metadata as md, sys
need = {"anyio": (4, 1), "annotated_doc": (0, 0, 2)}
for name, least in need.items():
    try:
        have = tuple(int(x) for x in md.version(name.replace("_", "-")).split(".")[:len(least)])
    except Exception:  # missing, or a version string that does not parse
        have = ()
    if have < least:
        print(" ".join(glob.glob(f"{sys.argv[1]}/if_old/{name}-*.whl")))
PY
)
  timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl $extra || exit 1
  echo "installed: $(ls "$WHEELS"/*.whl | xargs -n1 basename | tr '\n' ' ') $extra"
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import importlib.metadata as md, fastapi, uvicorn, pydantic, anyio, tokenizers; \
print(*(f'{n} {md.version(n)}' for n in ('fastapi', 'starlette', 'uvicorn', 'pydantic', 'anyio', 'tokenizers')))" || exit 1
common=(--policies "${POLICIES:-ar,speculative,hybrid}" --tokens "${TOKENS:-256}" --short-tokens "${SHORT_TOKENS:-16}"
        --out "$OUT" ${EXTRA:-})
for mode in $(echo "${MODES:-in-process,separate}" | tr ',' ' '); do
  if [ "$mode" = in-process ]; then
    limit=${T_INPROC:-90}; prompts=${PROMPTS:-3}; repeats=${REPEATS:-4}; intervals=${INTERVALS:-5,20}
  else
    limit=${T_SEPARATE:-70}; prompts=${PROMPTS_SEPARATE:-2}; repeats=${REPEATS_SEPARATE:-3}; intervals=${INTERVALS_SEPARATE:-5}
  fi
  echo "== $mode (timeout ${limit} s)"
  timeout -k 10 "$limit" python3 tools/bench_serve.py --modes "$mode" --name "serve_$mode" \
    --prompts "$prompts" --repeats "$repeats" --stream-intervals "$intervals" "${common[@]}" 2>&1 | tee "$OUT/bench_serve_$mode.log" | grep -v "Warning"
  echo "== $mode: exit ${PIPESTATUS[0]}"
done
find "$OUT" -maxdepth 1 -type f | sort
