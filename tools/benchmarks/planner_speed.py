"""The engine's choice of steps against a bundle exported without a drafter, on held-out chat
prompts, side by side in one run (docs/trees.md, "Speed with the choice").

  PYTHONPATH=python VENV_PYTHON tools/benchmarks/planner_speed.py \
      --mode 'solo|BIN|SOLO_DIR|--no-draft' --mode 'default|BIN|DEFAULT_DIR|' \
      --mode 'solo2|BIN|SOLO_DIR|--no-draft' --mode 'recommended|BIN|REC_DIR|' \
      [--max-new-tokens 64] [--repeats 1] [--json OUT.json]

Each --mode is `label|swift-generate binary|export dir|extra flags` (flags split on spaces).
Every prompt below (written for this benchmark: neither training/chat_prompts.py's evaluation
prompts nor its templates' kinds) is rendered with the first bundle's chat template and
decoded greedily by every mode in the order given, prompt by prompt, so drift on a shared
machine falls on all modes alike; give the baseline twice to see the drift. A mode's speed is
its tokens per second over the decoding (the prompt's `prefill` calls apart); the table sets
each against the first mode's on the same prompt. With --repeats N every prompt goes through
all the modes N times in turn and a mode's figure on it is the median of its N; the first
mode's spread over its N (largest over smallest) is the machine's drift at that prompt. It
names the modes whose tokens differ from
it (greedy decoding gives the target's own tokens whatever the steps; bundles exported apart
may still part at an fp16 near-tie).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from museflash.checkpoint.chat_template import user_turn_ids

PROMPTS = (
    "Describe how the gears on a bicycle help a rider climb a steep hill.",
    "Write a short product description for a reusable steel water bottle.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "I need a small Python script that counts how many vowels are in a sentence. Can you write it?",
    "How does a refrigerator keep the food inside it cold?",
    "Suggest a name and a slogan for a small neighborhood bakery.",
    "List the steps to change a flat tire on a car.",
    "My tomato plants have yellow leaves. What could be wrong?",
)


def run(binary: str, export_dir: str, flags: list[str], ids: list[int], new_tokens: int) -> dict:
    command = [binary, "--export-dir", export_dir, "--prompt-ids", ",".join(map(str, ids)),
               "--max-new-tokens", str(new_tokens), "--format", "json", "--no-compare", *flags]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"planner_speed: {' '.join(command[:3])} ... failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


def decode_speed(report: dict) -> float:
    """Tokens per second over the decoding: the run's seconds without its prefill calls."""
    prefill = report["functions"].get("prefill", {}).get("seconds", 0.0)
    return len(report["tokens"]) / (report["seconds"] - prefill)


def step_seconds(times: dict) -> float:
    return sum(t["steps"] * t["ms_per_step"] / 1000 for t in times.values())


def planner_line(reports: list[dict]) -> str | None:
    """The planner's expected tokens/s for the kind it led with when the run ended, beside what
    that kind's steps delivered, and what all the run's steps delivered (catching up included)."""
    cells = []
    for report in reports:
        expected, times = report.get("expected_tokens_per_second"), report.get("step_times", {})
        if not expected or not times:
            continue
        best = max(expected, key=expected.get)
        own = times[best]["tokens"] / step_seconds({best: times[best]})
        steps = step_seconds(times) + report.get("catch_up_seconds", 0)
        whole = sum(t["tokens"] for t in times.values()) / steps
        cells.append(f"{best} {expected[best]:.1f}: {own:.1f} ({own / expected[best]:.2f}), "
                     f"all steps {whole:.1f} ({whole / expected[best]:.2f})")
    return "; ".join(cells) if cells else None


