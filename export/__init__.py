"""``bitmtp-export``: Hugging Face ternary checkpoints -> BitMTP artifacts.

    from export import export_checkpoint, ExportOptions
    export_checkpoint("ckpt/", "out/", ExportOptions(board="orin-nano-8gb"))

Modules: ``checkpoint`` (folder, JSON and safetensors reading and checks), ``hf_config``
(config.json / bitmtp.json -> ModelConfig, QuantConfig, MTPConfig), ``readers`` (per-format
conversion to canonical codes + scales), ``writer`` (manifest, tensors), ``out_folder`` (what OUT/ may be, the atomic write,
leftovers of killed runs),
``cli`` (the click command).
"""

from .errors import ExportError
from .writer import EXPORTER_VERSION, ExportOptions, ExportResult, export_checkpoint

__all__ = ["EXPORTER_VERSION", "ExportError", "ExportOptions", "ExportResult", "export_checkpoint"]
