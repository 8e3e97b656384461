"""Small builders shared by the runtime tests: random ternary models without files."""

from __future__ import annotations

import pytest
import torch

from bitmtp_edge.backends.reference import ReferenceBackend
from bitmtp_edge.format.config import ModelConfig, QuantConfig
from bitmtp_edge.format.segments import plan_segments
from bitmtp_edge.runtime.model import TernaryLM

# Kernel tests run compiled on a GPU and under the Triton interpreter without one
# (tests/__init__.py switches it on before triton is first imported).
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module of tiny models: a second one only adds
    contention on a shared CI runner. Use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_prefill(engine, monkeypatch):
    """The module's ``engine``, failing the test if a generation reaches the prefill (for
    checks that must refuse an argument before any work)."""
    def prefill(ids):
        raise AssertionError("the prefill ran before the arguments were checked")
    monkeypatch.setattr(engine.backend, "prefill", prefill)
    return engine


def random_model(seed: int = 0, family: str = "bitnet", vocab: int = 96, hidden: int = 128, layers: int = 2,
                 quant: QuantConfig | None = None, dtype=torch.float64, tie: bool = False,
                 heads: tuple[int, int] = (4, 2), intermediate: int = 256) -> TernaryLM:
    cfg = ModelConfig(family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_layers=layers, num_heads=heads[0], num_kv_heads=heads[1], head_dim=hidden // heads[0],
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
                      smallest: int | None = None, dtype=torch.float64, calibration=None) -> ReferenceBackend:
    plan = plan_segments(model.cfg, max_context, workspace=2 * block_size + 1)
    if smallest is not None:  # force small segments to exercise growth
        from bitmtp_edge.format.segments import CapacitySegment, KVPlan

        caps, c = [], smallest
        while c < max_context:
            caps.append(c)
            c *= 2
        caps.append(max_context)
        segs = tuple(CapacitySegment(cap, plan.workspace, (cap + plan.workspace) * plan.bytes_per_slot) for cap in caps)
        plan = KVPlan(plan.dtype, plan.bytes_per_slot, plan.workspace, max_context, None, segs)
    return ReferenceBackend(model, plan, mask_token_id=model.cfg.vocab_size - 1, dtype=dtype, device="cpu",
                            calibration=calibration)


def artifact_tensors(model: TernaryLM) -> dict[str, torch.Tensor]:
    """The tensors an exported artifact of ``model`` holds (packed codes, float32 scales)."""
    from kernels_ampere.packing import pack_ternary

    out = {}
    for name, t in model.state_dict().items():
        if name.endswith(".codes"):
            out[name[: -len(".codes")] + ".packed"] = pack_ternary(t)
        else:
            out[name] = t.float() if name.endswith(".scale") else t.to(torch.float32)
    if model.draft_head_int8 is not None:
        out["draft_head.int8"], out["draft_head.scale"] = model.draft_head_int8, model.draft_head_scale
    return out


def manifest_for(model: TernaryLM, block_size: int, plan, calibration=None):
    from bitmtp_edge.format.manifest import Manifest
    from bitmtp_edge.format.roles import step_widths
    from bitmtp_edge.format.config import MTPConfig

    mtp = MTPConfig(block_size=block_size, mask_token_id=model.cfg.vocab_size - 1, confidence_calibration=calibration)
    return Manifest(model=model.cfg, quant=model.quant, kv=plan, mtp=mtp, widths=step_widths(block_size))


def fast_backend(model: TernaryLM, block_size: int = 4, max_context: int = 512, smallest: int | None = None,
                 options=None, kernels: bool = False, head_dtype=torch.float32, calibration=None,
                 verify_head: str = "16bit", device: str = "cpu", draft_head: str = "int8"):
    """The graph backend's static-buffer path, eager, float32, on ``device``: the torch twins,
    or with ``kernels`` the Triton kernels themselves (interpreted on the CPU without a GPU,
    compiled on ``DEVICE`` with one: pass ``device=DEVICE``)."""
    from bitmtp_edge.backends.fast_model import FastModel
    from bitmtp_edge.backends.graph import GraphBackend, RuntimeOptions
    from bitmtp_edge.backends.ops import kernel_ops, twin_ops

    plan = reference_backend(model, max_context=max_context, block_size=block_size, smallest=smallest).plan
    manifest = manifest_for(model, block_size, plan)
    options = options or RuntimeOptions(graphs=False, kv_dtype=torch.float32)
    ops = kernel_ops if kernels else twin_ops
    fast = FastModel(manifest, artifact_tensors(model), ops(options.specialize),
                     device, head_dtype=head_dtype, verify_head=verify_head, draft_head=draft_head)
    return GraphBackend(fast, plan, model.cfg.vocab_size - 1, block_size, options, calibration=calibration)


def write_test_artifact(model: TernaryLM, out, block_size: int = 4, max_context: int = 512, smallest: int | None = None,
                        calibration=None):
    """An artifact folder for ``model`` with a word-level tokenizer ("t0 t1 ..."); ``calibration``:
    the manifest's per-slot confidence pairs (``MTPConfig.confidence_calibration``)."""
    import tempfile
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    from bitmtp_edge.format.manifest import write_artifact

    vocab = {f"t{i}": i for i in range(model.cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tmp = Path(tempfile.mkdtemp())
    tok.save(str(tmp / "tokenizer.json"))
    plan = reference_backend(model, max_context=max_context, block_size=block_size, smallest=smallest).plan
    manifest = manifest_for(model, block_size, plan, calibration)
    return write_artifact(out, manifest, artifact_tensors(model), {"tokenizer.json": tmp / "tokenizer.json"})
