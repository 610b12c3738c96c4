"""Seeded random weights for the built-in random pairs (demo_checkpoint.py, hf_tiny_pairs.py)."""

from __future__ import annotations

import math

import torch
from torch import nn


def randomize(module: nn.Module, generator: torch.Generator) -> None:
    """Deterministic values that keep activations O(1); norm weights are perturbed so a wrong
    norm kind ((1 + w) vs w) changes the outputs."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                base = 0.0 if _is_unit_offset(module, name) else 1.0
                param.copy_(base + 0.1 * noise)
            elif param.dim() == 2 and "embed" not in name:
                param.copy_(noise / math.sqrt(param.shape[1]))
            else:
                param.copy_(noise)


def _is_unit_offset(module: nn.Module, param_name: str) -> bool:
    owner = module.get_submodule(param_name.rpartition(".")[0])
    return bool(getattr(owner, "unit_offset", False))
