"""The export's fp16 range audit: the checkpoint run in fp32 eager before conversion.

Real LLMs carry massive activations (a few residual channels in the hundreds to tens of
thousands on `<bos>`, the first token and delimiters), and the bundle computes in fp16, whose
largest value is 65,504. The audit runs the target, and the drafter on the target's features,
over calibration sequences led by `<bos>`; records per layer the peak |x| of the residual
stream, of every norm's input and of every projection's input and output, and of the logits
(final norm and lm_head, before any soft-cap); and chooses for each
stream the power-of-two scale that brings its peak under RESIDUAL_LIMIT (the models'
`scale_residual`; logits and features are unchanged but for rounding). It then runs again with
those scales and refuses, naming the layer, the module and the peak, when anything still
passes SAFE_LIMIT: no scale of the residual stream can help a projection whose own output is
too large. docs/fp16.md.

Memory: the target's large weights stay on disk as placeholders and each layer's are read only
while that layer runs (the embedding a row at a time), so the audit holds about one layer in
fp32 whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from museflash.bundle import Fp16Range, LayerPeaks, NormFold, NormForm
from museflash.checkpoint.load import load_drafter, load_target
from museflash.checkpoint.weight_values import unholdable, weight_value_error
from museflash.export.fp16_sensitivity import fp16_sensitivity
from museflash.export.options import ExportError
from museflash.export.placeholders import PlaceholderWeights
from museflash.models.base import RMSNorm

RESIDUAL_LIMIT = 2.0 ** 14  # a residual peak above this gets scaled down
SAFE_LIMIT = 2.0 ** 15  # nothing audited may stay above this: half of fp16's range
MAX_SCALE_EXPONENT = 10  # below 2^-10 the stream's ordinary values would lose fp16 precision
CALIBRATION_TOKENS = 48
# At most this many --calibration-prompts lines are audited (64 x 48 tokens, one batch): the
# audit's memory is bounded whatever the file's size.
MAX_CALIBRATION_PROMPTS = 64
PEAK_TOKENS = 4  # tokens with the largest residual peaks: recorded, and drafted from
# A target norm whose output, simulated in fp16 on the calibration rows, is off by more than this
# (relative, on some row) in today's order (x * f) * w gets its weight folded, x * (f * w), or,
# where that cannot hold it either, the export is refused. Eight fp16 half-ulps.
NORM_LOSS_LIMIT = 2.0 ** -8
FP16_MIN_NORMAL = 2.0 ** -14  # the floor of what that error is relative to (_NormLoss.note)
# x * (f * w) needs |f * w| in fp16's range on every row, f = 1 / rms: the fold is allowed where
# max|w| / (smallest rms the calibration saw / FOLD_MARGIN) stays under SAFE_LIMIT.
FOLD_MARGIN = 16.0
# Built-in calibration text: code, prose, digits, punctuation and blank lines, the kinds of
# token real models' massive activations sit on; each line is one sequence after <bos>.
BUILTIN_CALIBRATION = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
    "The quick brown fox jumps over the lazy dog. Then, it rested; the end.\n\n",
    "import os, sys\n\nclass Stack:\n    \"\"\"A stack.\"\"\"\n    items = [1, 2, 3]",
    "Q: 12 + 30 = ?\nA: 42.\n\n# Notes: (a) [b] {c} <d> \"e\" 'f' -- g; h: i!",
)


@dataclass(frozen=True)
class GraphNumerics:
    """What the audit decides about the graph, passed to every process that loads modules."""
    norm: NormForm = NormForm.MAX_ABS
    target_residual_scale: float = 1.0
    drafter_residual_scale: float = 1.0
    folded_norms: tuple[str, ...] = ()  # target norms written x * (f * w) (models/base.py)


def read_calibration_prompts(path: Path) -> tuple[list[str], int]:
    """The first MAX_CALIBRATION_PROMPTS prompts of --calibration-prompts FILE (one per
    non-empty line) and how many the file holds. The file is read a line at a time, so its
    size does not matter; the audit runs the prompts kept, each cut to CALIBRATION_TOKENS."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"--calibration-prompts {path}: no such file; give a UTF-8 text file "
                          "with one prompt per line")
    prompts: list[str] = []
    total = offset = 0
    with path.open("rb") as lines:
        for raw in lines:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ExportError(f"--calibration-prompts {path} is not UTF-8 text (byte "
                                  f"{offset + error.start}); save it as UTF-8, one prompt per "
                                  "line") from error
            offset += len(raw)
            if line.strip():
                total += 1
                if len(prompts) < MAX_CALIBRATION_PROMPTS:
                    prompts.append(line.rstrip("\r\n"))
    if not prompts:
        raise ExportError(f"--calibration-prompts {path} has no prompts; give one per line")
    return prompts, total


