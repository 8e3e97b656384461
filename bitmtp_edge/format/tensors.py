"""Tensor names in ``weights.safetensors`` and the kinds of draft head an artifact carries.

The exporter writes these names, the readers check a checkpoint against them, the ONNX
builder and both backends read them. Module and parameter names follow Hugging Face's
``BitNetForCausalLM`` / ``Qwen3ForCausalLM``, so a training checkpoint's ``state_dict`` uses
the same names before packing.

* ``<proj>.packed`` uint8 [N, ceil(K/128)*32] (layout ``manifest.packing_layout``, specified
  in ``kernels_ampere/packing.py``; K padded to whole 128-chunks with zero weights) and
  ``<proj>.scale`` float32 ([1] per tensor, [N, ceil(K/128)] group-128) for every projection ``model.layers.{i}.<PROJECTIONS>``;
* norms, ``model.embed_tokens.weight`` and (untied) ``lm_head.weight`` as the checkpoint
  has them (16-bit);
* with the ``int8_per_row`` draft head: ``draft_head.int8`` int8 [V, H] and
  ``draft_head.scale`` float32 [V] (the draft role's head, one scale per vocabulary row).
"""

from __future__ import annotations

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"

PACKED_SUFFIX = ".packed"
SCALE_SUFFIX = ".scale"

# Draft-head kinds (``manifest.draft_head``): None means the draft role uses the verify head.
DRAFT_HEAD_INT8 = "int8_per_row"
DRAFT_HEAD_KINDS = (DRAFT_HEAD_INT8,)
DRAFT_HEAD_WEIGHT = "draft_head.int8"
DRAFT_HEAD_SCALE = "draft_head.scale"


def layer_prefix(layer: int) -> str:
    """``model.layers.{layer}.``: the prefix of every per-layer tensor name."""
    return f"model.layers.{layer}."


def projection_name(layer: int, projection: str) -> str:
    """``model.layers.{layer}.{projection}`` for one of ``PROJECTIONS``."""
    return layer_prefix(layer) + projection


def head_name(tie_word_embeddings: bool) -> str:
    """The verify head's tensor: the embedding when tied, ``lm_head.weight`` otherwise."""
    return EMBED if tie_word_embeddings else LM_HEAD
