"""The range audit's fp16 sensitivity run (docs/fp16.md, "A weight that multiplies fp16's
rounding"): a checkpoint can keep every value in fp16's range and still not survive fp16,
when a norm's large weight multiplies the rounding of its input into the residual stream.

A post-MLP norm with weight 2.5e4 in one channel writes 2.5e4 * x_c / rms(x), where x is a
projection's output. In fp16, x_c carries a rounding of about 2^-11 of its row's size,
whatever x_c's own value, so that residual channel carries about 2^-11 * 2.5e4 = 12 of noise on
every token. Where the channel's value changes sign from token to token, some token has it near
zero, and there the noise is of the order of the whole row: every later layer normalises that
token by the wrong rms, and fp32 eager and the fp16 program disagree by tens of percent in
the caches and logits, although no value is out of range. No order of the products helps: the
information is gone at the projection's fp16 output. Such tokens are rare (the calibration
may hold none), so the run does not wait to see one: it predicts the error there.

The run: the calibration batch twice in one fp32 pass, the second copy's every projection and
norm output rounded to fp16 (the bundle's storage). For each layer's output and each residual
channel c, on every row, the noise the rounding left that c's own value does not explain,
max(0, |dr_c| - 4u|r_c|), over the rms of the row's other channels: the error of a token whose
c is zero. Where c takes both signs on the calibration and that ratio passes SENSITIVITY_LIMIT,
the export is refused, naming the layer, the channel and the norm with the largest weight
there. Measured on the pairs the project exports: at most 0.13 (SmolLM2); the issue-72 class
17 to 41.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from museflash.export.options import ExportError
from museflash.models.base import RMSNorm

# The largest predicted error (relative to the row's other channels) a residual channel that
# changes sign may carry. 7.6x the largest measured on a pair that verifies (SmolLM2's 0.13),
# 17x below the smallest of the failing class (docs/fp16.md).
SENSITIVITY_LIMIT = 1.0
FP16_UNIT = 2.0 ** -11  # fp16's unit roundoff
OWN_ROUNDINGS = 4  # roundings of a channel's own value allowed before noise counts as excess


@dataclass
class Sensitivity:
    """The worst residual channel of the run: the predicted error where it passes zero."""
    error: float = 0.0
    layer: int = -1
    channel: int = -1


def _round_second_half(batch: int) -> Callable:
    def hook(_module, _args, output):
        if not isinstance(output, torch.Tensor):
            return output
        rounded = output.clone()
        rounded[batch:] = output[batch:].half().float()
        return rounded
    return hook


def _note(worst: Sensitivity, layer: int, batch: int, output: torch.Tensor) -> None:
    clean = output[:batch].reshape(-1, output.shape[-1]).double()
    noisy = output[batch:].reshape(-1, output.shape[-1]).double()
    excess = ((noisy - clean).abs() - OWN_ROUNDINGS * FP16_UNIT * clean.abs()).clamp(min=0)
    squares = clean.pow(2)
    others = ((squares.sum(-1, keepdim=True) - squares).clamp(min=0)
              / max(1, clean.shape[-1] - 1)).sqrt().clamp(min=1e-30)
    predicted = (excess / others).amax(0)
    crosses = (clean.amin(0) < 0) & (clean.amax(0) > 0)
    predicted = torch.where(crosses, predicted, torch.zeros_like(predicted))
    channel = int(predicted.argmax())
    if float(predicted[channel]) > worst.error:
        worst.error, worst.layer, worst.channel = float(predicted[channel]), layer, channel


def fp16_sensitivity(target: nn.Module, sequences: list[list[int]],
                     around_layer=None) -> Sensitivity:
    """The worst residual channel of the simulated fp16 run over `sequences`. Refuses
    (ExportError) past SENSITIVITY_LIMIT, naming the layer, the channel and its norm."""
    ids = torch.tensor(sequences)
    batch = ids.shape[0]
    worst = Sensitivity()
    with ExitStack() as stack, torch.no_grad():
        for module in target.modules():
            if isinstance(module, (nn.Linear, RMSNorm)):
                stack.callback(module.register_forward_hook(_round_second_half(batch)).remove)
        layers = tuple(range(len(target.layers)))
        _, outputs = target.batch_hidden_states(torch.cat([ids, ids]), layers,
                                                around_layer=around_layer)
    for layer, output in enumerate(outputs):
        _note(worst, layer, batch, output)
    if worst.error <= SENSITIVITY_LIMIT:
        return worst
    norm, weight = _writer(target, worst)
    raise ExportError(
        f"fp16 range: residual channel {worst.channel} after target layers.{worst.layer} "
        f"changes sign from token to token and carries fp16 rounding {worst.error:.3g} times "
        f"the rest of its row (limit {SENSITIVITY_LIMIT:g}): {norm} multiplies its input's "
        f"rounding by {weight:.3g} there, so a token where the channel is near zero gets a "
        "wrong hidden state; no fp16 form of this graph holds it, so nothing was written: check "
        "that norm's weight in the checkpoint (fp32 compute is not exported)")


def _writer(target: nn.Module, worst: Sensitivity) -> tuple[str, float]:
    """The weighted norm at or before the layer with the largest weight at the channel."""
    found = ("the layers' norms", 0.0)
    for name, module in target.named_modules():
        if (isinstance(module, RMSNorm) and module.weight is not None
                and name.startswith("layers.") and int(name.split(".")[1]) <= worst.layer):
            weight = float(module.full_weight()[worst.channel].abs())
            if weight > found[1]:
                found = (f"target {name}", weight)
    return found
