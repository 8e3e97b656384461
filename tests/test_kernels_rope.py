"""rope_qkv_to_cache (QK-norm + RoPE + K/V stores in one launch) against its twin.

Without QK-norm the kernel does the twin's float32 operations in the twin's order (no FMA
contraction), so Q and the stored K/V must be bit-identical. With QK-norm the mean of
squares is summed in a different order: within a few float32 ulps before the cast.
Slots the step does not write must keep their old contents.
"""

import pytest
import torch

pytest.importorskip("triton")  # the interpreter is set up by tests/__init__.py without CUDA

from kernels_ampere.numerics import rope_cos_sin  # noqa: E402
from kernels_ampere.rope_cache import rope_qkv_to_cache, rope_qkv_to_cache_reference  # noqa: E402
from tests.helpers import DEVICE  # noqa: E402


def inputs(m, hq, hkv, hd, slots, kv_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(m, (hq + 2 * hkv) * hd, generator=gen) * 2).to(DEVICE)
    positions = torch.randperm(slots - 3, generator=gen)[:m].to(DEVICE) + 3
    cos, sin = rope_cos_sin(positions.unsqueeze(0), hd, 10000.0, torch.float32)
    k_buf = torch.randn(hkv, slots, hd, generator=gen).to(DEVICE, kv_dtype)
    v_buf = torch.randn(hkv, slots, hd, generator=gen).to(DEVICE, kv_dtype)
    norms = (1 + 0.3 * torch.randn(hd, generator=gen)).to(DEVICE), (1 + 0.3 * torch.randn(hd, generator=gen)).to(DEVICE)
    return qkv, cos[0], sin[0], k_buf, v_buf, positions, norms


@pytest.mark.parametrize("m,hq,hkv,hd", [(1, 4, 2, 32), (9, 6, 2, 64), (17, 4, 1, 16)])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_cache_matches_twin(m, hq, hkv, hd, kv_dtype, qk_norm):
    qkv, cos, sin, k_buf, v_buf, slots, (qn, kn) = inputs(m, hq, hkv, hd, 40, kv_dtype, seed=m * hd + qk_norm)
    norm = dict(q_norm=qn, k_norm=kn, eps=1e-6) if qk_norm else {}
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    q_ref = rope_qkv_to_cache_reference(qkv, cos, sin, k_ref, v_ref, slots, num_heads=hq, **norm)
    q = rope_qkv_to_cache(qkv, cos, sin, k_buf, v_buf, slots, num_heads=hq, **norm)
    assert q.shape == (m, hq, hd) and q.dtype == kv_dtype
    assert torch.equal(v_buf, v_ref)  # V is a plain cast
    untouched = torch.ones(k_buf.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_buf[:, untouched], k_ref[:, untouched])
    if qk_norm:
        tol = 2e-3 if kv_dtype == torch.float16 else 1.6e-2
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(k_buf.float(), k_ref.float(), rtol=tol, atol=tol)
    else:
        assert torch.equal(q, q_ref)
        assert torch.equal(k_buf, k_ref)


def test_rope_cache_rejects_mismatched_shapes():
    qkv, cos, sin, k_buf, v_buf, slots, (qn, _) = inputs(3, 4, 2, 32, 16, torch.float16, seed=1)
    with pytest.raises(ValueError, match="qkv width"):
        rope_qkv_to_cache(qkv[:, :-32], cos, sin, k_buf, v_buf, slots, num_heads=4)
    with pytest.raises(ValueError, match="write_slots"):
        rope_qkv_to_cache(qkv, cos, sin, k_buf, v_buf, slots.int(), num_heads=4)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        rope_qkv_to_cache(qkv, cos, sin, k_buf, v_buf, slots, num_heads=4, q_norm=qn)


def _rope_cos_sin_per_call(positions, hd, theta):
    """The formula before the inverse frequencies were kept: computed from scratch, one half
    at a time, then concatenated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=positions.device).float() / hd))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64])
@pytest.mark.parametrize("hd,theta", [(64, 10000.0), (128, 500000.0)])
def test_kept_inverse_frequencies_give_the_same_bits(dtype, hd, theta):
    """A runtime keeps ``rope_inv_freq`` and multiplies the positions in (integer positions
    cast inside the product): cos and sin must be the per-call formula's, bit for bit."""
    from kernels_ampere.numerics import rope_inv_freq

    gen = torch.Generator().manual_seed(hd)
    positions = torch.randint(0, 200_000, (17,), generator=gen).to(DEVICE, dtype)
    kept = rope_inv_freq(hd, theta, positions.device)
    want_cos, want_sin = _rope_cos_sin_per_call(positions, hd, theta)
    for inv_freq in (kept, None):
        cos, sin = rope_cos_sin(positions, hd, theta, torch.float32, inv_freq)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
