#!/usr/bin/env bash
# Set up BitMTP Edge on a Jetson running JetPack 6 (L4T R36.x, Ubuntu 22.04, Python 3.10).
#
#   jetson/setup_jetpack6.sh [--dry-run] [--venv DIR] [--torch-wheel URL] [--skip-torch]
#                            [--triton-index URL] [--skip-triton] [--min-free-gb N]
#
# Phase 1 only reads (board, JetPack, Python, disk, CUDA, cuSPARSELt, power posture) and stops
# on the first hard problem. Phase 2 installs:
#   1. cuSPARSELt into /usr/local/cuda (sudo), if missing: NVIDIA's torch >= 2.4 wheels link it;
#   2. NVIDIA's PyTorch wheel for JetPack 6 (PyPI has no CUDA wheels for Jetson's iGPU).
#      Index: https://developer.download.nvidia.com/compute/redist/jp/ (v60 = JP 6.0, v61 = JP 6.1/6.2).
#      Names: torch-<ver>a0+<git sha>.nv<YY.MM>.<build>-cp310-cp310-linux_aarch64.whl, e.g.
#      torch-2.5.0a0+872d972e41.nv24.08.17622132-cp310-cp310-linux_aarch64.whl (NGC 24.08, CUDA 12.6);
#      built against NumPy 1.x, hence numpy<2;
#   3. Triton from the Jetson AI Lab index (https://pypi.jetson-ai-lab.io/jp6/cu126, formerly
#      .dev): NVIDIA publishes no Triton wheel for Jetson; without Triton the reference backend
#      still runs, only slower;
#   4. this package: pip install -e .[jetson], with torch pinned to the wheel just installed so
#      pip cannot replace it with a CPU-only PyPI build.
# It never changes the power mode or clocks; it prints the commands instead.
set -euo pipefail

DRY_RUN=0
VENV=""
TORCH_WHEEL=""
SKIP_TORCH=0
TRITON_INDEX="https://pypi.jetson-ai-lab.io/jp6/cu126"
SKIP_TRITON=0
MIN_FREE_GB=8
CUSPARSELT_URL="https://developer.download.nvidia.com/compute/cusparselt/redist/libcusparse_lt/linux-aarch64/libcusparse_lt-linux-aarch64-0.7.1.0-archive.tar.xz"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --venv) VENV="$2"; shift ;;
    --torch-wheel) TORCH_WHEEL="$2"; shift ;;
    --skip-torch) SKIP_TORCH=1 ;;
    --triton-index) TRITON_INDEX="$2"; shift ;;
    --skip-triton) SKIP_TRITON=1 ;;
    --min-free-gb) MIN_FREE_GB="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say()  { printf '%s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die()  { printf 'error: %s\n' "$*" >&2; exit 1; }
run()  { printf '+ %s\n' "$*"; if [[ $DRY_RUN -eq 0 ]]; then "$@"; fi; }

# ------------------------------------------------------------------ phase 1: checks (read-only)
say "== checks (nothing is changed in this phase)"

[[ "$(uname -m)" == "aarch64" ]] || die "this is $(uname -m), not a Jetson (aarch64). On a PC or server use: pip install -e '.[dev]'"

REL=/etc/nv_tegra_release
[[ -r $REL ]] || die "$REL not found: not a Jetson, or a container without it (mount it: -v $REL:$REL:ro)"
L4T_MAJOR=$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1/p' $REL | head -n1)
L4T_REV=$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\2/p' $REL | head -n1)
[[ -n "$L4T_MAJOR" ]] || die "could not read the L4T version from the first line of $REL"
L4T="$L4T_MAJOR.$L4T_REV"
[[ "$L4T_MAJOR" == "36" ]] || die "L4T R$L4T is not JetPack 6 (R36.x). JetPack 5 is R35, JetPack 7 is R38/R39: this script only knows JetPack 6's wheels"
say "L4T R$L4T (JetPack 6)"
MODEL=$( { tr -d '\0' </proc/device-tree/model; } 2>/dev/null || echo unknown)
say "board: $MODEL"

PY=python3
command -v $PY >/dev/null || die "python3 not found: sudo apt install python3 python3-venv python3-pip"
PYV=$($PY -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$PYV" == "3.10" ]] || die "python3 is $PYV; NVIDIA's JetPack 6 wheels are cp310 (Ubuntu 22.04's python3.10). Use /usr/bin/python3.10"
say "python $PYV"

TARGET_DIR="${VENV:-$HOME}"
mkdir_parent=$(dirname "$TARGET_DIR")
FREE_KB=$(df -Pk "$( [[ -d $TARGET_DIR ]] && echo "$TARGET_DIR" || echo "$mkdir_parent")" | awk 'NR==2 {print $4}')
FREE_GB=$((FREE_KB / 1024 / 1024))
(( FREE_GB >= MIN_FREE_GB )) || die "only ${FREE_GB} GB free under $TARGET_DIR; need ${MIN_FREE_GB} GB (torch, triton, pip cache). Free space or pass --min-free-gb"
say "disk: ${FREE_GB} GB free under $TARGET_DIR"

