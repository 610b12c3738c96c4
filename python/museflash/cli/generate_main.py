"""museflash generate: text in, text out over an export, with speculative decoding.

  ./bazelw run //:generate -- --export-dir exported --prompt 'def fibonacci(n):'
      [--max-new-tokens N] [--temperature T] [--top-p P] [--no-draft] [--seed S]
      [--backend export|eager] [--lookup-min-match N] [--tree-budget N] [--format text|json]
  ./bazelw run //:generate -- --export-dir exported (--messages FILE.json | --chat)
      [--system TEXT] [--on-context-full refuse|drop-oldest] [--format text|json] ...

Chat (runtime/chat.py): the bundle's chat template renders the conversation and one session
keeps both caches between turns. `--messages` takes a JSON list of {"role", "content"}: each
user message that no assistant message follows gets a reply, in order. `--chat` reads one user
message per line of standard input. With `--format json` the output is one JSON object whose
`turns` hold each reply's prompt_ids, tokens, prefilled_tokens and time_to_first_token_seconds.

Streams the text as the target accepts it, then prints the figures (tokens per target call,
accepted drafts per step, wall time against the target alone). The default backend runs the
exported packages with the numpy ML-program interpreter; `eager` runs the same loop on the
torch models rebuilt from the export's source checkpoints. Relative paths resolve against the
directory Bazel was run from.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from absl import flags, logging

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.runtime.choices import BACKENDS, CONTEXT_POLICIES, DEFAULT_LOOKUP_MIN_MATCH, REFUSE

# The runtime (and torch) load in main, once the flags are known to be good: --help and a
# mistyped flag answer at once.
if TYPE_CHECKING:
    from museflash.runtime.generate import GenerateOptions

flags.DEFINE_string("export-dir", "exported", "Export directory (holds metadata.json).")
flags.DEFINE_string("prompt", None, "Text to continue.")
flags.DEFINE_integer("max-new-tokens", 64, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
flags.DEFINE_float("top-p", 1.0, "Nucleus sampling mass, in (0, 1].")
flags.DEFINE_bool("draft", True, "Use the drafter (--no-draft: the target alone).")
flags.DEFINE_integer("seed", 0, "Seed of the sampler.")
flags.DEFINE_enum("backend", "export", list(BACKENDS),
                  "export: the exported packages (numpy interpreter); eager: torch modules.")
flags.DEFINE_bool("compare", True, "Also time the target alone for the speed-up figure.")
flags.DEFINE_integer("lookup-min-match", DEFAULT_LOOKUP_MIN_MATCH,
                     "A step whose last N tokens occurred before proposes a copy of what "
                     "followed them instead of a draft; 0: draft every step.")

flags.DEFINE_integer("tree-budget", 0,
                     "Verify trees of up to N nodes of candidates (the drafter's, the target's "
                     "recycled ones, lookup's) through the bundle's `tree` function instead of "
                     "the drafter's chain; greedy only; 0: the chain (docs/trees.md).")

flags.DEFINE_string("messages", None, "A conversation, a JSON list of {role, content}: "
                    "reply to each user message no assistant message follows.")
flags.DEFINE_bool("chat", False, "Chat: one user message per line of standard input.")
flags.DEFINE_string("system", None, "The system prompt of --messages or --chat.")
flags.DEFINE_enum("on-context-full", REFUSE, list(CONTEXT_POLICIES),
                  "A history that outgrows the context: refuse, or drop the oldest turns.")
flags.DEFINE_enum("format", "text", ["text", "json"], "json: one JSON object on stdout.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"generate: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    logging.set_verbosity(logging.ERROR)
    chatting = FLAGS.messages is not None or FLAGS.chat
    given = [name for name, on in (("--prompt", FLAGS.prompt is not None),
                                   ("--messages", FLAGS.messages is not None),
                                   ("--chat", FLAGS.chat)) if on]
    if len(given) != 1:
        print("generate: error: give exactly one of --prompt (text to continue), --messages "
              f"FILE.json or --chat{' (got ' + ', '.join(given) + ')' if given else ''}",
              file=sys.stderr)
        return 2
    if FLAGS.system is not None and not chatting:
        print("generate: error: --system is the system prompt of --messages or --chat",
              file=sys.stderr)
        return 2
    from museflash.checkpoint.tensor_files import CheckpointError
    from museflash.runtime.chat import ChatError
    from museflash.runtime.generate import GenerateError, GenerateOptions, generate

    options = GenerateOptions(
        export_dir=resolve_user_path(FLAGS["export-dir"].value),
        prompt=FLAGS.prompt or "",
        max_new_tokens=FLAGS["max-new-tokens"].value,
        temperature=FLAGS.temperature,
        top_p=FLAGS["top-p"].value,
        draft=FLAGS.draft,
        seed=FLAGS.seed,
        backend=FLAGS.backend,
        compare=FLAGS.compare,
        lookup_min_match=FLAGS["lookup-min-match"].value,
        tree_budget=FLAGS["tree-budget"].value,
        system=FLAGS.system,
        on_context_full=FLAGS["on-context-full"].value,
    )
    as_json = FLAGS.format == "json"

    if options.backend == "eager":
        import torch

        # One sequence decodes through small matmuls: a second thread only adds pool wake-ups
        # (measured: 100x slower per call on a loaded 2-core machine).
        torch.set_num_threads(1)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def say(line: str) -> None:
        print(line, file=sys.stderr if as_json else sys.stdout)

    try:
        if chatting:
            return _chat(options, as_json, write, say)
        run = generate(options, (lambda _: None) if as_json else write, say)
    except (GenerateError, CheckpointError, ChatError) as error:
        print(f"generate: error: {error}", file=sys.stderr)
        return 2
    if as_json:
        result = run.result
        print(json.dumps({"tokens": result.tokens, "text": run.text, "accepted": result.accepted,
                          "target_calls": result.target_calls, "seconds": run.seconds}))
    return 0


def _chat(options: GenerateOptions, as_json: bool, write, say) -> int:
    """--messages or --chat; the replies stream as text, or one JSON object at the end."""
    from museflash.runtime.chat import read_messages
    from museflash.runtime.generate import open_chat, turn_summary

    script = read_messages(resolve_user_path(FLAGS.messages)) if FLAGS.messages else None
    chat = open_chat(options)
    show = None if as_json else write
    turns = []
    if script is not None:
        for turn in chat.run_script(script, on_text=show):
            turns.append(turn)
            _end_reply(show)
            say(turn_summary(len(turns) - 1, turn))
    else:
        for line in sys.stdin:
            if not line.strip():
                continue
            turn = chat.say(line.rstrip("\n"), on_text=show)
            turns.append(turn)
            _end_reply(show)
            say(turn_summary(len(turns) - 1, turn))
    if as_json:
        print(json.dumps({"turns": [turn.to_json() for turn in turns],
                          "messages": chat.messages, "backend": options.backend,
                          "drafter": options.draft}, ensure_ascii=False))
    return 0


def _end_reply(write) -> None:
    if write is not None:
        write("\n")


def run() -> None:
    run_command(main, "generate")


if __name__ == "__main__":
    run()