def host_line(reports: list[dict]) -> str | None:
    """ms per tree step: whole, model calls, host and the host's parts, over every tree step."""
    tree = [r["step_times"]["tree"] for r in reports if "tree" in r.get("step_times", {})]
    if not tree:
        return None
    steps = sum(t["steps"] for t in tree)
    parts: dict[str, float] = {}
    for t in tree:
        for part, ms in t["host_ms_per_step_by_part"].items():
            parts[part] = parts.get(part, 0.0) + ms * t["steps"]
    whole, calls, host = (sum(t[key] * t["steps"] for t in tree) / steps
                          for key in ("ms_per_step", "call_ms_per_step", "host_ms_per_step"))
    split = ", ".join(f"{part} {ms / steps:.2f}" for part, ms in sorted(parts.items()))
    return (f"{steps} tree steps, {whole:.1f} ms a step: model calls {calls:.1f}, "
            f"host {host:.1f} ({100 * host / whole:.1f}%): {split}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", action="append", required=True,
                        help="label|binary|export dir|flags")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="write every report here")
    args = parser.parse_args()
    modes = []
    for text in args.mode:
        label, binary, export_dir, flags = text.split("|")
        modes.append((label, binary, export_dir, flags.split()))
    labels = [label for label, *_ in modes]
    ids = user_turn_ids(Path(modes[0][2]), list(PROMPTS[:args.prompts]))
    if ids is None:
        sys.exit(f"planner_speed: {modes[0][2]} has no chat template")
    reports: dict[str, list[dict]] = {label: [] for label in labels}
    repeated: dict[str, list[list[float]]] = {label: [] for label in labels}
    base = labels[0]
    for index, prompt in enumerate(ids):
        for label in labels:
            repeated[label].append([])
        for _ in range(args.repeats):
            for label, binary, export_dir, flags in modes:
                report = run(binary, export_dir, flags, prompt, args.max_new_tokens)
                reports[label].append(report)
                repeated[label][-1].append(decode_speed(report))
                print(f"prompt {index + 1} {label}: {len(report['tokens'])} tokens, "
                      f"{decode_speed(report):.2f} tokens/s, steps {report.get('steps', {})}",
                      file=sys.stderr, flush=True)
        differ = [label for label in labels
                  if reports[label][-1]["tokens"] != reports[base][-1]["tokens"]]
        if differ:
            # Bundles exported apart may part at a near-tie in fp16; the same bundle never may.
            print(f"planner_speed: prompt {index + 1}: {', '.join(differ)} decoded other "
                  f"tokens than {base}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    print(f"{len(ids)} prompts x {args.max_new_tokens} new tokens, greedy, {args.repeats} "
          f"time(s) each; tokens/s over the decoding (prefill apart), against {base}")
    speed = {label: [statistics.median(runs) for runs in repeated[label]] for label in labels}
    print("| prompt | " + " | ".join(labels) + f" | drift of {base} |")
    print("| --- |" + " --- |" * (len(modes) + 1))
    for index in range(len(ids)):
        reference = speed[base][index]
        cells = [f"{speed[label][index]:.1f} ({speed[label][index] / reference:.2f}x)"
                 for label in labels]
        drift = max(repeated[base][index]) / min(repeated[base][index])
        print(f"| {index + 1} | " + " | ".join(cells) + f" | {drift:.2f} |")
    ratios = {label: [s / b for s, b in zip(speed[label], speed[base], strict=True)]
              for label in labels}
    print("| mean ratio | " + " | ".join(f"{statistics.mean(ratios[label]):.3f}x"
                                          for label in labels) + " | |")
    print("| min ratio | " + " | ".join(f"{min(ratios[label]):.3f}x" for label in labels) + " | |")
    pooled = [sum(len(r["tokens"]) for r in reports[label])
              / sum(len(r["tokens"]) / decode_speed(r) for r in reports[label]) for label in labels]
    print("| pooled tokens/s | " + " | ".join(f"{value:.2f}" for value in pooled) + " | |")
    for label in labels:
        if (line := planner_line(reports[label])) is not None:
            print(f"{label}: expected tokens/s, delivered by its kind's steps: {line}")
        if (line := host_line(reports[label])) is not None:
            print(f"{label}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
