"""Small builders shared by the runtime tests: random ternary models without files."""

from __future__ import annotations

import torch

from bitmtp_edge.backends.reference import ReferenceBackend
from bitmtp_edge.config import ModelConfig, QuantConfig
from bitmtp_edge.model import TernaryLM
from bitmtp_edge.segments import plan_segments


def random_model(seed: int = 0, family: str = "bitnet", vocab: int = 96, hidden: int = 128, layers: int = 2,
                 quant: QuantConfig | None = None, dtype=torch.float64, tie: bool = False) -> TernaryLM:
    cfg = ModelConfig(family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=256,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                      rope_theta=10000.0, eos_token_ids=(vocab - 2,), tie_word_embeddings=tie)
    quant = quant or QuantConfig()
    g = torch.Generator().manual_seed(seed)
    model = TernaryLM(cfg, quant)
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(".codes"):
            state[name] = torch.randint(-1, 2, t.shape, generator=g).to(torch.int8)
        elif name.endswith(".scale"):
            state[name] = (0.5 + torch.rand(t.shape, generator=g)) / (t.new_tensor(model.cfg.hidden_size).sqrt() if t.numel() else 1)
        elif "norm" in name:
            state[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            state[name] = torch.randn(t.shape, generator=g)
    model.load_state_dict(state)
    model.attach_draft_head()
    return model.to(dtype).eval()


def reference_backend(model: TernaryLM, max_context: int = 512, block_size: int = 4,
                      smallest: int | None = None, dtype=torch.float64) -> ReferenceBackend:
    plan = plan_segments(model.cfg, max_context, workspace=2 * block_size + 1)
    if smallest is not None:  # force small segments to exercise growth
        from bitmtp_edge.segments import CapacitySegment, KVPlan

        caps, c = [], smallest
        while c < max_context:
            caps.append(c)
            c *= 2
        caps.append(max_context)
        segs = tuple(CapacitySegment(cap, plan.workspace, (cap + plan.workspace) * plan.bytes_per_slot) for cap in caps)
        plan = KVPlan(plan.dtype, plan.bytes_per_slot, plan.workspace, max_context, None, segs)
    return ReferenceBackend(model, plan, mask_token_id=model.cfg.vocab_size - 1, dtype=dtype, device="cpu")
