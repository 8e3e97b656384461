"""``bitmtp doctor``: what this machine can run, in plain sentences.

Every probe is guarded: a broken torch install (the usual Jetson failure: a wheel for
another JetPack, a missing libcusparseLt) is *reported*, never a crash, so nothing here
imports torch, Triton or NVML at module import time.

Each check is a :class:`Check` (name, status, one-line summary, JSON-ready details);
statuses: ``ok``, ``info`` (a fact, e.g. "not a Jetson"), ``warn`` (works, but numbers or
speed will suffer) and ``fail`` (something asked for cannot run).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("ok", "info", "warn", "fail")
JTOP_SOCKET = "/run/jtop.sock"


@dataclass
class Check:
    name: str
    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "summary": self.summary, "details": self.details}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python() -> Check:
    return Check("python", "ok", f"Python {platform.python_version()} ({sys.executable}) on {platform.platform()}",
                 {"version": platform.python_version(), "executable": sys.executable,
                  "platform": platform.platform(), "machine": platform.machine()})


def check_torch() -> tuple[Check, Any]:
    """(the check, the torch module or None)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - an ImportError or a missing shared library: both are the finding
        return Check("torch", "fail", f"torch cannot be imported ({type(e).__name__}: {e}); on a Jetson install "
                     "NVIDIA's wheel for your JetPack (jetson/README.md)", {"error": str(e)}), None
    cuda = torch.version.cuda
    build = f"CUDA {cuda} build" if cuda else "CPU-only build"
    return Check("torch", "ok", f"torch {torch.__version__} ({build})",
                 {"version": torch.__version__, "cuda_build": cuda}), torch


def check_triton(torch) -> Check:
    version = _version("triton") or _version("pytorch-triton")
    if version is None:
        need = "the ampere/server backends need it (pip install 'bitmtp-edge[triton]')"
        return Check("triton", "info" if torch is None or not torch.cuda.is_available() else "warn",
                     f"Triton not installed: {need}", {"version": None})
    return Check("triton", "ok", f"Triton {version}", {"version": version})


def check_gpu(torch) -> Check:
    if torch is None:
        return Check("gpu", "fail", "unknown: torch is not importable", {"available": False, "devices": []})
    try:
        available = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001
        return Check("gpu", "fail", f"torch.cuda failed: {e}", {"available": False, "devices": [], "error": str(e)})
    if not available:
        why = ("this torch is a CPU-only build" if not torch.version.cuda
               else "torch has CUDA but sees no device (driver missing, or CUDA_VISIBLE_DEVICES hides it)")
        return Check("gpu", "info", f"no GPU: {why}; only the reference backend runs, on the CPU",
                     {"available": False, "devices": []})
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                        "memory_mb": round(p.total_memory / 2**20)})
    listed = "; ".join(f"cuda:{d['index']} {d['name']} (sm_{d['capability'].replace('.', '')}, "
                       f"{d['memory_mb'] / 1024:.0f} GiB)" for d in devices)
    old = [d for d in devices if float(d["capability"]) < 8.0]
    status = "warn" if old and len(old) == len(devices) else "ok"
    note = "; below sm_80: the fast backends need Ampere or newer" if status == "warn" else ""
    return Check("gpu", status, listed + note, {"available": True, "devices": devices})


def check_backend(torch) -> Check:
    if torch is None:
        return Check("backend", "fail", "no backend can run without torch", {"auto": None})
    from ..runtime.engine import choose_backend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = choose_backend("auto", device)
    except Exception as e:  # noqa: BLE001 - e.g. Triton present but broken
        return Check("backend", "warn", f"auto cannot decide on {device}: {e}", {"auto": None, "device": str(device)})
    why = {"reference": "PyTorch oracle (no CUDA GPU of sm_80+ with working Triton kernels here)",
           "ampere": "Triton W2A8 kernels + CUDA graphs, no FP8",
           "server": "ampere + FP8 draft head (sm_89/sm_90+)"}[chosen]
    details = {"auto": chosen, "device": str(device)}
    if chosen == "reference" and device.type == "cpu":
        from ..runtime.engine import cpu_threads_rule

        try:
            threads, rule = cpu_threads_rule()
        except ValueError as e:  # BITMTP_CPU_THREADS=abc: every command would stop on it; say so here
            return Check("backend", "fail", f"auto → {chosen} on {device}, but {e}", {**details, "cpu_threads": None})
        details["cpu_threads"] = threads if threads is not None else torch.get_num_threads()
        why += f"; {details['cpu_threads']} torch thread(s): {rule}"
    if chosen != "reference":  # kernel launches overlap their predecessors on sm_90+
        from kernels_ampere.common import pdl_status, prefetch_next
        from kernels_ampere.w2a8 import NEXT_WEIGHTS_MIN_M

        details["programmatic_launch"] = pdl_status()[1]
        details["next_weights_l2"] = (f"on (from M = {NEXT_WEIGHTS_MIN_M})" if prefetch_next()
                                      else "off (BITMTP_PREFETCH_NEXT=0)")
        why += (f"; programmatic dependent launch {details['programmatic_launch']}"
                f"; next launch's weights asked of the L2 {details['next_weights_l2']}")
    return Check("backend", "ok", f"auto → {chosen} on {device}: {why}", details)


