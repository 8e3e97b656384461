"""Fully sharded training for ``tools.train --fsdp``: a model that does not fit one GPU.

torch's own FSDP (``torch.distributed.fsdp.fully_shard``, "FSDP2") shards every parameter, its
gradient and its optimiser state over the torchrun processes: one unit per decoder layer,
gathered for that layer's forward and backward and freed after, and one root unit for the rest
(the embedding, which the tied head reads too, the final norm, the draft slots' offsets). What
this module adds is only what the trainer's files need from a sharded model:

* ``full_model_state``: every tensor whole, on rank 0's CPU, for ``save_latent`` /
  ``save_compact`` (safetensors), through a *shell* of the model (``meta_shell``) that holds no
  memory until a save assigns it the gathered tensors;
* ``full_optimizer_state`` / ``load_optimizer_state``: the optimiser's state whole and keyed by
  parameter name (torch's ``get_optimizer_state_dict``), so ``resume.pt`` holds plain tensors that
  ``torch.load(weights_only=True)`` reads, and any rank can reshard it on ``--resume``.

The same collectives run on every rank (each gathers and waits for the others); only rank 0
keeps what they return.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def shard(root: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """``fully_shard`` each decoder layer, then ``root`` (whose forward must run every use of
    the parameters left to it: the embedding and the tied head both read one tensor, so both
    must happen inside the root's forward). Parameters on the CPU move to ``device`` one unit
    at a time, so the whole model is never on one GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)


def meta_shell(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory):
    the module tree, classes and config a checkpoint writer reads, to be filled by
    ``load_state_dict(state, assign=True)``. Made before ``shard`` replaces the parameters."""
    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the sharded ``model``'s state whole on rank 0's CPU ({} on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Collective: ``opt``'s state whole, keyed by parameter name, on rank 0's CPU ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Every rank: load a ``full_optimizer_state`` (read from resume.pt by each rank) into its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded scalar (``clip_grad_norm_`` over sharded gradients returns one) as a plain tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
