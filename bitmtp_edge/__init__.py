"""BitMTP Edge: multi-token decoding for ternary LLMs on Jetson and server GPUs.

The subpackages, from the bottom up (each imports only those above it in this list):

* ``format``   the artifact contract: manifest, configs, KV capacity segments, tensor names,
  draft-head kinds, roles and their step widths;
* ``runtime``  the reference model, masks, decoding policies, replay state, the KV store and
  the ``Engine``; ``backends``: the reference and the CUDA-graph backends it drives;
* ``jetson``   boards, power posture and monitoring (tegrastats, jtop, NVML, psutil);
* ``app``      the ``bitmtp`` command line, chat, demo, serve, bench and doctor.

The public names load lazily, so ``import bitmtp_edge.jetson.posture`` (or the CLI's ``doctor``)
does not pay for torch until something needs it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Engine": "runtime.engine", "GenerationResult": "runtime.engine",
    "ArtifactError": "format.manifest", "Manifest": "format.manifest",
    "ModelConfig": "format.config", "MTPConfig": "format.config", "QuantConfig": "format.config",
    "POLICIES": "runtime.policies", "DecodeStats": "runtime.decoding", "DecodingError": "runtime.decoding",
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
