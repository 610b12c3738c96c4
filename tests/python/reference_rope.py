"""Independent reference for the tests: rotate-half RoPE from the formula, angles in float64."""

import torch


def rotate(x, positions, theta):
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = (positions.double()[:, None] * freqs[None, :]).float()
    cos, sin = angle.cos(), angle.sin()
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
