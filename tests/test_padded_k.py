"""Projections whose K is not a multiple of 128 (1bitLLM bitnet_b1_58-3B: FFN 8640, -xl: 5460).

The packed layout pads K to whole 128-chunks with zero weights. Here a model with an FFN of
200 inputs runs through the fast backend (twins, and the Triton kernels interpreted on the
CPU) and must give the reference runtime's tokens; the artifact path (export, reference,
ONNX) is covered by the ``*-k200`` kinds of test_export_parity.py and test_onnx.py.
"""

import pytest
import torch

from kernels_ampere.packing import pack_ternary, packed_width, unpack_ternary
from tests.helpers import artifact_tensors, random_model
from tests.test_graph_backend import PROMPT, both
from tests.test_decoding import run

FFN = 200  # 1.5625 chunks: the down projection's packed rows end in 56 zero-weight inputs


def test_artifact_tensors_store_padded_rows_that_unpack_to_the_codes():
    model = random_model(0, intermediate=FFN)
    tensors = artifact_tensors(model)
    down = tensors["model.layers.0.mlp.down_proj.packed"]
    assert down.shape == (model.cfg.hidden_size, packed_width(FFN)) and packed_width(FFN) * 4 == 256
    codes = model.state_dict()["model.layers.0.mlp.down_proj.codes"]
    assert torch.equal(unpack_ternary(down, FFN), codes)
    assert not unpack_ternary(down)[:, FFN:].any()


def test_unpack_refuses_nonzero_padding_and_a_width_that_does_not_fit():
    packed = pack_ternary(torch.ones(3, 200, dtype=torch.int8))
    with pytest.raises(ValueError, match="does not hold K=300"):
        unpack_ternary(packed, 300)
    bad = packed.clone()
    bad[:, -1] = 0b10101010  # +1 weights in the padding
    with pytest.raises(ValueError, match="padding beyond K=200"):
        unpack_ternary(bad, 200)


@pytest.mark.parametrize("policy", ["ar", "speculative"])
def test_fast_backend_matches_reference_with_a_padded_ffn(policy):
    ref, out, _, _ = both(random_model(11, intermediate=FFN), policy, n=24)
    assert out == ref


def test_triton_kernels_choose_the_twins_tokens_with_a_padded_ffn():
    from tests.helpers import DEVICE, fast_backend

    pytest.importorskip("triton")  # interpreted without CUDA (tests/__init__.py)
    model = random_model(12, layers=1, intermediate=FFN)
    outs = [run(fast_backend(model, max_context=64, smallest=16, kernels=k, head_dtype=torch.float16,
                             device=DEVICE if k else "cpu"),
                PROMPT, "speculative", n=8, block_size=4)[0] for k in (False, True)]
    assert outs[0] == outs[1]
