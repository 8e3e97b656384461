"""Where a benchmark's numbers came from: the commit its report records."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """``$BITMTP_COMMIT`` when set (a tree copied to a device may carry a stale or no .git:
    the caller knows best), else ``git rev-parse --short HEAD``, else "unknown"."""
    if os.environ.get("BITMTP_COMMIT"):
        return os.environ["BITMTP_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"
