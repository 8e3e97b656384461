"""From the artifact's tensors to the reference runtime's ``TernaryLM`` (unpacking the codes).

The format package says what the file holds; this module turns it into the runtime layout
(int8 codes, float32 scales, the model's dtype), the second of the two loading phases.
"""

from __future__ import annotations

import torch

from kernels_ampere.packing import PACKING_LAYOUT, unpack_ternary

from ..format.manifest import WEIGHTS, ArtifactError, Manifest
from ..format.tensors import DRAFT_HEAD_INT8, DRAFT_HEAD_SCALE, DRAFT_HEAD_WEIGHT, PACKED_SUFFIX
from .model import TernaryLM


def build_model(manifest: Manifest, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str) -> TernaryLM:
    """Instantiate the runtime ``TernaryLM`` from the artifact's tensors (unpacking the codes)."""
    if manifest.packing_layout != PACKING_LAYOUT:
        raise ArtifactError(
            f"packing layout {manifest.packing_layout!r} is not supported by this runtime ({PACKING_LAYOUT}); "
            "re-export the artifact with this version"
        )
    # Cast before loading: load_state_dict copies into the parameters' existing dtype.
    model = TernaryLM(manifest.model, manifest.quant).to(dtype)
    state = {}
    expected = model.state_dict()
    for name, ref in expected.items():
        if name.endswith(".codes"):
            base = name[: -len(".codes")]
            packed = artifact_tensor(tensors, base + PACKED_SUFFIX)
            try:  # K padded to whole 128-chunks in the file: checked to be zero weights and cut off
                codes = unpack_ternary(packed, ref.shape[1])
            except ValueError as e:
                raise ArtifactError(f"{WEIGHTS}: {base}{PACKED_SUFFIX}: {e}") from None
            if codes.shape != ref.shape:
                raise ArtifactError(f"{WEIGHTS}: {base}{PACKED_SUFFIX} unpacks to {tuple(codes.shape)}, "
                                    f"expected {tuple(ref.shape)}")
            state[name] = codes
        else:
            t = artifact_tensor(tensors, name)
            if t.shape != ref.shape:
                raise ArtifactError(f"{WEIGHTS}: {name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
            state[name] = t.float() if name.endswith(".scale") else t.to(dtype)
    model.load_state_dict(state)
    if manifest.draft_head == DRAFT_HEAD_INT8:
        model.attach_draft_head(artifact_tensor(tensors, DRAFT_HEAD_WEIGHT), artifact_tensor(tensors, DRAFT_HEAD_SCALE))
    return model.to(device).eval()


def artifact_tensor(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ArtifactError(f"{WEIGHTS}: tensor {name!r} is missing; the artifact is incomplete, re-export it")
    return tensors[name]
