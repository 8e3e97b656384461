"""BitMTP Edge: multi-token decoding for ternary LLMs on Jetson and server GPUs.

The public names load lazily, so ``import bitmtp_edge.posture`` (or the CLI's ``doctor``)
does not pay for torch until something needs it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Engine": "engine", "GenerationResult": "engine",
    "ArtifactError": "artifact", "Manifest": "artifact",
    "ModelConfig": "config", "MTPConfig": "config", "QuantConfig": "config",
    "POLICIES": "decoding", "DecodeStats": "decoding", "DecodingError": "decoding",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bitmtp_edge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
