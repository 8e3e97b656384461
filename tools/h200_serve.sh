#!/usr/bin/env bash
# One device call for the HTTP serving benchmark (issue 17) on the H200. The serving packages
# the image lacks (fastapi, starlette, pydantic, uvicorn and their newer needs) travel as wheels
# in WHEELS and are installed into /tmp/site; then bench_serve.py runs every policy.
#   WHEELS=.dev/serve/wheels BITMTP_COMMIT=$(git rev-parse --short HEAD) bash tools/h200_serve.sh
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
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl $extra || exit 1
  echo "installed: $(ls "$WHEELS"/*.whl | xargs -n1 basename | tr '\n' ' ') $extra"
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import importlib.metadata as md, fastapi, uvicorn, pydantic, httpx, anyio; \
print(*(f'{n} {md.version(n)}' for n in ('fastapi', 'starlette', 'uvicorn', 'pydantic', 'httpx', 'anyio')))" || exit 1
timeout -k 10 ${T_BENCH:-420} python3 tools/bench_serve.py --policies ${POLICIES:-ar,speculative,hybrid} \
  --prompts ${PROMPTS:-4} --tokens 256 --short-tokens 16 --repeats ${REPEATS:-5} --out "$OUT" 2>&1 \
  | tee "$OUT/bench_serve.log" | grep -v "Warning"
find "$OUT" -maxdepth 1 -type f | sort
