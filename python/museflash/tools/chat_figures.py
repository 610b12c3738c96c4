"""Chat sessions against re-prefilling the whole history, side by side in one run.

  ./bazelw run //:chat_figures -- --export-dir DIR [--history-tokens 1000] [--repeats 2]
      [--max-new-tokens 48] [--backend interpreter]

Two figures, both from `swift-generate --messages FILE --format json` (the Swift engine's
ChatSession), greedy:

- **Turn-2 time to first token.** Turn 1 asks about a long document (held-out standard-library
  source, cut so that turn 2's history is about `--history-tokens` tokens); turn 2 asks a short
  follow-up. The session run has both user turns in one file, so turn 2 prefills only what its
  caches lack. The from-scratch run gives turn 1's reply as an assistant message, so its one
  reply prefills the whole history. Runs alternate, `--repeats` times each; medians.
- **Acceptance per turn over five turns** (held-out chat prompts, EVAL_PROMPTS): the session's
  turns against each turn decoded from scratch over the same history. The session's drafter
  ring holds the features of everything said so far, as `main` computed them; from scratch,
  `prefill` computes them again. Does the kept ring help or hurt?

Both sides must decode the same tokens from the same prompt ids, or the tool stops: a speed
figure of a different answer means nothing. Times drift on a shared machine, so compare within
one run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from museflash.bundle import BundleError, Metadata
from museflash.runtime.generate import GenerateError, TextTokenizer
from museflash.training.chat_prompts import EVAL_PROMPTS

FOLLOW_UP = "Which function in it would you test first, and why? Answer in two sentences."
FIVE_TURNS = (EVAL_PROMPTS[0], EVAL_PROMPTS[5], EVAL_PROMPTS[7], EVAL_PROMPTS[13],
              EVAL_PROMPTS[15])


class FiguresError(RuntimeError):
    pass


def document(tokenizer: TextTokenizer, tokens: int) -> str:
    """The first `tokens` tokens of the held-out standard-library files, as text."""
    from museflash.training.train_demo import load_corpus
    ids: list[int] = []
    for source in load_corpus().held_out:
        ids.extend(tokenizer.encode(source.text))
        if len(ids) >= tokens:
            break
    return tokenizer.decode(ids[:tokens])


def converse(binary: Path, export_dir: Path, messages: list[dict[str, str]], max_new_tokens: int,
             backend: str) -> list[dict]:
    """The turns `swift-generate --messages` reports for `messages`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(messages, handle)
        path = handle.name
    try:
        done = subprocess.run(
            [str(binary), "--export-dir", str(export_dir), "--messages", path, "--format", "json",
             "--max-new-tokens", str(max_new_tokens), "--backend", backend,
             "--no-tree"],  # the drafter's chain, whose acceptance per turn is the figure
            capture_output=True, text=True, check=False)
    except OSError as error:
        raise FiguresError(f"--swift-generate {binary} cannot be run ({error.strerror}); run "
                           "through ./bazelw run //:chat_figures, which passes it") from error
    finally:
        Path(path).unlink()
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FiguresError(f"swift-generate failed: {last}")
    return json.loads(done.stdout)["turns"]


def same(kept: dict, fresh: dict, what: str) -> None:
    if kept["prompt_ids"] != fresh["prompt_ids"] or kept["tokens"] != fresh["tokens"]:
        raise FiguresError(f"{what}: the session and the from-scratch decode differ "
                           "(prompt ids or tokens); fix that before measuring")


