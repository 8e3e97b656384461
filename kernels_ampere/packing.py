"""The packed INT2 ternary layout shared by the exporter, the runtimes and the kernels.

Layout id ``PACKING_LAYOUT`` = ``"ternary-2bit-k128x4-v1"``.

A ternary weight matrix ``W`` of shape ``[N, K]`` (rows = output features, K = input
features) with values in {-1, 0, +1} is stored as a ``uint8`` tensor of shape
``[N, padded_k(K) // 4]``:

* every value is stored as the 2-bit **code** ``c = w + 1`` in {0, 1, 2}; code 3 never
  occurs (the unpacker rejects it);
* K is cut into **chunks of 128** consecutive inputs (``CHUNK_K``); chunk ``g`` of row ``n``
  occupies the 32 bytes ``packed[n, 32*g : 32*g + 32]``;
* inside a chunk, byte ``j`` (0..31) holds four values, one per **lane** ``i`` (0..3),
  in bits ``[2*i, 2*i + 1]`` (lane 0 in the least significant bits)::

      packed[n, 32*g + j] = sum_i  (W[n, 128*g + 32*i + j] + 1) << (2*i)

* when K is not a multiple of 128 (1bitLLM's bitnet_b1_58-3B has an FFN of 8640 inputs,
  -xl 5460), the last chunk is completed with **zero weights** (code 1) up to
  ``padded_k(K)``; the true K is the activations' width. This is exact: a zero weight adds
  nothing, and kernels read the missing activations as 0. The packed tensor does not record
  K, so ``unpack_ternary(packed, k)`` takes it and checks that the padding is all zeros.

Why this order: a 128-chunk is exactly one scale group of the group-128 (Bonsai)
scheme, so a kernel tile never straddles two groups; and shifting a whole byte tile by
``2*i`` and masking with 3 yields a contiguous 32-wide K slice (``32*i .. 32*i+31``) that
lines up with contiguous int8 activations, for ``tl.dot`` or for 4-byte ``dp4a`` words.

Example (one row, K = 128): ``W[0, 0] = -1, W[0, 32] = 0, W[0, 64] = +1, W[0, 96] = +1``
gives ``packed[0, 0] = 0b10_10_01_00 = 0xA4``.

This is *not* the Hugging Face BitNet layout (four row blocks along ``out_features``,
``[N/4, K]``); ``export`` converts that one with ``unpack_hf_bitnet``.
"""

from __future__ import annotations

import torch

PACKING_LAYOUT = "ternary-2bit-k128x4-v1"
CHUNK_K = 128
LANES = 4
BYTES_PER_CHUNK = CHUNK_K // LANES  # 32
CODE_OFFSET = 1  # stored code = w + 1


def padded_k(k: int) -> int:
    """K rounded up to whole 128-chunks: the number of inputs a packed row stores."""
    return -(-int(k) // CHUNK_K) * CHUNK_K


def packed_width(k: int) -> int:
    """Bytes per packed row for K inputs (``padded_k(K) / 4``)."""
    return padded_k(k) // LANES


def check_packable(shape: tuple[int, ...], name: str = "weight") -> None:
    if len(shape) != 2:
        raise ValueError(f"{name}: a ternary weight must be 2-D [N, K], got shape {tuple(shape)}")
    if shape[1] < 1:
        raise ValueError(f"{name}: in_features K={shape[1]}; a ternary weight needs at least one input")


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 in {-1, 0, 1} -> [N, padded_k(K) // 4] uint8 (layout ``PACKING_LAYOUT``)."""
    check_packable(tuple(codes.shape))
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"pack_ternary expects an integer tensor, got {codes.dtype}")
    if codes.numel() and (codes.min() < -1 or codes.max() > 1):
        raise ValueError("pack_ternary: values outside {-1, 0, 1}")
    n, k = codes.shape
    kp = padded_k(k)
    c = torch.full((n, kp), CODE_OFFSET, dtype=torch.int32, device=codes.device)  # padding: zero weights
    c[:, :k] = codes.to(torch.int32) + CODE_OFFSET
    c = c.view(n, kp // CHUNK_K, LANES, BYTES_PER_CHUNK)
    shifts = (2 * torch.arange(LANES, dtype=torch.int32, device=codes.device)).view(1, 1, LANES, 1)
    packed = (c << shifts).sum(dim=2)  # lanes occupy disjoint bits, so sum == bitwise or
    return packed.to(torch.uint8).reshape(n, kp // LANES).contiguous()


def unpack_ternary(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """[N, padded_k(K) // 4] uint8 -> [N, K] int8 in {-1, 0, 1}; the inverse of ``pack_ternary``.

    ``k`` (default: every stored input, ``4 * width``) is the true number of inputs; the
    padding beyond it must hold zero weights."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(f"unpack_ternary expects a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    n, kb = packed.shape
    if kb % BYTES_PER_CHUNK:
        raise ValueError(f"packed width {kb} is not a multiple of {BYTES_PER_CHUNK} bytes")
    if k is not None and packed_width(k) != kb:
        raise ValueError(f"packed width {kb} bytes does not hold K={k} inputs: layout {PACKING_LAYOUT} "
                         f"stores {packed_width(k)} bytes per row for it (whole 128-chunks)")
    p = packed.to(torch.int32).view(n, kb // BYTES_PER_CHUNK, 1, BYTES_PER_CHUNK)
    shifts = (2 * torch.arange(LANES, dtype=torch.int32, device=packed.device)).view(1, 1, LANES, 1)
    c = (p >> shifts) & 3
    if bool((c == 3).any()):
        raise ValueError("unpack_ternary: code 3 found; the tensor is not in layout " + PACKING_LAYOUT)
    codes = (c - CODE_OFFSET).to(torch.int8).reshape(n, kb * LANES)
    if k is None or k == kb * LANES:
        return codes
    if bool(codes[:, k:].any()):
        raise ValueError(f"unpack_ternary: the padding beyond K={k} holds nonzero weights; the tensor is not "
                         f"in layout {PACKING_LAYOUT}")
    return codes[:, :k].contiguous()


def unpack_hf_bitnet(packed: torch.Tensor) -> torch.Tensor:
    """Hugging Face BitNet packing ``[N/4, K]`` uint8 -> ``[N, K]`` int8 codes.

    transformers ``integrations/bitnet.py``: bits ``[2i, 2i+1]`` of ``packed[r, c]`` hold
    output row ``i * N/4 + r`` (four contiguous row blocks), stored as ``w + 1``.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(f"expected a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    p = packed.to(torch.int32)
    blocks = [((p >> (2 * i)) & 3) for i in range(LANES)]
    c = torch.cat(blocks, dim=0)
    if bool((c == 3).any()):
        raise ValueError("code 3 found in a Hugging Face packed BitNet weight")
    return (c - CODE_OFFSET).to(torch.int8)


def pack_hf_bitnet(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 ternary -> Hugging Face BitNet ``[N/4, K]`` uint8 (for writing checkpoints)."""
    n, k = codes.shape
    if n % LANES:
        raise ValueError(f"out_features {n} is not a multiple of 4")
    c = (codes.to(torch.int32) + CODE_OFFSET).view(LANES, n // LANES, k)
    out = torch.zeros(n // LANES, k, dtype=torch.int32, device=codes.device)
    for i in range(LANES):
        out |= c[i] << (2 * i)
    return out.to(torch.uint8)
