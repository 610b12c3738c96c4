"""//:train_drafter: one DFlash / DFlash2 drafter trainer for any target the loaders read, in
one process or many under torchrun (docs/training.md).

    python -m torch.distributed.run --nproc_per_node N -m museflash.cli.train_drafter_main \\
        --target DIR_OR_GGUF --output-dir OUT [--resume] [recipe flags]

What a run does:
  1. the target (a Hugging Face folder, or a GGUF file read into one: OUT/target);
  2. the drafter's config in z-lab's layout (`drafter_config`) and a seeded initialisation
     (OUT/initial, fp32; train_demo_drafter / train_demo_dflash2's initialisers);
  3. the data (trainer_data.py): prompts rendered with the target's chat template, continued
     greedily by the target, cached in OUT/data; rank 0 makes it while the others wait;
  4. training (`fit`): every step takes `batch_rows` rows of a seeded per-epoch permutation of
     the rows, `batch_rows / world` of them on each rank (a DistributedSampler's sharding, done
     here so that the data position is the step: resume needs nothing else), and up to
     `anchors_per_row` distinct random anchors in each row, drawn from a generator seeded by
     (seed, step, the row's slot in the global batch): the blocks a step trains on do not
     depend on the number of ranks. A row's blocks share one encoder pass. The loss of each
     block (trainer_loss.BlockLoss) is summed and divided by the step's global block count, so
     DDP's gradient average over ranks is the one-process gradient;
  5. rank 0 logs (a progress line and OUT/train_drafter.log.jsonl), evaluates the held-out
     rows every `eval_every` steps (trainer_loss.heldout_figures), saves OUT/checkpoint/state.pt
     (trained weights, optimizer, scheduler, RNG states, step) every `save_every` steps, and at
     the end writes OUT/drafter (bf16, block_size 16: what `//:export --drafter-checkpoint`
     takes) and OUT/train_drafter.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from museflash.bundle import LayerType
from museflash.checkpoint.configs import check_configs
from museflash.checkpoint.load import drafter_checkpoint_tensors
from museflash.checkpoint.tensor_files import write_safetensors
from museflash.training import distributed as ddp
from museflash.training import train_demo_dflash2 as v2
from museflash.training import train_demo_drafter as v1
from museflash.training import trainer_data as data
from museflash.training.distil_corpus import load_pair
from museflash.training.trainer_loss import BlockLoss, heldout_figures

STATE_FILE = "checkpoint/state.pt"
LOG_FILE = "train_drafter.log.jsonl"
REPORT_FILE = "train_drafter.json"
DRAFTER_DIR = "drafter"
OUTPUT_BLOCK = 16  # the written drafter's block_size: the largest evaluated K


@dataclass(frozen=True)
class Recipe:
    """Every knob of a run that changes the weights it ends with (docs/training.md gives each
    default's source). A resumed run must have the same recipe."""
    kind: str = "dflash"  # or "dflash2"
    layers: int = 5
    taps: int = 5  # target layers the encoder reads
    target_layer_ids: tuple[int, ...] | None = None  # instead of z-lab's spacing of `taps`
    window: int | None = None  # None: full attention (z-lab's DFlash); DFlash2 needs one
    mask_token: str | None = None  # default `<mask>`; none without a tokenizer: the last id
    blocks: tuple[int, ...] = (16,)  # K of each step, in turn
    gamma: float | None = 7.0  # position weights exp(-(i-1)/gamma); None: per-block demo gamma
    anchors_per_row: int = 512  # distinct anchors per row and step, at most
    batch_rows: int = 8  # rows per optimizer step, over all ranks
    lr: float = 6e-4
    schedule: str = "cosine"  # or "linear" (the demo recipes': linear warm-up and decay)
    warmup: float = 0.04  # fraction of the steps
    epochs: float = 6.0
    steps: int | None = None  # instead of epochs
    targets: str = "hard"  # or "soft": the target's top-k distribution
    soft_top_k: int = 16
    vocabulary: str = "full"  # "full", "corpus" or "topk"
    loss_top_k: int = 64  # the drafter's own top-k in the "topk" softmax
    selector_weight: float = 1.0  # DFlash2's selector loss
    conv_kernel: int = 4  # DFlash2
    conv_group: int = 16
    selector_rank: int = 64
    selector_top_k: int = 8
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.0
    clip: float = 1.0
    micro_blocks: int = 256  # blocks per forward/backward on one rank (memory, not maths)
    seed: int = 0


@dataclass
class DataOptions:
    """Where the rows come from (trainer_data.py)."""
    prompts: Path | None = None  # a prompts file; None: the built-in chat prompts
    eval_prompts: Path | None = None  # held-out prompts; None: the built-in evaluation set
    prompt_count: int = 2560  # built-in training prompts (or the file's first N)
    heldout_count: int = 48
    row_length: int = 512  # tokens per row: prompt + the target's reply
    random_prompts: int | None = None  # a target without tokenizer: random prompts
    random_prompt_length: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


# --- The drafter ------------------------------------------------------------------------------


def mask_token_id(target_dir: Path, name: str | None) -> int:
    tokenizer_file = Path(target_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        if name is not None:
            raise ValueError(f"--mask-token {name}: {target_dir} has no tokenizer.json")
        return check_configs(target_dir).target.vocab_size - 1
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    found = tokenizer.token_to_id(name or "<mask>")
    if found is None:
        raise ValueError(f"the target's tokenizer has no {name or '<mask>'} token: give "
                         "--mask-token, a token chats never produce (SmolLM2: <empty_output>)")
    return found


def layer_ids(depth: int, recipe: Recipe) -> list[int]:
    """The tapped target layers: given, or z-lab's spacing of `taps` (from 1 to depth - 3),
    or, for a target too shallow for it, `taps` spread from the second layer to the last."""
    from museflash.builtin.hf_tiny_pairs import zlab_target_layer_ids

    if recipe.target_layer_ids:
        return list(recipe.target_layer_ids)
    spaced = zlab_target_layer_ids(depth, recipe.taps) if depth >= recipe.taps + 3 else []
    if len(set(spaced)) == recipe.taps:
        return spaced
    return v1.spread_layer_ids(depth, min(recipe.taps, depth - 1))


def drafter_config(target_dir: Path, recipe: Recipe) -> dict[str, Any]:
    """z-lab's config.json for the recipe's drafter and the target in `target_dir`: a
    DFlashDraftModel (hf_tiny_pairs.zlab_drafter_config's keys; sliding layers when the recipe
    has a window) or a DFlash2DraftModel (train_demo_dflash2.dflash2_config)."""
    from museflash.builtin.hf_tiny_pairs import zlab_drafter_config

    target = check_configs(target_dir).target
    mask = mask_token_id(target_dir, recipe.mask_token)
    ids = layer_ids(target.num_hidden_layers, recipe)
    if recipe.kind == "dflash2":
        return v2.dflash2_config(target_dir, layers=recipe.layers, window=recipe.window or 32,
                                 kernel=recipe.conv_kernel, group=recipe.conv_group,
                                 rank=recipe.selector_rank, top_k=recipe.selector_top_k,
                                 target_layer_ids=ids, block_size=OUTPUT_BLOCK,
                                 mask_token_id=mask)
    if recipe.kind != "dflash":
        raise ValueError(f"drafter kind {recipe.kind!r}: dflash or dflash2")
    raw = target.raw
    thetas = [t for t in getattr(target, "layer_rope_theta", None) or [] if t]
    theta = getattr(target, "rope_theta", None) or (thetas[0] if thetas else 10000.0)
    shape = {"head_dim": target.head_dim, "hidden_size": target.hidden_size,
             "intermediate_size": target.intermediate_size,
             "max_position_embeddings": raw.get("max_position_embeddings", 8192),
             "num_attention_heads": target.num_attention_heads,
             "num_hidden_layers": target.num_hidden_layers,
             "num_key_value_heads": target.num_key_value_heads,
             "vocab_size": target.vocab_size}
    config = zlab_drafter_config(shape, mask, theta, recipe.layers)
    config["dflash_config"]["target_layer_ids"] = ids
    config["block_size"] = OUTPUT_BLOCK
    if recipe.window is not None:
        config.update(layer_types=[LayerType.SLIDING_ATTENTION.value] * recipe.layers,
                      sliding_window=recipe.window, use_sliding_window=True)
    return config


def write_initial(target_dir: Path, config: dict[str, Any], out_dir: Path, kind: str,
                  seed: int) -> Path:
    if kind == "dflash2":
        return v2.write_initial_dflash2(target_dir, config, out_dir, seed)
    return v1.write_initial_drafter(target_dir, config, out_dir, seed)


def write_drafter(target, drafter, config: dict[str, Any], out_dir: Path, kind: str) -> Path:
    """The trained drafter in z-lab's layout, bf16 (the encoder's weights from the fused
    target), written beside and then moved into place."""
    tensors = (v2.zlab_tensors(drafter, target.encoder) if kind == "dflash2"
               else drafter_checkpoint_tensors(drafter, target.encoder))
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_safetensors(tensors, partial, config, dtype="bf16")
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.replace(out_dir)
    return out_dir


# --- Which blocks a step trains on ------------------------------------------------------------


def total_steps(recipe: Recipe, rows: int) -> int:
    if recipe.steps is not None:
        return recipe.steps
    return max(1, math.ceil(recipe.epochs * max(1, rows // recipe.batch_rows)))


def step_rows(recipe: Recipe, rows: int, step: int) -> torch.Tensor:
    """The `batch_rows` rows of a step (global): consecutive slices of a per-epoch permutation
    seeded by (seed, epoch); the last incomplete slice of an epoch is dropped."""
    per_epoch = max(1, rows // recipe.batch_rows)
    epoch, slot = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(_seed(recipe.seed, 1, epoch))
    order = torch.randperm(rows, generator=generator, device="cpu")
    if rows < recipe.batch_rows:  # fewer rows than a batch: repeat the permutation
        order = order.repeat(-(-recipe.batch_rows // rows))
    return order[slot * recipe.batch_rows:(slot + 1) * recipe.batch_rows]


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)


def anchor_span(corpus, row: int, block: int) -> tuple[int, int]:
    """[low, high) of a row's anchors: generated positions whose whole block lies in the row;
    a row too short for the block keeps its last whole block (prompt labels included)."""
    length = corpus.tokens.shape[1]
    high = length - block + 1
    low = min(int(corpus.starts[row]), high - 1)
    return low, high


def row_anchors(recipe: Recipe, corpus, row: int, step: int, slot: int,
                block: int) -> torch.Tensor:
    """Up to `anchors_per_row` distinct anchors of `row`, sorted, drawn from a generator seeded
    by (seed, step, slot): the same on whichever rank the row lands."""
    low, high = anchor_span(corpus, row, block)
    generator = torch.Generator().manual_seed(_seed(recipe.seed, 2, step, slot))
    picked = torch.randperm(high - low, generator=generator, device="cpu")
    picked = picked[:recipe.anchors_per_row]
    return picked.sort().values + low


def anchor_count(recipe: Recipe, corpus, rows: torch.Tensor, block: int) -> int:
    return sum(min(recipe.anchors_per_row, high - low)
               for low, high in (anchor_span(corpus, int(r), block) for r in rows))


def learning_rate_factor(recipe: Recipe, total: int):
    """The schedule as a factor of `lr` by step: linear warm-up over `warmup` of the steps,
    then cosine to 0; or the demo recipes' linear warm-up and linear decay."""
    warm = max(1, round(recipe.warmup * total))

    def factor(step: int) -> float:
        if recipe.schedule == "linear":
            done = step / total
            return min(1.0, done * total / warm) * (1.0 - done)
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    if recipe.schedule not in ("cosine", "linear"):
        raise ValueError(f"schedule {recipe.schedule!r}: cosine or linear")
    return factor


# --- Checkpoints -----------------------------------------------------------------------------


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(recipe)))


def save_state(path: Path, step: int, recipe: Recipe, module: nn.Module, optimizer,
               scheduler, world: int) -> None:
    """Everything a resumed run needs to take the same next step: the trained weights, the
    optimizer's and the schedule's states, the RNG states, the step (the data position)."""
    state = {"step": step, "recipe": recipe_dict(recipe), "world": world,
             "params": {n: p.detach().clone() for n, p in module.named_parameters()
                        if p.requires_grad},
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                     "python": random.getstate()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)


def load_state(path: Path, recipe: Recipe, module: nn.Module, optimizer, scheduler) -> int:
    state = torch.load(path, weights_only=False)
    if state["recipe"] != recipe_dict(recipe):
        changed = sorted(k for k, v in recipe_dict(recipe).items() if state["recipe"].get(k) != v)
        raise ValueError(f"{path} was saved by a run with another recipe ({', '.join(changed)} "
                         "differ): resume with the same flags, or start another --output-dir")
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in state["params"].items():
            params[name].copy_(value)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return int(state["step"])


# --- Training --------------------------------------------------------------------------------


@dataclass
class Schedule:
    """When to stop, evaluate, save and log (none of it changes the weights)."""
    stop_after_steps: int | None = None  # save and stop there (a resumable piece)
    stop_after_seconds: float | None = None
    eval_every: int | None = None
    save_every: int | None = None
    log_every: int = 10
    eval_stride: int = 1


class JsonLog:
    """Rank 0's JSON lines log (one object a line) and progress printer."""

    def __init__(self, path: Path | None, ranks: ddp.Ranks, printer=print):
        self.path, self.ranks, self.printer = path, ranks, printer

    def event(self, kind: str, **values) -> None:
        if not self.ranks.main:
            return
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": kind, **values}) + "\n")

    def line(self, text: str) -> None:
        if self.ranks.main:
            self.printer(text)


def fit(target, drafter, rows, heldout, recipe: Recipe, ranks: ddp.Ranks, out: Path,
        schedule: Schedule, *, resume: bool = False, log: JsonLog) -> dict[str, Any]:
    """Trains the encoder and the drafter in place (embedding and lm_head frozen) and returns
    what happened: steps taken, whether it finished, the held-out figures, speeds."""
    module = BlockLoss(target, drafter, rows, gamma=recipe.gamma,
                       soft=recipe.targets == "soft", vocabulary=recipe.vocabulary,
                       top_k=recipe.loss_top_k, selector_weight=recipe.selector_weight)
    trained = v1.trained_parameters(target, drafter)
    for p in trained:
        p.requires_grad_(True)
    wrapped = module
    if ranks.backend is not None:
        wrapped = nn.parallel.DistributedDataParallel(
            module, device_ids=[ranks.device] if ranks.device.type == "cuda" else None,
            broadcast_buffers=False, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(trained, lr=recipe.lr, betas=recipe.betas,
                                  weight_decay=recipe.weight_decay)
    corpus = rows.corpus
    total = total_steps(recipe, corpus.tokens.shape[0])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_factor(recipe, total))
    if recipe.batch_rows % ranks.world:
        raise ValueError(f"--batch-rows {recipe.batch_rows} does not split over "
                         f"{ranks.world} ranks")
    per_rank = recipe.batch_rows // ranks.world
    state_path = out / STATE_FILE
    step = 0
    if resume and state_path.is_file():
        step = load_state(state_path, recipe, module, optimizer, scheduler)
        log.line(f"[train] resumed at step {step} of {total} from {state_path}")
        log.event("resume", step=step)
    report: dict[str, Any] = {"total_steps": total, "evaluations": []}

    def evaluate() -> None:
        if ranks.main and heldout is not None:
            figures = heldout_figures(target, drafter, heldout, stride=schedule.eval_stride)
            figures["step"] = step
            report["evaluations"].append(figures)
            log.event("eval", **figures)
            log.line(f"[eval] step {step}: top-1 at positions 1-4 "
                     + " ".join(f"{100 * v:.1f}%" for v in figures["top1"]) + "; acceptance "
                     + ", ".join(f"K={k} {100 * v:.1f}%"
                                 for k, v in figures["acceptance"].items()))
        ddp.barrier(ranks)

    if step == 0:
        evaluate()
    began, window_loss, window_tokens, window_rows = time.monotonic(), 0.0, 0, 0
    window_start, finished = time.monotonic(), False
    while True:
        if step >= total:
            finished = True
            break
        stop = schedule.stop_after_steps is not None and step >= schedule.stop_after_steps
        if schedule.stop_after_seconds is not None:
            stop = stop or ddp.any_rank(
                ranks, time.monotonic() - began >= schedule.stop_after_seconds)
        if stop:
            break
        block = recipe.blocks[step % len(recipe.blocks)]
        global_rows = step_rows(recipe, corpus.tokens.shape[0], step)
        count = anchor_count(recipe, corpus, global_rows, block)
        scale = ranks.world / count  # DDP averages over ranks: the global mean per block
        chunks = _chunks(recipe, corpus, global_rows, step, block, ranks.rank, per_rank)
        optimizer.zero_grad(set_to_none=True)
        local = 0.0
        for index, (chunk_rows, chunk_anchors) in enumerate(chunks):
            quiet = (wrapped.no_sync() if wrapped is not module and index < len(chunks) - 1
                     else contextlib.nullcontext())
            with quiet, v1.saved_tensor_copies(drafter):
                loss = wrapped(chunk_rows.to(ranks.device), chunk_anchors.to(ranks.device),
                               block)
                (loss * scale).backward()
            local += float(loss.detach())
        if recipe.clip:
            nn.utils.clip_grad_norm_(trained, recipe.clip)
        optimizer.step()
        scheduler.step()
        step += 1
        total_loss = float(ddp.sum_all(ranks, torch.tensor([local], dtype=torch.float64))[0])
        window_loss += total_loss / count
        window_tokens += count * (block - 1)
        window_rows += recipe.batch_rows
        if step % schedule.log_every == 0 or step == total:
            seconds = time.monotonic() - window_start
            steps_in = schedule.log_every if step % schedule.log_every == 0 else (
                step % schedule.log_every)
            values = {"step": step, "loss": window_loss / steps_in,
                      "lr": scheduler.get_last_lr()[0], "tokens_per_second":
                      window_tokens / seconds, "samples_per_second": window_rows / seconds,
                      "seconds": time.monotonic() - began}
            log.event("step", **values)
            log.line(f"[train] step {step}/{total} ({100 * step / total:.0f}%): loss "
                     f"{values['loss']:.4f}, lr {values['lr']:.2e}, "
                     f"{values['tokens_per_second']:.0f} drafted tokens/s, "
                     f"{values['samples_per_second']:.2f} rows/s")
            window_loss, window_tokens, window_rows = 0.0, 0, 0
            window_start = time.monotonic()
        if schedule.save_every and step % schedule.save_every == 0 and step < total:
            if ranks.main:
                save_state(state_path, step, recipe, module, optimizer, scheduler, ranks.world)
            ddp.barrier(ranks)
        if schedule.eval_every and step % schedule.eval_every == 0 and step < total:
            evaluate()
    if ranks.main:
        save_state(state_path, step, recipe, module, optimizer, scheduler, ranks.world)
    ddp.barrier(ranks)
    if finished and heldout is not None:
        evaluate()
    for p in trained:
        p.requires_grad_(False)
    report.update(steps=step, finished=finished, seconds=time.monotonic() - began)
    return report


def _chunks(recipe: Recipe, corpus, global_rows: torch.Tensor, step: int, block: int,
            rank: int, per_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's blocks of a step, in micro-batches of at most `micro_blocks` blocks (a row's
    anchors stay together unless they alone exceed it)."""
    chunks, rows_acc, anchors_acc, size = [], [], [], 0
    for slot in range(rank * per_rank, (rank + 1) * per_rank):
        row = int(global_rows[slot])
        anchors = row_anchors(recipe, corpus, row, step, slot, block)
        for first in range(0, len(anchors), recipe.micro_blocks):
            part = anchors[first:first + recipe.micro_blocks]
            if size and size + len(part) > recipe.micro_blocks:
                chunks.append((torch.cat(rows_acc), torch.cat(anchors_acc)))
                rows_acc, anchors_acc, size = [], [], 0
            rows_acc.append(torch.full_like(part, row))
            anchors_acc.append(part)
            size += len(part)
    if size:
        chunks.append((torch.cat(rows_acc), torch.cat(anchors_acc)))
    return chunks


# --- A whole run -----------------------------------------------------------------------------


def stage_target(target: Path, out: Path, ranks: ddp.Ranks) -> Path:
    """A Hugging Face folder as it is; a GGUF file read into one, OUT/target (rank 0)."""
    from museflash.checkpoint.gguf import GGUFCheckpoint, is_gguf, write_hf_checkpoint

    if not is_gguf(target):
        return Path(target)
    staged = out / "target"
    if ranks.main and not (staged / "config.json").is_file():
        shutil.rmtree(staged, ignore_errors=True)
        write_hf_checkpoint(GGUFCheckpoint(target), staged)
    ddp.barrier(ranks)
    return staged


def prompt_ids(target_dir: Path, options: DataOptions, mask: int, vocab: int,
               seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(training, held-out) prompts in ids, each leaving room for a reply in its row."""
    length = options.row_length
    if options.random_prompts:
        from museflash.training.distil_corpus import random_prompts

        size = options.random_prompt_length
        return (random_prompts(options.random_prompts, size, vocab, mask, seed),
                random_prompts(options.heldout_count, size, vocab, mask, seed + 1))
    if options.prompts is not None:
        conversations = data.read_prompts(options.prompts)
        if options.eval_prompts is None:  # the file's last prompts are held out
            if len(conversations) <= options.heldout_count:
                raise ValueError(f"{options.prompts}: {len(conversations)} prompts, not more "
                                 f"than the {options.heldout_count} held out: give "
                                 "--eval-prompts or more prompts")
            held = conversations[-options.heldout_count:]
            conversations = conversations[:-options.heldout_count]
        train = conversations[:options.prompt_count]
    else:
        train = data.builtin_conversations(options.prompt_count, seed, held_out=False)
    if options.eval_prompts is not None:
        held = data.read_prompts(options.eval_prompts)[:options.heldout_count]
    elif options.prompts is None:
        held = data.builtin_conversations(options.heldout_count, seed + 1, held_out=True)
    training = data.fitting(data.render(target_dir, train), length)
    heldout = data.fitting(data.render(target_dir, held), length)
    if not training or not heldout:
        raise ValueError(f"no prompt leaves {data.MIN_REPLY} tokens of a {length}-token row "
                         "for the reply: give a longer --row-length")
    return training, heldout


def run(out: Path, target: Path, recipe: Recipe, options: DataOptions, schedule: Schedule,
        *, resume: bool = False, device: str | None = None, printer=print) -> dict[str, Any]:
    """The whole run (the module docstring's steps); returns the report rank 0 writes."""
    ranks = ddp.start(device)
    try:
        return _run(Path(out), Path(target), recipe, options, schedule, ranks, resume, printer)
    finally:
        ddp.stop(ranks)


def _run(out: Path, target: Path, recipe: Recipe, options: DataOptions, schedule: Schedule,
         ranks: ddp.Ranks, resume: bool, printer) -> dict[str, Any]:
    wall = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    if (out / STATE_FILE).is_file() and not resume:
        raise ValueError(f"{out} holds a run already ({STATE_FILE}): give --resume to go on "
                         "with it, or another --output-dir")
    log = JsonLog(out / LOG_FILE, ranks, printer)
    torch.manual_seed(recipe.seed)
    target_dir = stage_target(target, out, ranks)
    config = drafter_config(target_dir, recipe)
    initial = out / "initial"
    if ranks.main and not (initial / "config.json").is_file():
        write_initial(target_dir, config, initial, recipe.kind, recipe.seed)
    ddp.barrier(ranks)
    length = options.row_length
    target_model, drafter = load_pair(
        target_dir, initial, max_context=-(-length // 32) * 32,
        max_query=max(length, OUTPUT_BLOCK), drafter_cache_dtype=torch.float16)
    mask = drafter.config.mask_token_id
    training, held = prompt_ids(target_dir, options, mask, target_model.config.vocab_size,
                                recipe.seed)
    soft = recipe.soft_top_k if recipe.targets == "soft" else None
    key = {"target": data.checkpoint_digest(target_dir), "length": length,
           "capture": str(data.CAPTURE_DTYPE), "taps": list(drafter.config.target_layer_ids)}
    made = {}
    for name, prompts, top_k in (("train", training, soft), ("heldout", held, None)):
        rows_key = {**key, "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
                    "soft_top_k": top_k}
        path = out / "data" / f"{name}.pt"
        if ranks.main:
            data.cached_rows(path, rows_key, lambda p=prompts, k=top_k: data.make_rows(
                target_model, p, length, k), log.line)
        ddp.barrier(ranks)
        made[name], seconds = data.cached_rows(path, rows_key, None, lambda _line: None)
        log.event("data", name=name, rows=len(prompts), seconds=seconds)
    rows, heldout = made["train"], made["heldout"].corpus
    if ranks.device.type == "cuda":  # untested here: no GPU on this machine
        torch.set_default_device(ranks.device)
        target_model.to(ranks.device)
        drafter.to(ranks.device)
        rows.corpus = type(rows.corpus)(*(t.to(ranks.device) for t in (
            rows.corpus.tokens, rows.corpus.captured, rows.corpus.starts)))
    log.event("start", recipe=recipe_dict(recipe), world=ranks.world, backend=ranks.backend,
              device=str(ranks.device), rows=len(training), heldout=len(held),
              config=config)
    log.line(f"[train] {recipe.kind} drafter, {recipe.layers} layers, taps "
             f"{list(drafter.config.target_layer_ids)}; {len(training)} rows of {length} "
             f"tokens, {len(held)} held out; {ranks.world} rank(s) on {ranks.device}"
             + (f" ({ranks.backend})" if ranks.backend else ""))
    report = fit(target_model, drafter, rows, heldout, recipe, ranks, out, schedule,
                 resume=resume, log=log)
    if ranks.main:
        report.update(recipe=recipe_dict(recipe), world=ranks.world, device=str(ranks.device),
                      rows=len(training), heldout_rows=len(held), row_length=length,
                      wall_seconds=time.monotonic() - wall, drafter_config=config)
        if report["finished"]:
            report["drafter_dir"] = str(write_drafter(target_model, drafter, config,
                                                      out / DRAFTER_DIR, recipe.kind))
        (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    ddp.barrier(ranks)
    return report