def kernel_table_check(device_name: str, sms: int) -> Check:
    """Which W2A8 launches a GPU gets: its tuned table, else the SM-count defaults (say which
    kernel its AR step runs, and how to get a table)."""
    from kernels_ampere import tuning

    entries = tuning.load_table(device_name)
    table = f"kernels_ampere/tuned/{tuning.gpu_table_name(device_name)}.json"
    details = {"device": device_name, "sms": sms, "table": table if entries else None, "entries": len(entries),
               "default_generation": tuning.W2A8_DEFAULT_GENERATION}
    if entries:
        return Check("kernels", "ok", f"tuned launch table for {device_name} ({len(entries)} entries, {table})", details)
    ar = tuning.default_linear(1, False, n=2560, k=2560, sms=sms).kernel
    details["ar_step_kernel"] = ar
    return Check("kernels", "info", f"no tuned launch table for {device_name}: the SM-count defaults for {sms} SMs "
                 f"(generation {tuning.W2A8_DEFAULT_GENERATION}; an AR step's ternary linears on {ar}); "
                 "`bitmtp tune` writes a table for this GPU in minutes", details)


def check_kernels(torch, backend: Check) -> Check:
    if backend.details.get("auto") in (None, "reference"):
        return Check("kernels", "info", "no Triton kernels run here (reference backend)", {"table": None})
    try:
        from kernels_ampere.tuning import sm_count

        device = torch.device("cuda")  # the SM count the launchers size for (BITMTP_SM_COUNT, else the GPU's)
        return kernel_table_check(torch.cuda.get_device_name(device), sm_count(device))
    except Exception as e:  # noqa: BLE001 - a broken driver or kernels package is the finding
        return Check("kernels", "warn", f"cannot read the launch table: {type(e).__name__}: {e}", {"table": None})


def check_board(root: str | os.PathLike = "/") -> Check:
    from ..jetson.board import detect_board

    b = detect_board(root)
    if not b.on_jetson:
        return Check("board", "info", "not a Jetson (no /etc/nv_tegra_release, no nvidia,tegra* device tree)",
                     b.to_dict())
    what = b.module or b.model or "unknown Jetson module"
    preset = f"; export preset --board {b.export_board}" if b.export_board else ""
    return Check("board", "ok", f"{what}, L4T {b.l4t or '?'} (JetPack {b.jetpack or '?'}){preset}", b.to_dict())


def check_power_posture(root: str | os.PathLike = "/") -> Check:
    from ..jetson.posture import read_posture

    p = read_posture(root)
    if not p.on_jetson:
        return Check("posture", "info", "off a Jetson: no power mode or clock lock to check", p.to_dict())
    mode = p.power_mode_name or (f"id {p.power_mode_id}" if p.power_mode_id is not None else "unknown mode")
    locked = {True: "clocks locked", False: "clocks not locked", None: "clock lock unknown"}[p.clocks_locked]
    if p.ready:
        return Check("posture", "ok", f"{mode}, {locked}: benchmark-ready", p.to_dict())
    return Check("posture", "warn", f"{mode}, {locked}: " + "; ".join(p.warnings), p.to_dict())


def check_monitors(root: str | os.PathLike = "/") -> Check:
    """Which monitoring sources would open here, probing without starting any process."""
    from ..jetson.board import detect_board

    on_jetson = detect_board(root).on_jetson
    found: dict[str, dict] = {}
    exe = shutil.which("tegrastats") or ("/usr/bin/tegrastats" if os.path.exists("/usr/bin/tegrastats") else None)
    found["tegrastats"] = {"available": exe is not None,
                           "detail": exe or "not found (ships with L4T on the host; missing in most containers)"}
    has_jtop = importlib.util.find_spec("jtop") is not None
    sock = os.path.exists(JTOP_SOCKET)
    found["jtop"] = {"available": has_jtop and sock, "detail": (
        f"jetson-stats installed, service socket {JTOP_SOCKET} present" if has_jtop and sock else
        "jetson-stats not installed" if not has_jtop else f"{JTOP_SOCKET} missing: jtop.service is not running")}
    found["nvml"] = _probe_nvml()
    found["psutil"] = {"available": True, "detail": "CPU and RAM only; power unknown"}
    order = ["tegrastats", "jtop"] if on_jetson else ["nvml"]
    auto = next((k for k in order if found[k]["available"]), "psutil")
    power = auto != "psutil"
    summary = f"auto → {auto}" + ("" if power else " (no power sensor reachable: energy per token will be unknown)")
    summary += "; " + ", ".join(f"{k} {'yes' if v['available'] else 'no'}" for k, v in found.items())
    return Check("monitors", "ok" if power else "info", summary, {"auto": auto, "sources": found})


