"""Calibrated draft confidences: what hybrid decoding's τ test reads (issue 14).

A draft's raw confidence is its row's max-softmax. Trained against a soft teacher (the KL
term of self-distillation), the block slots are *underconfident* for what hybrid decoding
needs: the chance that the verifier's greedy token equals the draft (measured on
training-split prompts by ``tools.calibrate``). An artifact may carry one (a_j, b_j) per slot
(``MTPConfig.confidence_calibration``); slot j's confidence c becomes

    c' = sigmoid(a_j · logit(c) + b_j)            (Platt scaling; a_j > 0: increasing in c)

fitted so that c' is the chance the verifier agrees with the draft and with every draft before
it in the block (what committing the prefix through slot j unverified bets on) or, fitted on
per-draft labels, with the draft alone. It is applied wherever a backend computes greedy
drafts' confidences (draft steps and the fused step's next drafts), on the confidences the
heads already return, so the drafts themselves (the argmax) are untouched on every backend.
Without a calibration nothing changes. A sampled draft's confidence is the smaller of
q_j(d_j) and the calibrated softmax at d_j (``sampling.sample_drafts``), so a sharpened q never
says more than a greedy draft's confidence would.
"""

from __future__ import annotations

import torch

from ..format.config import MTPConfig


class ConfidenceCalibration:
    """The per-slot map, its parameters on the device once (graph replays read them in place)."""

    def __init__(self, pairs, device):
        self.params = torch.tensor([list(p) for p in pairs], dtype=torch.float32, device=device)  # [D, 2]

    @classmethod
    def for_model(cls, mtp: MTPConfig | None, device) -> "ConfidenceCalibration | None":
        if mtp is None or mtp.confidence_calibration is None:
            return None
        return cls(mtp.confidence_calibration, device)

    def __call__(self, confidences: torch.Tensor, first_slot: int = 0) -> torch.Tensor:
        """confidences [..., M] of slots first_slot .. first_slot + M - 1 (the last dimension:
        a fused step's candidate blocks are rows) -> calibrated, same shape and dtype. NaN
        stays NaN (a non-finite row is still flagged); 0 and 1 stay 0 and 1."""
        return calibrate_confidences(confidences, self.params, first_slot)


def calibrate_confidences(confidences: torch.Tensor, params: torch.Tensor, first_slot: int = 0) -> torch.Tensor:
    m = confidences.shape[-1]
    if first_slot < 0 or first_slot + m > params.shape[0]:
        raise ValueError(f"confidences of slots {first_slot}..{first_slot + m - 1}, but the calibration "
                         f"has {params.shape[0]} slots")
    ab = params[first_slot:first_slot + m].to(confidences.dtype)
    return torch.sigmoid(torch.logit(confidences) * ab[:, 0] + ab[:, 1])
