"""Tiny checkpoints in every input format the exporter reads, for tests and demos.

Each builder writes a complete Hugging Face checkpoint folder (config.json,
generation_config.json, safetensors weights, a trained byte-level BPE tokenizer) with
random weights, so exporter and runtime can be checked against transformers without
downloading anything:

* ``make_bitnet_online``: ``BitNetForCausalLM`` with latent float weights and
  ``quantization_config`` autobitlinear/online (docs/artifact.md §Source checkpoints), loadable by transformers;
* ``make_bitnet_packed``: the offline form of a latent checkpoint: HF-packed uint8
  ``[N/4, K]`` plus ``weight_scale`` that multiplies (autobitlinear), divides (bitlinear) or
  uses the pre-release ``{"offline_quantization": true}`` config;
* ``make_qwen3_group128``: ``Qwen3ForCausalLM`` whose projections are exactly {-s, 0, +s}
  per 128-group (the Ternary-Bonsai ``-unpacked`` form);
* ``make_bitmtp``: a BitMTP training checkpoint, the BitNet online layout + ``bitmtp.json``;
* ``shard``, ``to_v4_dialect``: re-save weights as shards + index, rewrite config.json in
  the transformers v4 dialect.

The text the models produce is meaningless: the weights are random.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# The tokenizer's training text: varied enough for ~250 BPE merges (a 512-entry vocabulary).
CORPUS = """\
A ternary weight takes one of three values: minus one, zero or plus one. Two bits hold it,
so four weights share a byte and a matrix shrinks eightfold against sixteen-bit floats.
The scale that multiplies the codes is computed once per tensor, or once per group of 128
consecutive inputs, and the activations are rounded to eight-bit integers per token.
Multi-token decoding asks the model for a block of future tokens in a single forward pass.
Mask slots follow the committed text; the model fills them, and a confidence threshold
decides how many drafted tokens to keep. When the drafts look doubtful, the verifier runs
the same backbone causally and accepts the longest prefix that greedy decoding agrees with.
On a small board with a shared memory pool every megabyte counts: the key-value cache
lives in segments of growing capacity, and each captured graph replays with fixed shapes.
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.
Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump!
In the morning the river was calm and grey, and the fishermen pushed their boats into
the water before the sun climbed over the hills. By noon the market square was full of
voices, bread, oranges, copper pans, bicycles and dogs that slept in the shade.
def forward(x, weight, scale):
    return (x @ weight.T) * scale
for i in range(10):
    print(i, i * i, hex(i))
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 3.14159 2.71828
Jetson Orin boards run JetPack; the Ampere GPU has tensor cores but no FP8 support, while
Hopper servers add FP8 matrix instructions. Power modes change clock limits, so a careful
benchmark records the mode, locks the clocks and reports energy per generated token.
"""


@dataclass(frozen=True)
class TinyDims:
    """Dimensions divisible by 128 (whole packing chunks and group-128 scales) and by 4 (HF
    packing); ``PADDED_FFN`` has an FFN of 200 inputs (padded chunks, a short last group)."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # Qwen3 only; BitNet uses hidden_size // num_heads
    max_position_embeddings: int = 256


PADDED_FFN = dict(intermediate_size=200)  # like 1bitLLM bitnet_b1_58-3B's 8640: not whole 128-chunks


TINY = TinyDims()
BITNET_ONLINE_QC = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}


# --- tokenizer ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    return tok.to_str()


def write_tokenizer(folder: str | Path, vocab_size: int = 512) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; returns {"eos": id, "mask": id}."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json(vocab_size)
    (folder / "tokenizer.json").write_text(text)
    tok = Tokenizer.from_str(text)
    assert tok.get_vocab_size() <= vocab_size
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "mask_token": MASK_TOKEN,
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    return {"eos": tok.token_to_id(EOS_TOKEN), "mask": tok.token_to_id(MASK_TOKEN)}


