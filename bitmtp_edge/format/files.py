"""The artifact's file names and its one error type.

Kept apart from ``manifest.py`` so that the validators (``validate.py``), which the manifest
reader calls, can name files and raise without importing the reader back."""

from __future__ import annotations

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


class ArtifactError(RuntimeError):
    """An artifact folder cannot be read: says which file and what to do."""
