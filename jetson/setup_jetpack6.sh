#!/usr/bin/env bash
# Set up BitMTP Edge on a Jetson running JetPack 6 (L4T R36.x, Ubuntu 22.04, Python 3.10).
#
#   jetson/setup_jetpack6.sh [--dry-run] [--venv DIR] [--python PATH] [--torch-wheel URL]
#                            [--skip-torch] [--triton-version V] [--triton-index URL]
#                            [--skip-triton] [--skip-verify] [--min-free-gb N]
#
# The layout jetson/README.md, bitmtp.service and the Dockerfile share:
#   /opt/bitmtp/src        this repository (installed editable from here)
#   /opt/bitmtp/venv       the virtualenv: jetson/setup_jetpack6.sh --venv /opt/bitmtp/venv
#   /opt/bitmtp/artifacts  exported models
# Without --venv it installs into the active virtualenv, or else with pip --user.
#
# Phase 1 only reads (board, JetPack, Python, disk, CUDA, cuSPARSELt, power posture) and stops
# on the first hard problem. Phase 2 installs:
#   1. cuSPARSELt into /usr/local/cuda (sudo), if missing: NVIDIA's torch >= 2.4 wheels link it;
#   2. NVIDIA's PyTorch wheel for JetPack 6 (PyPI has no CUDA wheels for Jetson's iGPU).
#      Index: https://developer.download.nvidia.com/compute/redist/jp/ (v60 = JP 6.0, v61 = JP 6.1/6.2).
#      Names: torch-<ver>a0+<git sha>.nv<YY.MM>.<build>-cp310-cp310-linux_aarch64.whl, e.g.
#      torch-2.5.0a0+872d972e41.nv24.08.17622132-cp310-cp310-linux_aarch64.whl (NGC 24.08, CUDA 12.6);
#      built against NumPy 1.x, hence numpy<2;
#   3. Triton, pinned (default 3.6.0: the version the kernels were validated on, on an H200),
#      from the Jetson AI Lab index (https://pypi.jetson-ai-lab.io/jp6/cu126): NVIDIA publishes
#      no Triton wheel for Jetson. Whether that index has this version for JetPack 6, and how it
#      runs on sm_87, is not verified: pass --triton-version for the one it has (pip lists them
#      when the pin is missing). Without Triton the reference backend still runs, only slower;
#   4. this package: pip install -e .[jetson], with torch pinned to the wheel just installed so
#      pip cannot replace it with a CPU-only PyPI build.
# It never changes the power mode or clocks; it prints the commands instead.
#
# BITMTP_BOARD_ROOT (default: /) is where the read-only probes look for /etc/nv_tegra_release,
# /proc/device-tree/model and /usr/local/cuda: the tests point it at a recorded board tree.
set -euo pipefail

DRY_RUN=0
VENV=""
PY=python3
TORCH_WHEEL=""
SKIP_TORCH=0
TRITON_VERSION="3.6.0"
TRITON_INDEX="https://pypi.jetson-ai-lab.io/jp6/cu126"
SKIP_TRITON=0
SKIP_VERIFY=0
MIN_FREE_GB=8
CUSPARSELT=libcusparse_lt-linux-aarch64-0.7.1.0-archive
CUSPARSELT_URL="https://developer.download.nvidia.com/compute/cusparselt/redist/libcusparse_lt/linux-aarch64/$CUSPARSELT.tar.xz"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="${BITMTP_BOARD_ROOT:-}"
ROOT="${ROOT%/}"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die()  { printf 'error: %s\n' "$*" >&2; exit 1; }
bad_usage() { printf 'error: %s (see --help)\n' "$*" >&2; exit 2; }
value_of() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || bad_usage "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --venv) value_of "$@"; VENV="$2"; shift ;;
    --python) value_of "$@"; PY="$2"; shift ;;
    --torch-wheel) value_of "$@"; TORCH_WHEEL="$2"; shift ;;
    --skip-torch) SKIP_TORCH=1 ;;
    --triton-version) value_of "$@"; TRITON_VERSION="$2"; shift ;;
    --triton-index) value_of "$@"; TRITON_INDEX="$2"; shift ;;
    --skip-triton) SKIP_TRITON=1 ;;
    --skip-verify) SKIP_VERIFY=1 ;;
    --min-free-gb) value_of "$@"; MIN_FREE_GB="$2"; shift
                   [[ "$MIN_FREE_GB" =~ ^[0-9]+$ ]] || bad_usage "--min-free-gb takes a whole number of GB, got '$MIN_FREE_GB'" ;;
    -h|--help) usage; exit 0 ;;
    *) bad_usage "unknown option '$1'" ;;
  esac
  shift
