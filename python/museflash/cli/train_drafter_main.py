"""museflash train_drafter: train a DFlash or DFlash2 drafter for any supported target, in one
process or under torchrun (docs/training.md).

  ./bazelw run //:train_drafter -- --target DIR_OR_GGUF --output-dir OUT [--resume] ...
  torchrun --nproc_per_node N -m museflash.cli.train_drafter_main --target ... --output-dir OUT

Writes OUT/drafter (z-lab's layout, what `//:export --drafter-checkpoint` takes),
OUT/train_drafter.json, OUT/train_drafter.log.jsonl and OUT/checkpoint/state.pt (training/
trainer.py says how). Relative paths resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning (see training/train_demo.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import sys  # noqa: E402

import torch  # noqa: E402
from absl import flags  # noqa: E402

from museflash.cli.command import run_command  # noqa: E402
from museflash.paths import resolve_user_path  # noqa: E402
from museflash.training import trainer  # noqa: E402

D = trainer.Recipe()
flags.DEFINE_string("target", None, "The target: a Hugging Face folder or a .gguf file.")
flags.DEFINE_string("output-dir", None, "Where the drafter, checkpoints, data and logs go.")
flags.DEFINE_bool("resume", False, "Go on from OUTPUT-DIR/checkpoint/state.pt.")
flags.DEFINE_enum("kind", D.kind, ["dflash", "dflash2"], "The drafter's architecture.")
flags.DEFINE_integer("layers", D.layers, "Drafter layers.")
flags.DEFINE_integer("taps", D.taps, "Target layers the drafter reads (z-lab's spacing).")
flags.DEFINE_list("target-layer-ids", None, "The tapped target layers, instead of --taps.")
flags.DEFINE_integer("window", None, "Sliding window of the drafter's layers (default: full "
                     "attention for DFlash, 32 for DFlash2).")
flags.DEFINE_string("mask-token", None, "The mask token's text (default <mask>).")
flags.DEFINE_list("blocks", [str(k) for k in D.blocks], "Block sizes K of the steps, in turn.")
flags.DEFINE_float("gamma", D.gamma, "Position weights exp(-(i-1)/gamma); 0: the demo recipes' "
                   "gamma per block size.")
flags.DEFINE_integer("anchors-per-row", D.anchors_per_row, "Distinct anchors per row per step.")
flags.DEFINE_integer("batch-rows", D.batch_rows, "Rows per optimizer step, over all ranks.")
flags.DEFINE_float("lr", D.lr, "Peak learning rate.")
flags.DEFINE_enum("schedule", D.schedule, ["cosine", "linear"], "Learning-rate decay.")
flags.DEFINE_float("warmup", D.warmup, "Warm-up, as a fraction of the steps.")
flags.DEFINE_float("epochs", D.epochs, "Passes over the rows (ignored with --steps).")
flags.DEFINE_integer("steps", None, "Optimizer steps, instead of --epochs.")
flags.DEFINE_enum("targets", D.targets, ["hard", "soft"], "The target's tokens, or its top-k "
                  "distribution.")
flags.DEFINE_integer("soft-top-k", D.soft_top_k, "Probabilities kept per token for soft targets.")
flags.DEFINE_enum("vocabulary", D.vocabulary, ["full", "corpus", "topk"], "The loss's softmax: "
                  "the whole vocabulary, the corpus's tokens, or each position's label, soft ids "
                  "and the drafter's own top-k.")
flags.DEFINE_integer("loss-top-k", D.loss_top_k, "The drafter's top-k in --vocabulary topk.")
flags.DEFINE_float("selector-weight", D.selector_weight, "DFlash2: the selector loss's weight.")
flags.DEFINE_integer("micro-blocks", D.micro_blocks, "Blocks per forward/backward (memory).")
flags.DEFINE_integer("seed", D.seed, "Seed of initialisation, data order and anchors.")
flags.DEFINE_string("prompts", None, "Prompts file (.jsonl chat messages, or text lines); "
                    "default: the built-in chat prompts.")
flags.DEFINE_string("eval-prompts", None, "Held-out prompts file (default: the built-in "
                    "evaluation prompts, or the last --heldout prompts of --prompts).")
flags.DEFINE_integer("prompt-count", 2560, "Training prompts (at most).")
flags.DEFINE_integer("heldout", 48, "Held-out prompts.")
flags.DEFINE_integer("row-length", 512, "Tokens per row: prompt and the target's reply.")
flags.DEFINE_integer("random-prompts", None, "For a target without tokenizer: this many "
                     "random prompts.")
flags.DEFINE_integer("stop-after-steps", None, "Save and stop at this step (resume later).")
flags.DEFINE_float("stop-after-seconds", None, "Save and stop after this long (resume later).")
flags.DEFINE_integer("eval-every", 500, "Held-out evaluation every N steps (0: at the ends).")
flags.DEFINE_integer("save-every", 500, "Checkpoint every N steps.")
flags.DEFINE_integer("log-every", 10, "Progress line every N steps.")
flags.DEFINE_integer("eval-stride", 2, "Evaluate every N-th anchor of the held-out rows.")
flags.DEFINE_string("device", None, "cpu or cuda (default: cuda when there is one).")
flags.DEFINE_integer("threads", None, "torch CPU threads per rank (default: cores / ranks).")

FLAGS = flags.FLAGS
NAME = "train_drafter"


def _error(message: str) -> int:
    print(f"{NAME}: error: {message}", file=sys.stderr)
    return 2


def recipe_from_flags() -> trainer.Recipe:
    """The recipe the flags give; ValueError names a bad flag."""
    try:
        blocks = tuple(int(k) for k in FLAGS.blocks)
        ids = tuple(int(i) for i in FLAGS["target-layer-ids"].value or ())
    except ValueError as error:
        raise ValueError(f"--blocks and --target-layer-ids take integers ({error})") from None
    if not blocks or any(not 2 <= k <= trainer.OUTPUT_BLOCK for k in blocks):
        raise ValueError(f"--blocks: block sizes from 2 to {trainer.OUTPUT_BLOCK}")
    return trainer.Recipe(
        kind=FLAGS.kind, layers=FLAGS.layers, taps=FLAGS.taps, target_layer_ids=ids or None,
        window=FLAGS.window, mask_token=FLAGS["mask-token"].value, blocks=blocks,
        gamma=FLAGS.gamma or None, anchors_per_row=FLAGS["anchors-per-row"].value,
        batch_rows=FLAGS["batch-rows"].value, lr=FLAGS.lr, schedule=FLAGS.schedule,
        warmup=FLAGS.warmup, epochs=FLAGS.epochs, steps=FLAGS.steps, targets=FLAGS.targets,
        soft_top_k=FLAGS["soft-top-k"].value, vocabulary=FLAGS.vocabulary,
        loss_top_k=FLAGS["loss-top-k"].value, selector_weight=FLAGS["selector-weight"].value,
        micro_blocks=FLAGS["micro-blocks"].value, seed=FLAGS.seed)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        return _error(f"unexpected arguments {argv[1:]}; all options are --flags")
    if FLAGS.target is None or FLAGS["output-dir"].value is None:
        return _error("--target and --output-dir are required")
    try:
        recipe = recipe_from_flags()
    except ValueError as error:
        return _error(str(error))
    options = trainer.DataOptions(
        prompts=resolve_user_path(FLAGS.prompts),
        eval_prompts=resolve_user_path(FLAGS["eval-prompts"].value),
        prompt_count=FLAGS["prompt-count"].value, heldout_count=FLAGS.heldout,
        row_length=FLAGS["row-length"].value, random_prompts=FLAGS["random-prompts"].value)
    schedule = trainer.Schedule(
        stop_after_steps=FLAGS["stop-after-steps"].value,
        stop_after_seconds=FLAGS["stop-after-seconds"].value,
        eval_every=FLAGS["eval-every"].value or None, save_every=FLAGS["save-every"].value,
        log_every=FLAGS["log-every"].value, eval_stride=FLAGS["eval-stride"].value)
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(FLAGS.threads or max(1, (os.cpu_count() or 1) // world))
    torch.set_flush_denormal(True)
    try:
        trainer.run(resolve_user_path(FLAGS["output-dir"].value), resolve_user_path(FLAGS.target),
                    recipe, options, schedule, resume=FLAGS.resume, device=FLAGS.device)
    except ValueError as error:
        return _error(str(error))
    return 0


def run() -> None:
    run_command(main, NAME)


if __name__ == "__main__":
    run()
