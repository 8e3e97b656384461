"""Pristine fake checkpoints for the exporter tests, built once per test process.

Tests never modify these folders: a test that needs a broken checkpoint copies one first
(``copy_ckpt``). Building all of them takes about a second (tools/fake_checkpoints.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import shutil
import tempfile
from pathlib import Path

import torch
from click.testing import CliRunner

from export.cli import main
from tools import fake_checkpoints as fc


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="bitmtp-export-tests-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.cache
def checkpoint(kind: str) -> Path:
    """One pristine checkpoint folder per kind (see the table below)."""
    root = _root()
    builders = {
        "bitnet-online": lambda d: fc.make_bitnet_online(d),
        "bitnet-online-bf16": lambda d: fc.make_bitnet_online(d, dtype=torch.bfloat16),
        "bitnet-online-untied": lambda d: fc.make_bitnet_online(d, tie=False, seed=1),
        "bitnet-packed-autobitlinear": lambda d: fc.make_bitnet_packed(checkpoint("bitnet-online"), d),
        "bitnet-packed-bitlinear": lambda d: fc.make_bitnet_packed(checkpoint("bitnet-online"), d,
                                                                   linear_class="bitlinear"),
        "bitnet-packed-legacy": lambda d: fc.make_bitnet_packed(checkpoint("bitnet-online"), d,
                                                                linear_class="legacy"),
        "qwen3-fp16": lambda d: fc.make_qwen3_group128(d),
        "qwen3-fp32": lambda d: fc.make_qwen3_group128(d, dtype=torch.float32),
        "bitmtp": lambda d: fc.make_bitmtp(d),
        # FFN inputs not a multiple of 128 (1bitLLM bitnet_b1_58-3B / -xl): packed K padded
        "bitnet-online-k200": lambda d: fc.make_bitnet_online(d, dims=dataclasses.replace(fc.TINY, **fc.PADDED_FFN)),
        "qwen3-fp32-k200": lambda d: fc.make_qwen3_group128(
            d, dims=fc.TinyDims(head_dim=128, **fc.PADDED_FFN), dtype=torch.float32),
    }
    return Path(builders[kind](root / kind))


def copy_ckpt(kind: str, dest: Path) -> Path:
    return Path(shutil.copytree(checkpoint(kind), dest))


def run_cli(*args: str | Path):
    """Invoke ``bitmtp-export`` in-process; returns click's Result (exit_code, output)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