done
[[ -z "$VENV" || "$VENV" == /* ]] || VENV="$PWD/$VENV"  # the venv's python is called by path

say()  { printf '%s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }
run()  { printf '+ %s\n' "$*"; if [[ $DRY_RUN -eq 0 ]]; then "$@"; fi; }
SUDO=(sudo); [[ $EUID -eq 0 ]] && SUDO=()  # root (e.g. a container build) needs no sudo

# The nearest folder of PATH that exists: df and the free-space check run on it, because the
# venv's parents (~/.venvs, /opt/bitmtp) may not exist until phase 2 creates them.
existing_ancestor() {
  local p="$1"
  while [[ ! -d "$p" ]]; do p=$(dirname "$p"); done
  printf '%s\n' "$p"
}

# ------------------------------------------------------------------ phase 1: checks (read-only)
say "== checks (nothing is changed in this phase)"

[[ "$(uname -m)" == "aarch64" ]] || die "this is $(uname -m), not a Jetson (aarch64). On a PC or server use: pip install -e '.[dev]'"

REL="$ROOT/etc/nv_tegra_release"
[[ -r $REL ]] || die "$REL not found: not a Jetson, or a container without it (mount it: -v /etc/nv_tegra_release:/etc/nv_tegra_release:ro)"
L4T_MAJOR=$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1/p' "$REL" | head -n1)
L4T_REV=$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\2/p' "$REL" | head -n1)
[[ -n "$L4T_MAJOR" ]] || die "could not read the L4T version from the first line of $REL"
L4T="$L4T_MAJOR.$L4T_REV"
[[ "$L4T_MAJOR" == "36" ]] || die "L4T R$L4T is not JetPack 6 (R36.x). JetPack 5 is R35, JetPack 7 is R38/R39: this script only knows JetPack 6's wheels"
say "L4T R$L4T (JetPack 6)"
MODEL=$( { tr -d '\0' <"$ROOT/proc/device-tree/model"; } 2>/dev/null || echo unknown)
say "board: $MODEL"

command -v "$PY" >/dev/null || die "$PY not found: sudo apt install python3 python3-venv python3-pip"
PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$PYV" == "3.10" ]] || die "$PY is Python $PYV; NVIDIA's JetPack 6 wheels are cp310 (Ubuntu 22.04's python3.10): pass --python /usr/bin/python3.10"
say "python $PYV ($PY)"

TARGET_DIR="${VENV:-$HOME}"
DF_DIR=$(existing_ancestor "$TARGET_DIR")
FREE_KB=$(df -Pk "$DF_DIR" | awk 'NR==2 {print $4}')
FREE_GB=$((FREE_KB / 1024 / 1024))
(( FREE_GB >= MIN_FREE_GB )) || die "only ${FREE_GB} GB free under $DF_DIR; need ${MIN_FREE_GB} GB (torch, triton, pip cache). Free space or pass --min-free-gb"
say "disk: ${FREE_GB} GB free under $DF_DIR"

CUDA="$ROOT/usr/local/cuda"
if [[ -x "$CUDA/bin/nvcc" ]]; then
  say "CUDA: $("$CUDA/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
else
  warn "no $CUDA/bin/nvcc: install the JetPack components first (sudo apt install nvidia-jetpack); Triton needs the CUDA toolkit"
fi

NEED_CUSPARSELT=0
if [[ -z "$ROOT" ]] && ldconfig -p 2>/dev/null | grep -q libcusparseLt.so; then
  say "cuSPARSELt: present"
elif ls "$CUDA"/lib64/libcusparseLt.so* >/dev/null 2>&1; then
  say "cuSPARSELt: present"
else
  NEED_CUSPARSELT=1
  say "cuSPARSELt: missing (will be installed into /usr/local/cuda)"
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
  if [[ ! -x "$VENV/bin/python" ]]; then
    run mkdir -p "$(dirname "$VENV")"
    # --system-site-packages: JetPack's TensorRT/cuDNN Python bindings live in the system site.
    run "$PY" -m venv --system-site-packages "$VENV"
  fi
  PY="$VENV/bin/python"
fi
# pip's options follow the subcommand: `pip install --user ...` (not `pip --user install`).
PIP_INSTALL=("$PY" -m pip install)
if [[ -z "$VENV" && -z "${VIRTUAL_ENV:-}" ]]; then
  PIP_INSTALL+=(--user)
  warn "no --venv and no active virtualenv: installing with pip install --user (commands land in ~/.local/bin)"
fi

if [[ $NEED_CUSPARSELT -eq 1 && $SKIP_TORCH -eq 0 ]]; then
  if [[ $DRY_RUN -eq 1 ]]; then TMP=/tmp/cusparselt.XXXX; else TMP=$(mktemp -d); fi
  run curl -fsSL -o "$TMP/cusparselt.tar.xz" "$CUSPARSELT_URL"
  run tar -xJf "$TMP/cusparselt.tar.xz" -C "$TMP"
  run "${SUDO[@]}" cp -a "$TMP/$CUSPARSELT/include/." /usr/local/cuda/include/
  run "${SUDO[@]}" cp -a "$TMP/$CUSPARSELT/lib/." /usr/local/cuda/lib64/
  run "${SUDO[@]}" ldconfig
  run rm -rf "$TMP"
fi

run "${PIP_INSTALL[@]}" --upgrade pip
if [[ $SKIP_TORCH -eq 0 ]]; then
  run "${PIP_INSTALL[@]}" "numpy>=1.24,<2" "$TORCH_WHEEL"
fi
if [[ $SKIP_TRITON -eq 0 ]]; then
  # --no-deps: take only Triton from this index, nothing that could replace torch.
  run "${PIP_INSTALL[@]}" --no-deps --index-url "$TRITON_INDEX" "triton==$TRITON_VERSION"
fi

CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
if [[ $DRY_RUN -eq 0 ]]; then
  TORCH_VER=$("$PY" -c 'import torch; print(torch.__version__)') \
    || die "torch does not import; install NVIDIA's wheel first (drop --skip-torch) or pass --torch-wheel URL"
  printf 'torch==%s\nnumpy<2\n' "$TORCH_VER" >"$CONSTRAINTS"
else
  printf 'torch==<the installed NVIDIA wheel>\nnumpy<2\n' >"$CONSTRAINTS"
fi
say "constraints: $(tr '\n' ' ' <"$CONSTRAINTS")"
run "${PIP_INSTALL[@]}" -c "$CONSTRAINTS" -e "$REPO_ROOT[jetson]"

# ------------------------------------------------------------------ verify
if [[ $SKIP_VERIFY -eq 0 ]]; then
  say "== verify"
  run "$PY" -c 'import torch; assert torch.cuda.is_available(), "CUDA not available to torch"; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))'
  [[ $SKIP_TRITON -eq 1 ]] || run "$PY" -c 'import triton; print("triton", triton.__version__)'
  run "$PY" -c 'from bitmtp_edge.jetson.posture import check_posture; p = check_posture(); print("posture:", p.power_mode_name, "clocks locked:", p.clocks_locked); [print("  -", w) for w in p.warnings]'
fi
say "done. Next: export a model for this board (jetson/README.md, 'Memory on 8 GB boards'), then 'sudo jetson_clocks' before benchmarking."