def _probe_nvml() -> dict:
    try:
        import pynvml
    except ImportError:
        return {"available": False, "detail": "nvidia-ml-py not installed (pip install 'bitmtp-edge[server]')"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError subclasses, or a missing libnvidia-ml
        return {"available": False, "detail": f"NVML did not initialise ({e}): no NVIDIA driver here"}
    try:
        count = pynvml.nvmlDeviceGetCount()
        return {"available": count > 0, "detail": f"{count} GPU(s) visible to NVML"}
    except Exception as e:  # noqa: BLE001
        return {"available": False, "detail": f"NVML error: {e}"}
    finally:
        with contextlib.suppress(Exception):  # a failing shutdown changes nothing we report
            pynvml.nvmlShutdown()


def check_artifact(path: str | os.PathLike | None, explicit: bool) -> Check:
    """Manifest and every checksum. ``explicit``: the user named it (a failure is ``fail``);
    otherwise it is the embedded model, whose absence is only a warning."""
    try:
        from ..format.manifest import WEIGHTS, read_manifest, verify_files
        from ..format.validate import artifact_file, check_weights_header
        from ..runtime.engine import embedded_artifact_path
    except Exception as e:  # noqa: BLE001 - torch broken: reported by the torch check
        return Check("artifact", "fail", f"cannot check artifacts without torch ({e})", {"path": str(path)})
    folder = Path(path) if path is not None else embedded_artifact_path()
    details: dict[str, Any] = {"path": str(folder), "embedded": not explicit}
    try:
        manifest = read_manifest(folder)
        verify_files(folder, manifest)
        check_weights_header(manifest, artifact_file(folder, WEIGHTS))  # header only: no tensor loaded
    except Exception as e:  # noqa: BLE001 - ArtifactError carries the file and what to do
        details["error"] = str(e)
        if not explicit and not folder.exists():
            return Check("artifact", "warn", f"no embedded model at {folder}: pass --artifact OUT/ "
                         "(export one with bitmtp-export)", details)
        return Check("artifact", "fail" if explicit else "warn", str(e), details)
    m = manifest.model
    mtp = (f"MTP D={manifest.mtp.block_size}, τ={manifest.mtp.tau}, m={manifest.mtp.min_prefix}"
           if manifest.mtp else "AR-only")
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    details.update({"files": len(manifest.files), "bytes": size, "family": m.family, "layers": m.num_layers,
                    "hidden": m.hidden_size, "vocab": m.vocab_size,
                    "block_size": manifest.mtp.block_size if manifest.mtp else None,
                    "max_context": manifest.kv.max_context, "format_version": manifest.format_version})
    return Check("artifact", "ok", f"{folder}: {len(manifest.files)} files verified (sha256), {m.family} "
                 f"{m.num_layers} layers × {m.hidden_size}, {mtp}, {size / 2**20:.1f} MiB", details)


def run_doctor(artifact: str | os.PathLike | None = None, root: str | os.PathLike = "/") -> list[Check]:
    """Every check, in the order a user reads them."""
    checks = [check_python()]
    torch_check, torch = check_torch()
    backend = check_backend(torch)
    checks += [torch_check, check_triton(torch), check_gpu(torch), backend, check_kernels(torch, backend),
               check_board(root), check_power_posture(root), check_monitors(root),
               check_artifact(artifact, explicit=artifact is not None)]
    return checks


def verdict(checks: list[Check]) -> str:
    """One sentence a user can act on."""
    by = {c.name: c for c in checks}
    if any(c.status == "fail" for c in checks):
        bad = ", ".join(c.name for c in checks if c.status == "fail")
        return f"problems: {bad} (see above)"
    gpu = by["gpu"].details.get("available")
    jetson = by["board"].details.get("on_jetson")
    where = ("a Jetson" if jetson else "not a Jetson") + (" with a CUDA GPU" if gpu else ", no GPU")
    backend = by["backend"].details.get("auto")
    return f"{where}: `bitmtp` will run the {backend} backend" + (
        "; CPU numbers check the pipeline, they are not edge performance" if not gpu else "")