def calibration_name(path: Path, kept: int, total: int) -> str:
    """What `fp16_range.calibration` and the console line say was audited."""
    name = Path(path).name
    return name if kept == total else f"{name} (first {kept} of {total} prompts)"


def bos_token_id(target_dir: Path, config: dict) -> int | None:
    """The checkpoint's BOS id: config.json's bos_token_id, else tokenizer_config.json's
    bos_token looked up in tokenizer.json."""
    for source in (config, config.get("text_config") or {}):
        if isinstance(source.get("bos_token_id"), int):
            return source["bos_token_id"]
    tokenizer_config = target_dir / "tokenizer_config.json"
    tokenizer_file = target_dir / "tokenizer.json"
    if not (tokenizer_config.is_file() and tokenizer_file.is_file()):
        return None
    bos = json.loads(tokenizer_config.read_text()).get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    added = json.loads(tokenizer_file.read_text()).get("added_tokens") or []
    return next((t["id"] for t in added if t.get("content") == bos), None)


def calibration_sequences(target_dir: Path, bos: int | None, vocab_size: int,
                          prompts: list[str] | None, context: int) -> list[list[int]]:
    """Sequences led by `bos` (when not None) of CALIBRATION_TOKENS ids, at most the export's
    context: `prompts` (or BUILTIN_CALIBRATION)
    tokenized with the checkpoint's tokenizer.json and repeated to length, plus one sequence of
    the lowest ids (where special tokens, bytes and punctuation sit in most vocabularies).
    Without a tokenizer, seeded ids stand in for the built-in text."""
    lead = [bos] if bos is not None else []
    length = min(CALIBRATION_TOKENS, context) - len(lead)
    tokenizer_file = target_dir / "tokenizer.json"
    texts = prompts or list(BUILTIN_CALIBRATION)
    bodies: list[list[int]] = []
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
            bodies = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
        except Exception as error:  # the tokenizers library raises bare Exception
            detail = " ".join(str(error).split())
            raise ExportError(
                f"{tokenizer_file}: the fp16 audit could not tokenize its calibration text "
                f"({detail}); fix the tokenizer file (a word-level or BPE model needs its "
                "unk_token in its vocabulary) or remove it from the checkpoint") from error
        empty = [text for text, ids in zip(texts, bodies, strict=True) if not ids]
        if empty:
            raise ExportError(f"calibration prompt {empty[0]!r} has no tokens; give text")
    elif prompts:
        raise ExportError(f"--calibration-prompts needs the target's tokenizer.json, which "
                          f"{target_dir} lacks; drop the flag to use built-in sequences")
    else:
        generator = np.random.default_rng(0)
        bodies = [generator.integers(0, vocab_size, length).tolist() for _ in texts]
    sequences = [lead + (body * (length // len(body) + 1))[:length] for body in bodies]
    sequences.append(lead + [i % vocab_size for i in range(length)])
    return [[int(i) % vocab_size for i in sequence] for sequence in sequences]


def _larger(a: float, b: float) -> float:
    """max(a, b), except that NaN wins: max(0.0, nan) is 0.0, which would record a
    non-finite activation as a peak of 0."""
    return b if math.isnan(b) or b > a else a


class _Peaks:
    """Forward hooks recording the peak |input| and |output| of every Linear and RMSNorm."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.inputs: dict[str, float] = {}
        self.outputs: dict[str, float] = {}
        self.handles = []
        for prefix, root in modules.items():
            for name, module in root.named_modules():
                if isinstance(module, (nn.Linear, RMSNorm)):
                    self.handles.append(module.register_forward_hook(
                        self._hook(f"{prefix}.{name}")))

    def _hook(self, name: str):
        def record(_module, args, output):
            self.note(self.inputs, name, args[0])
            self.note(self.outputs, name, output)
        return record

    @staticmethod
    def note(table: dict[str, float], name: str, value: torch.Tensor) -> None:
        table[name] = _larger(table.get(name, 0.0), float(value.detach().abs().max()))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _fp16(value: torch.Tensor) -> torch.Tensor:
    return value.half().float()


@dataclass
class _NormLoss:
    """One norm's record over the calibration rows (fp32, scales applied): the largest relative
    error of its output with its last two products simulated in fp16 in each order, the
    smallest row rms, the largest |weight| and the norm's eps."""
    unfolded: float = 0.0
    folded: float = 0.0
    smallest_rms: float = math.inf
    largest_weight: float = 0.0
    eps: float = 0.0

    def note(self, norm: RMSNorm, x: torch.Tensor) -> None:
        rows = x.detach().float().reshape(-1, x.shape[-1])
        rms = torch.sqrt(rows.pow(2).mean(dim=-1, keepdim=True) + norm.eps)
        full = norm.full_weight()
        factor, weight = _fp16(1.0 / rms), _fp16(full)
        exact = rows.double() / rms.double() * full.double()
        # Relative to the row's output, but never to less than a row of fp16's smallest normal
        # in every channel: a row that small adds nothing the next op can resolve whatever its
        # form, and relative to itself it would count a flush to zero as a loss of 1.
        size = exact.norm(dim=-1).clamp(min=FP16_MIN_NORMAL * math.sqrt(rows.shape[-1]))
        unfolded = _fp16(_fp16(_fp16(rows) * factor) * weight)
        folded = _fp16(_fp16(rows) * _fp16(factor * weight))
        for name, value in (("unfolded", unfolded), ("folded", folded)):
            error = float(((value.double() - exact).norm(dim=-1) / size).max())
            setattr(self, name, _larger(getattr(self, name), error))
        self.smallest_rms = min(self.smallest_rms, float(rms.min()))
        self.largest_weight = max(self.largest_weight, float(full.abs().max()))
        self.eps = norm.eps

    def fold_bound(self) -> float:
        """A bound on |f * w| over the rows the calibration saw, with FOLD_MARGIN for rows
        smaller than any of them (f itself never passes 1 / sqrt(eps))."""
        factor = min(FOLD_MARGIN / self.smallest_rms, 1.0 / math.sqrt(self.eps))
        return self.largest_weight * factor


class _NormLosses:
    """Forward hooks recording a _NormLoss for every weighted RMSNorm of `root`."""

    def __init__(self, root: nn.Module):
        self.losses: dict[str, _NormLoss] = {}
        self.handles = []
        for name, module in root.named_modules():
            if isinstance(module, RMSNorm) and module.weight is not None:
                self.losses[name] = _NormLoss()
                self.handles.append(module.register_forward_hook(
                    lambda m, args, _out, name=name: self.losses[name].note(m, args[0])))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _RowEmbedding(nn.Module):
    """An embedding whose rows are read from the checkpoint as they are asked for."""

    def __init__(self, location, dim: int):
        super().__init__()
        self.location = location
        self.embedding_dim = dim
        self.rows: dict[int, torch.Tensor] = {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        for i in set(ids.reshape(-1).tolist()) - set(self.rows):
            row = self.location.read_rows(i, i + 1, torch.float32)[0]
            if unholdable(row.numpy()):
                raise weight_value_error(self.location.path, self.location.key, [row.numpy()])
            self.rows[i] = row
        flat = torch.stack([self.rows[i] for i in ids.reshape(-1).tolist()])
        return flat.reshape(*ids.shape, self.embedding_dim)


@contextmanager
def _real_weights(module: nn.Module, placeholders: PlaceholderWeights) -> Iterator[None]:
    """`module`'s placeholder weights replaced by the real ones (fp32) while the block runs."""
    swapped = []
    for name, param in list(module.named_parameters()):
        row = placeholders.row_of(param)
        if row is None:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        location = placeholders.by_row[row]
        real = location.read(torch.float32)
        if unholdable(real.numpy()):  # the weight writer would refuse it too, by name
            raise weight_value_error(location.path, location.key, [real.numpy()])
        owner._parameters[leaf] = nn.Parameter(real, requires_grad=False)
        swapped.append((owner, leaf, param))
    try:
        yield
    finally:
        for owner, leaf, param in swapped:
            owner._parameters[leaf] = param


@dataclass
class _Run:
    """One pass of the audit: the hooks' peaks, the residual peaks it saw and the target's
    logits (lm_head's output, and after the output multiplier, before any soft-cap)."""
    peaks: _Peaks
    norms: _NormLosses
    target_residual: list[float] = field(default_factory=list)
    drafter_residual: list[float] = field(default_factory=list)
    token_peaks: dict[int, float] = field(default_factory=dict)
    logits: float = 0.0


def _peak(table: dict[str, float], prefix: str, kinds: tuple[type, ...] | None = None,
          modules: dict[str, nn.Module] | None = None) -> float:
    names = [n for n in table if n.startswith(prefix)]
    if kinds is not None:
        names = [n for n in names if isinstance(modules[n], kinds)]
    return max((table[n] for n in names), default=0.0)


class RangeAudit:
    """Loads the checkpoint for the audit once; `run` audits it under given scales."""

    def __init__(self, target_dir: Path, drafter_dir: Path | None, *, fused: bool,
                 with_drafter: bool, context: int, block: int):
        self.placeholders = PlaceholderWeights()
        self.target = load_target(target_dir, drafter_dir if fused else None,
                                  dtype=torch.float32, max_context=context, max_query_len=block,
                                  placeholders=self.placeholders)
        head_row = self.placeholders.row_of(self.target.output_weight())
        # lm_head's weight (or the embedding it is tied to), read a slice of rows at a time.
        self.head_location = (self.placeholders.by_row[head_row] if head_row is not None
                              else None)
        self.head_weight = None if head_row is not None else self.target.output_weight()
        embed_row = self.placeholders.row_of(self.target.embed_tokens.weight)
        if embed_row is not None:
            self.target.embed_tokens = _RowEmbedding(self.placeholders.by_row[embed_row],
                                                     self.target.config.hidden_size)
        self.drafter = None
        if with_drafter and drafter_dir is not None:
            self.drafter = load_drafter(drafter_dir, self.target, target_dir=target_dir,
                                        dtype=torch.float32, max_query_len=block,
                                        placeholders=self.placeholders)
        self.block = block
        self.modules: dict[str, nn.Module] = {}
        roots = {"target": self.target, **({"drafter": self.drafter} if self.drafter else {})}
        for prefix, root in roots.items():
            self.modules.update({f"{prefix}.{n}": m for n, m in root.named_modules()})
        self.roots = roots

    def around_layer(self, layer_id: int):
        """Target layer `layer_id`'s real weights in place while the block runs."""
        return _real_weights(self.target.layers[layer_id], self.placeholders)

    def scale(self, target_scale: float, drafter_scale: float) -> None:
        self.target.scale_residual(target_scale)
        if self.drafter is not None:
            self.drafter.scale_residual(drafter_scale)

    @torch.no_grad()
    def run(self, sequences: list[list[int]]) -> _Run:
        target, drafter = self.target, self.drafter
        run = _Run(_Peaks(self.roots), _NormLosses(target))
        try:
            ids = torch.tensor(sequences)
            layers = tuple(range(target.config.num_hidden_layers))

            _, captured = target.batch_hidden_states(ids, layers, around_layer=self.around_layer)
            for layer_id, out in enumerate(captured):
                inside = run.peaks.inputs.get(
                    f"target.layers.{layer_id}.pre_feedforward_layernorm", 0.0)
                run.target_residual.append(_larger(inside, float(out.abs().max())))
            run.logits = self._logits_peak(captured[-1])
            last = captured[-1].abs().amax(dim=-1)
            for token, value in zip(ids.reshape(-1).tolist(), last.reshape(-1).tolist(),
                                    strict=True):
                run.token_peaks[token] = _larger(run.token_peaks.get(token, 0.0), value)
            encoder = getattr(target, "encoder", None)
            if encoder is not None:
                with _real_weights(encoder, self.placeholders):
                    features = encoder([captured[i] for i in target.target_layer_ids])
                if drafter is not None:
                    ranked = sorted(run.token_peaks, key=lambda t: -run.token_peaks[t])
                    with _real_weights(drafter.layers, self.placeholders):
                        self._draft(run, ids, features, ranked[:PEAK_TOKENS])
        finally:
            run.peaks.close()
            run.norms.close()
        return run

    def _logits_peak(self, hidden: torch.Tensor, rows: int = 8192) -> float:
        """Peak |logits| of the final norm and lm_head over `hidden` (the last layer's
        output), before the soft-cap: lm_head's own output and, where the family has one,
        after the output multiplier. lm_head is read `rows` vocabulary rows at a time."""
        target = self.target
        with _real_weights(target.norm, self.placeholders):
            normed = target.norm(hidden).reshape(-1, hidden.shape[-1])
        multiplier = float(getattr(target.config, "output_multiplier", 1.0) or 1.0)
        vocab = target.config.vocab_size
        peak = 0.0
        for start in range(0, vocab, rows):
            stop = min(start + rows, vocab)
            if self.head_location is not None:
                weight = self.head_location.read_rows(start, stop, torch.float32)
            else:
                weight = self.head_weight[start:stop].float()
            out = float((normed @ weight.T).abs().max())
            peak = _larger(peak, _larger(out, out * abs(multiplier)))
        return peak

    def _draft(self, run: _Run, ids: torch.Tensor, features: torch.Tensor,
               anchors: list[int]) -> None:
        """Per sequence: its features injected, then blocks drafted after its last token, with
        that token and with each of `anchors` (the target's peak tokens) as the anchor."""
        drafter = self.drafter
        outputs: list[float] = [0.0] * len(drafter.layers)
        handles = [layer.register_forward_hook(
            lambda _m, _a, out, i=i: outputs.__setitem__(i, _larger(outputs[i],
                                                                    float(out.abs().max()))))
            for i, layer in enumerate(drafter.layers)]
        mask = drafter.config.mask_token_id
        length = ids.shape[1]
        try:
            for row in range(ids.shape[0]):
                drafter.reset_caches()
                for start in range(0, length - 1, self.block):
                    stop = min(start + self.block, length - 1)
                    drafter.inject_kv(features[row:row + 1, start:stop],
                                      torch.arange(start, stop))
                for anchor in [int(ids[row, -1]), *anchors]:
                    block = torch.tensor([[anchor] + [mask] * (self.block - 1)])
                    drafter._draft_hidden(block,
                                          torch.arange(length - 1, length - 1 + self.block))
        finally:
            for handle in handles:
                handle.remove()
        for i, value in enumerate(outputs):
            inside = run.peaks.inputs.get(f"drafter.layers.{i}.post_attention_layernorm", 0.0)
            run.drafter_residual.append(_larger(inside, value))

    def layer_peaks(self, run: _Run, root: str, residual: list[float]) -> list[LayerPeaks]:
        peaks = run.peaks
        return [LayerPeaks(
            layer=i,
            residual=residual[i],
            norm_input=_peak(peaks.inputs, f"{root}.layers.{i}.", (RMSNorm,), self.modules),
            matmul_input=_peak(peaks.inputs, f"{root}.layers.{i}.", (nn.Linear,), self.modules),
            matmul_output=_peak(peaks.outputs, f"{root}.layers.{i}.", (nn.Linear,),
                                self.modules),
        ) for i in range(len(residual))]


def residual_scale(peak: float, where: str) -> float:
    """The largest power of two s <= 1 with peak * s <= RESIDUAL_LIMIT."""
    if not math.isfinite(peak):
        raise ExportError(f"fp16 range: {where} is not finite in fp32 eager on the calibration "
                          "sequences; the checkpoint itself overflows")
    exponent = max(0, math.ceil(math.log2(peak / RESIDUAL_LIMIT))) if peak > 0 else 0
    if exponent > MAX_SCALE_EXPONENT:
        raise ExportError(
            f"fp16 range: {where} peaks at {peak:.4g}, which needs a residual scale below "
            f"2^-{MAX_SCALE_EXPONENT} to fit fp16; this checkpoint cannot be exported in fp16")
    return 2.0 ** -exponent


def _first_over(run: _Run, limit: float) -> tuple[str, float] | None:
    # Outputs first: a projection's output is the next module's input, and the one that made
    # the value is the one to name.
    for table, side in ((run.peaks.outputs, "output"), (run.peaks.inputs, "input")):
        for name, value in table.items():
            if not value <= limit:
                return f"{name} {side}", value
    for root, residual in (("target", run.target_residual), ("drafter", run.drafter_residual)):
        for layer, value in enumerate(residual):
            if not value <= limit:
                return f"{root}.layers.{layer} residual", value
    if not run.logits <= limit:
        return "the target's logits (lm_head output, before any soft-cap)", run.logits
    return None


def _refuse_nonfinite(run: _Run) -> None:
    """NaN or inf anywhere in the fp32 run is the checkpoint's own fault: no fp16 graph
    can fix it, and a recorded peak of NaN would mean nothing."""
    over = _first_over(run, math.inf)
    if over is not None and not math.isfinite(over[1]):
        name, value = over
        raise ExportError(f"fp16 range: {name} is {value} in fp32 eager on the calibration "
                          "sequences, before any fp16; the checkpoint itself is broken: check "
                          "its weights and its config's eps and scale fields")


def choose_folds(run: _Run) -> list[NormFold]:
    """The target norms to write x * (f * w): those whose output loses more than
    NORM_LOSS_LIMIT in today's order on the calibration rows, where folding keeps it and
    |f * w| is bounded under SAFE_LIMIT. Refuses, naming the norm, where neither order holds."""
    folds = []
    for name, loss in run.norms.losses.items():
        if loss.unfolded <= NORM_LOSS_LIMIT:
            continue
        bound = loss.fold_bound()
        if bound <= SAFE_LIMIT and loss.folded <= NORM_LOSS_LIMIT:
            folds.append(NormFold(norm=name, unfolded_error=loss.unfolded,
                                  folded_error=loss.folded, fold_bound=bound))
            continue
        why = (f"with its weight folded in, |f * w| could reach {bound:.3g}, past fp16's range"
               if bound > SAFE_LIMIT else
               f"folded it is still off by {loss.folded:.2g}: its input's small channels are "
               "themselves below fp16's normal range")
        raise ExportError(
            f"fp16 range: target {name} loses its small channels beside a massive one (output "
            f"off by {loss.unfolded:.2g} in fp16 on the calibration, limit "
            f"{NORM_LOSS_LIMIT:.2g}), and {why}; this checkpoint cannot be exported in fp16 "
            "as it is: rescale that norm's weights or the massive channel feeding it in the "
            "checkpoint, or give --calibration-prompts that your use really meets")
    return folds


def audit_checkpoint(target_dir: Path, drafter_dir: Path | None, *, fused: bool,
                     with_drafter: bool, context: int, block: int, vocab_size: int,
                     config: dict, prompts: list[str] | None, calibration: str,
                     norm: NormForm, scale: bool) -> tuple[Fp16Range, GraphNumerics]:
    """The audit's record for metadata.json, and the numerics the graph is built with
    (`scale` False: today's graph, no residual scaling, for the tests and figures)."""
    bos = bos_token_id(target_dir, config)
    sequences = calibration_sequences(target_dir, bos, vocab_size, prompts, context)
    audit = RangeAudit(target_dir, drafter_dir, fused=fused, with_drafter=with_drafter,
                       context=context, block=block)
    first = audit.run(sequences)
    _refuse_nonfinite(first)
    target_scale = drafter_scale = 1.0
    if scale:
        target_scale = residual_scale(max(first.target_residual), "the target's residual")
        if first.drafter_residual:
            drafter_scale = residual_scale(max(first.drafter_residual),
                                           "the drafter's residual")
    checked = first
    if target_scale != 1.0 or drafter_scale != 1.0:
        audit.scale(target_scale, drafter_scale)
        checked = audit.run(sequences)
    over = _first_over(checked, SAFE_LIMIT)
    if scale and over is not None:
        name, value = over
        raise ExportError(
            f"fp16 range: {name} peaks at {value:.4g} even with residual scale "
            f"{target_scale:g} (target) / {drafter_scale:g} (drafter), above the 2^15 fp16 "
            "can hold with margin; no residual scale can fix a projection this large, so this "
            "checkpoint cannot be exported in fp16")
    folds = choose_folds(checked) if scale else []
    if scale:
        fp16_sensitivity(audit.target, sequences, audit.around_layer)
    everything = [*checked.peaks.inputs.values(), *checked.peaks.outputs.values(),
                  *checked.target_residual, *checked.drafter_residual, checked.logits]
    ranked = sorted(first.token_peaks, key=lambda t: -first.token_peaks[t])
    record = Fp16Range(
        norm=norm,
        calibration=calibration,
        sequences=len(sequences),
        tokens=len(sequences[0]),
        target_residual_scale=target_scale,
        drafter_residual_scale=drafter_scale if audit.drafter is not None else None,
        peak_after_scaling=max(everything),
        drafter_feature_input=(first.peaks.inputs.get("target.encoder.fc")
                               if hasattr(audit.target, "encoder") else None),
        peak_tokens=ranked[:PEAK_TOKENS],
        bos_token_id=bos,
        target_layers=audit.layer_peaks(first, "target", first.target_residual),
        drafter_layers=(audit.layer_peaks(first, "drafter", first.drafter_residual)
                        if audit.drafter is not None else []),
        folded_norms=folds or None,
    )
    return record, GraphNumerics(norm, target_scale, drafter_scale,
                                 tuple(fold.norm for fold in folds))


def summary(record: Fp16Range) -> str:
    """The audit's one line on the console."""
    target_peak = max((p.residual for p in record.target_layers), default=0.0)
    worst = max(range(len(record.target_layers)),
                key=lambda i: record.target_layers[i].residual, default=0)
    text = (f"target residual peak {target_peak:.4g} (layer {worst}), scale "
            f"{record.target_residual_scale:g}")
    if record.drafter_layers:
        drafter_peak = max(p.residual for p in record.drafter_layers)
        text += f"; drafter peak {drafter_peak:.4g}, scale {record.drafter_residual_scale:g}"
    if record.folded_norms:
        names = ", ".join(fold.norm for fold in record.folded_norms)
        text += f"; weight folded into the factor in {names}"
    return (f"{text}; largest |x| after scaling {record.peak_after_scaling:.4g} over "
            f"{record.sequences} x {record.tokens} calibration tokens ({record.calibration})")
