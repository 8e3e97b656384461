"""BitMTP Edge: multi-token decoding for ternary LLMs on Jetson and server GPUs."""

from .artifact import ArtifactError, Manifest
from .config import ModelConfig, MTPConfig, QuantConfig
from .decoding import POLICIES, DecodeStats, DecodingError
from .engine import Engine, GenerationResult

__version__ = "0.1.0"

__all__ = [
    "ArtifactError", "DecodeStats", "DecodingError", "Engine", "GenerationResult", "Manifest",
    "ModelConfig", "MTPConfig", "POLICIES", "QuantConfig", "__version__",
]