def encode(folder: str | Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json")).encode(text).ids


# --- weights -----------------------------------------------------------------------------

def save_safetensors(folder: str | Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None = None) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index when sharded."""
    from safetensors.torch import save_file

    folder = Path(folder)
    for old in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    if max_shard_bytes is None:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):  # greedy in key order, as huggingface_hub does
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    n = len(shards)
    weight_map = {}
    for i, shard_state in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard_state, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard_state})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")


def load_safetensors(folder: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(str(folder / "model.safetensors"))
    state = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        state.update(load_file(str(folder / shard)))
    return state


def shard(folder: str | Path, max_shard_bytes: int = 400_000) -> Path:
    """Re-save a checkpoint's weights as shards + ``model.safetensors.index.json``."""
    save_safetensors(folder, load_safetensors(folder), max_shard_bytes)
    return Path(folder)


def to_v4_dialect(folder: str | Path) -> Path:
    """Rewrite config.json as transformers v4 writes it (top-level rope_theta, torch_dtype)."""
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    cfg["transformers_version"] = "4.56.0"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return Path(folder)


def _projections(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in state if k.endswith("_proj.weight")]


# --- builders ----------------------------------------------------------------------------

def make_bitnet_online(folder: str | Path, *, dims: TinyDims = TINY, seed: int = 0,
                       dtype: torch.dtype = torch.float32, tie: bool = True,
                       quantization_config: dict | None = BITNET_ONLINE_QC) -> Path:
    """A random ``BitNetForCausalLM`` with latent weights (online quantisation)."""
    from transformers import BitNetConfig, BitNetForCausalLM

    folder = Path(folder)
    ids = write_tokenizer(folder, dims.vocab_size)
    kwargs = {"quantization_config": dict(quantization_config)} if quantization_config else {}
    cfg = BitNetConfig(vocab_size=dims.vocab_size, hidden_size=dims.hidden_size,
                       intermediate_size=dims.intermediate_size, num_hidden_layers=dims.num_layers,
                       num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
                       max_position_embeddings=dims.max_position_embeddings, tie_word_embeddings=tie,
                       hidden_act="relu2", bos_token_id=ids["eos"], eos_token_id=ids["eos"], **kwargs)
    torch.manual_seed(seed)
    model = BitNetForCausalLM(cfg).to(dtype)
    _randomise_norms(model, seed)
    model.save_pretrained(folder)
    return folder


def make_bitnet_packed(online: str | Path, folder: str | Path, *, linear_class: str = "autobitlinear") -> Path:
    """The offline (packed) form of a latent BitNet checkpoint.

    ``linear_class``: ``"autobitlinear"`` (weight_scale = mean|W|, multiplies), ``"bitlinear"``
    (weight_scale = 1/mean|W|, divides) or ``"legacy"`` (the pre-release
    ``{"offline_quantization": true}`` config, which multiplies).
    """
    from kernels_ampere.numerics import ternarize_absmean
    from kernels_ampere.packing import pack_hf_bitnet

    online, folder = Path(online), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", *TOKENIZER_FILES):
        shutil.copyfile(online / name, folder / name)
    cfg = json.loads((online / "config.json").read_text())
    if linear_class == "legacy":
        cfg["quantization_config"] = {"quant_method": "bitnet", "offline_quantization": True}
    else:
        cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": linear_class,
                                      "quantization_mode": "offline"}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = load_safetensors(online)
    for name in _projections(state):
        w = state[name]
        codes, scale = ternarize_absmean(w)
        state[name] = pack_hf_bitnet(codes)
        ws = scale if linear_class != "bitlinear" else 1.0 / scale
        state[name + "_scale"] = ws.to(w.dtype)
    save_safetensors(folder, state)
    return folder


def make_qwen3_group128(folder: str | Path, *, dims: TinyDims = TinyDims(head_dim=128), seed: int = 0,
                        dtype: torch.dtype = torch.float16, tie: bool = True) -> Path:
    """A random ``Qwen3ForCausalLM`` whose projections are exactly {-s, 0, +s} per 128-group.

    The default head_dim (128) differs from hidden/heads (64), as in Qwen3-4B.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kernels_ampere.numerics import GROUP_SIZE, dequantize_ternary

    folder = Path(folder)
    ids = write_tokenizer(folder, dims.vocab_size)
    head_dim = dims.head_dim or dims.hidden_size // dims.num_heads
    cfg = Qwen3Config(vocab_size=dims.vocab_size, hidden_size=dims.hidden_size,
                      intermediate_size=dims.intermediate_size, num_hidden_layers=dims.num_layers,
                      num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads, head_dim=head_dim,
                      max_position_embeddings=dims.max_position_embeddings, tie_word_embeddings=tie,
                      rope_theta=1000000.0,  # v5 turns it into rope_parameters; v4 keeps it top-level
                      bos_token_id=ids["eos"], eos_token_id=ids["eos"])
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    _randomise_norms(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.weight"):
                # Random codes times one fp16 scale per 128-group, as Bonsai stores them, so
                # every group is exactly {-s, 0, +s} in fp16 and fp32 alike.
                n, k = p.shape
                codes = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
                groups = -(-k // GROUP_SIZE)  # a last, shorter group where K is not a multiple of 128
                scale = (0.02 + 0.04 * torch.rand(n, groups, generator=g)).to(torch.float16).float()
                p.copy_(dequantize_ternary(codes, scale))
    model.to(dtype).save_pretrained(folder)
    return folder


def make_bitmtp(folder: str | Path, *, block_size: int = 4, tau: float = 0.9, min_prefix: int = 2,
                **bitnet_kwargs) -> Path:
    """A BitMTP training checkpoint: the BitNet online layout + ``bitmtp.json``."""
    folder = make_bitnet_online(folder, **bitnet_kwargs)
    from tokenizers import Tokenizer

    mask_id = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(MASK_TOKEN)
    (folder / "bitmtp.json").write_text(json.dumps({
        "block_size": block_size, "mask_token_id": mask_id, "tau": tau, "min_prefix": min_prefix,
        "note": "random weights from tools/fake_checkpoints.py; generated text is meaningless",
    }, indent=2) + "\n")
    return folder


def _randomise_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights near 1 but not 1, so a norm read from the wrong tensor changes the output."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g).to(p.dtype))


if __name__ == "__main__":  # pragma: no cover - a quick look at what the builders make
    import sys
    import tempfile

    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fake-ckpts-"))
    online = make_bitnet_online(root / "bitnet-online")
    make_bitnet_packed(online, root / "bitnet-packed")
    make_qwen3_group128(root / "qwen3-group128")
    make_bitmtp(root / "bitmtp")
    print(root)