def time_to_first_token(binary: Path, export_dir: Path, tokenizer: TextTokenizer,
                        history_tokens: int, max_new_tokens: int, repeats: int,
                        backend: str) -> None:
    budget = history_tokens - max_new_tokens - 40  # turn 1's reply and the template's tokens
    question = "Here is a Python module:\n\n{}\n\nWhat does it do? Answer briefly."
    first = {"role": "user", "content": question.format(document(tokenizer, budget))}
    second = {"role": "user", "content": FOLLOW_UP}
    kept_times, fresh_times = [], []
    for _ in range(repeats):
        kept = converse(binary, export_dir, [first, second], max_new_tokens, backend)
        reply = {"role": "assistant", "content": kept[0]["text"]}
        fresh = converse(binary, export_dir, [first, reply, second], max_new_tokens, backend)
        same(kept[1], fresh[0], "turn 2")
        kept_times.append(kept[1]["time_to_first_token_seconds"])
        fresh_times.append(fresh[0]["time_to_first_token_seconds"])
    kept_ttft, fresh_ttft = statistics.median(kept_times), statistics.median(fresh_times)
    print(f"turn 2 of 2: {len(kept[1]['prompt_ids'])} history tokens ({backend}, median of "
          f"{repeats} alternating runs each)")
    print("| turn 2 | prefilled tokens | time to first token (s) |")
    print("| --- | --- | --- |")
    print(f"| session (caches kept) | {kept[1]['prefilled_tokens']} | {kept_ttft:.2f} |")
    print(f"| whole history re-prefilled | {fresh[0]['prefilled_tokens']} | {fresh_ttft:.2f} |")
    print(f"session / re-prefill: {kept_ttft / fresh_ttft:.3f}x")


def accepted_length(turn: dict) -> float:
    """Drafted tokens accepted per verify step (`main` call); prefill calls do not count."""
    steps = turn["accepted"]
    return sum(steps) / len(steps) if steps else 0.0


def acceptance_per_turn(binary: Path, export_dir: Path, max_new_tokens: int,
                        backend: str) -> None:
    users = [{"role": "user", "content": text} for text in FIVE_TURNS]
    kept = converse(binary, export_dir, users, max_new_tokens, backend)
    if len(kept) != len(users):
        raise FiguresError(f"the session replied {len(kept)} times to {len(users)} user turns")
    history: list[dict[str, str]] = []
    print(f"\nfive turns, {max_new_tokens} new tokens at most each ({backend}): mean accepted "
          "length per verify step, the session's against each turn decoded from scratch over "
          "the same history")
    print("| turn | history tokens | new tokens | verify steps | session: prefilled, accepted "
          "length | from scratch: prefilled, accepted length |")
    print("| --- | --- | --- | --- | --- | --- |")
    steps = {"kept": [], "fresh": []}
    for index, (user, turn) in enumerate(zip(users, kept, strict=True)):
        history.append(user)
        (fresh,) = converse(binary, export_dir, history, max_new_tokens, backend)
        same(turn, fresh, f"turn {index + 1}")
        history.append({"role": "assistant", "content": turn["text"]})
        steps["kept"] += turn["accepted"]
        steps["fresh"] += fresh["accepted"]
        print(f"| {index + 1} | {len(turn['prompt_ids'])} | {len(turn['tokens'])} | "
              f"{len(turn['accepted'])} | {turn['prefilled_tokens']}, {accepted_length(turn):.2f} "
              f"| {fresh['prefilled_tokens']}, {accepted_length(fresh):.2f} |")
    kept_mean = statistics.mean(steps["kept"]) if steps["kept"] else 0.0
    fresh_mean = statistics.mean(steps["fresh"]) if steps["fresh"] else 0.0
    print(f"all turns: mean accepted length {kept_mean:.3f} with the session, {fresh_mean:.3f} "
          f"from scratch ({1 + kept_mean:.3f} and {1 + fresh_mean:.3f} tokens per verify step)")


def figures(export_dir: Path, binary: Path, history_tokens: int, max_new_tokens: int,
            repeats: int, backend: str) -> None:
    try:
        metadata = Metadata.read(export_dir)
        tokenizer = TextTokenizer(export_dir, metadata)
    except (BundleError, GenerateError) as error:
        raise FiguresError(str(error)) from error
    if history_tokens + max_new_tokens > metadata.context_length:
        raise FiguresError(
            f"--history-tokens {history_tokens} plus --max-new-tokens {max_new_tokens} exceed "
            f"the export's context of {metadata.context_length}; export with "
            f"--max-context-length {history_tokens + max_new_tokens} or more")
    time_to_first_token(binary, export_dir, tokenizer, history_tokens, max_new_tokens, repeats,
                        backend)
    acceptance_per_turn(binary, export_dir, max_new_tokens, backend)