if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  say "CUDA: $(/usr/local/cuda/bin/nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
else
  warn "no /usr/local/cuda/bin/nvcc: install the JetPack components first (sudo apt install nvidia-jetpack); Triton needs the CUDA toolkit"
fi

NEED_CUSPARSELT=0
if ! ldconfig -p 2>/dev/null | grep -q libcusparseLt.so && ! ls /usr/local/cuda/lib64/libcusparseLt.so* >/dev/null 2>&1; then
  NEED_CUSPARSELT=1
  say "cuSPARSELt: missing (will be installed into /usr/local/cuda with sudo)"
else
  say "cuSPARSELt: present"
fi

if [[ -z "$TORCH_WHEEL" ]]; then
  case "$L4T_REV" in
    2.*|3.*) TORCH_WHEEL="https://developer.download.nvidia.com/compute/redist/jp/v60/pytorch/torch-2.4.0a0+07cecf4168.nv24.05.14710581-cp310-cp310-linux_aarch64.whl" ;;
    *)       TORCH_WHEEL="https://developer.download.nvidia.com/compute/redist/jp/v61/pytorch/torch-2.5.0a0+872d972e41.nv24.08.17622132-cp310-cp310-linux_aarch64.whl" ;;
  esac
fi

if command -v nvpmodel >/dev/null; then
  say "power mode: $(nvpmodel -q 2>/dev/null | sed -n 's/^NV Power Mode: //p' || true) (benchmarks want MAXN_SUPER or MAXN, then 'sudo jetson_clocks'; see jetson/README.md)"
fi

# ------------------------------------------------------------------ phase 2: install
say "== install$( [[ $DRY_RUN -eq 1 ]] && echo ' (dry run: printing commands only)')"

if [[ -n "$VENV" ]]; then
  # --system-site-packages: JetPack's TensorRT/cuDNN Python bindings live in the system site.
  [[ -d "$VENV" ]] || run $PY -m venv --system-site-packages "$VENV"
  PY="$VENV/bin/python"
fi
PIP=("$PY" -m pip)
[[ -z "$VENV" && -z "${VIRTUAL_ENV:-}" ]] && PIP+=(--user) && warn "no --venv and no active virtualenv: installing with pip --user"

if [[ $NEED_CUSPARSELT -eq 1 && $SKIP_TORCH -eq 0 ]]; then
  if [[ $DRY_RUN -eq 1 ]]; then TMP=/tmp/cusparselt.XXXX; else TMP=$(mktemp -d); fi
  run curl -fsSL -o "$TMP/cusparselt.tar.xz" "$CUSPARSELT_URL"
  run tar -xJf "$TMP/cusparselt.tar.xz" -C "$TMP"
  run sudo cp -a "$TMP"/libcusparse_lt-linux-aarch64-0.7.1.0-archive/include/. /usr/local/cuda/include/
  run sudo cp -a "$TMP"/libcusparse_lt-linux-aarch64-0.7.1.0-archive/lib/. /usr/local/cuda/lib64/
  run sudo ldconfig
  run rm -rf "$TMP"
fi

run "${PIP[@]}" install --upgrade pip
if [[ $SKIP_TORCH -eq 0 ]]; then
  run "${PIP[@]}" install "numpy>=1.24,<2" "$TORCH_WHEEL"
fi
if [[ $SKIP_TRITON -eq 0 ]]; then
  # --no-deps: take only Triton from this index, nothing that could replace torch.
  run "${PIP[@]}" install --no-deps --index-url "$TRITON_INDEX" "triton>=3.0"
fi

CONSTRAINTS=$(mktemp)
if [[ $DRY_RUN -eq 0 ]]; then
  TORCH_VER=$("$PY" -c 'import torch; print(torch.__version__)') \
    || die "torch does not import; install NVIDIA's wheel first (drop --skip-torch) or pass --torch-wheel URL"
  printf 'torch==%s\nnumpy<2\n' "$TORCH_VER" >"$CONSTRAINTS"
else
  printf 'torch==<the installed NVIDIA wheel>\nnumpy<2\n' >"$CONSTRAINTS"
fi
say "constraints: $(tr '\n' ' ' <"$CONSTRAINTS")"
run "${PIP[@]}" install -c "$CONSTRAINTS" -e "$REPO_ROOT[jetson]"
rm -f "$CONSTRAINTS"

# ------------------------------------------------------------------ verify
say "== verify"
run "$PY" -c 'import torch; assert torch.cuda.is_available(), "CUDA not available to torch"; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))'
[[ $SKIP_TRITON -eq 1 ]] || run "$PY" -c 'import triton; print("triton", triton.__version__)'
run "$PY" -c 'from bitmtp_edge.jetson.posture import check_posture; p = check_posture(); print("posture:", p.power_mode_name, "clocks locked:", p.clocks_locked); [print("  -", w) for w in p.warnings]'
say "done. Next: export a model for this board (jetson/README.md, 'Memory on 8 GB boards'), then 'sudo jetson_clocks' before benchmarking."
