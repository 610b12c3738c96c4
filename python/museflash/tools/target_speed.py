"""The Swift engine's target alone against transformers' greedy `generate`, side by side in one run.

  ./bazelw run //:target_speed -- --export-dir E [--export-dir E2 ...]
      [--max-new-tokens 32] [--prompts 16] [--threads 2]

What a Linux user would reach for instead of this project: transformers' own `generate` over the
checkpoint the bundles were exported from (fp32, `--threads` torch threads), against
`swift-generate --no-draft` (the Swift interpreter, no lookup) on each bundle. Each held-out chat
prompt (`EVAL_PROMPTS`) is rendered with the bundle's chat template; per prompt every bundle
decodes it, then transformers decodes as many tokens from the same ids, so drift on a shared
machine falls on all alike. The figures are pooled over the prompts (tokens over seconds of
decoding, prompt included, process start and loading not), with the prompts whose tokens agree
token for token (greedy fp16 and fp32 part at near-ties). Give a bundle exported without a
drafter to time the target alone as it ships for that use: its `main` takes one token, where a
bundle with a drafter verifies a whole block in every call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from museflash.bundle import Metadata
from museflash.tools.drafter_speedup import (  # noqa: F401 (SpeedupError: re-exported)
    SpeedupError,
    bundle_metadata,
    chat_prompt_ids,
    require_one_checkpoint,
    require_tokenizer,
    run_target_only,
)

# (prompt ids, how many tokens) -> (new tokens, seconds)
Reference = Callable[[list[int], int], tuple[list[int], float]]


@dataclass
class Pooled:
    tokens: int = 0
    seconds: float = 0.0
    reference_seconds: float = 0.0
    agreeing: int = 0
    prompts: int = 0

    def add(self, tokens: list[int], seconds: float, reference: list[int],
            reference_seconds: float) -> None:
        self.tokens += len(tokens)
        self.seconds += seconds
        self.reference_seconds += reference_seconds
        self.agreeing += reference == tokens
        self.prompts += 1

    def figures(self) -> dict[str, float]:
        swift, reference = self.tokens / self.seconds, self.tokens / self.reference_seconds
        return {"tokens_per_second": swift, "reference_tokens_per_second": reference,
                "ratio": swift / reference, "agreeing_prompts": self.agreeing,
                "prompts": self.prompts}


def check_bundles(export_dirs: list[Path]) -> Metadata:
    """The bundles' metadata, all of one source checkpoint with a tokenizer; the first's."""
    found = []
    for export_dir in export_dirs:
        found.append(bundle_metadata(export_dir))
        require_tokenizer(export_dir)
    require_one_checkpoint(found, ", which transformers then decodes")
    return found[0]


def measure(export_dirs: list[Path], swift_generate: Path, texts: list[str],
            max_new_tokens: int, reference: Reference,
            log=print) -> dict[Path, dict[str, float]]:
    prompts = {d: chat_prompt_ids(d, texts) for d in export_dirs}
    pooled = {d: Pooled() for d in export_dirs}
    for index in range(len(texts)):
        for export_dir in export_dirs:
            ids = prompts[export_dir][index]
            tokens, seconds = run_target_only(swift_generate, export_dir, ids,
                                              max_new_tokens)
            reference_tokens, reference_seconds = reference(ids, len(tokens))
            pooled[export_dir].add(tokens, seconds, reference_tokens, reference_seconds)
        log(f"[target_speed] prompt {index + 1}/{len(texts)} done")
    return {d: p.figures() for d, p in pooled.items()}


def transformers_reference(target_dir: Path, threads: int) -> Reference:
    """Greedy `generate` of transformers' own model for the checkpoint, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def generate(ids: list[int], count: int) -> tuple[list[int], float]:
        inputs = torch.tensor([ids])
        began = time.perf_counter()
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                 max_new_tokens=count, min_new_tokens=count, do_sample=False,
                                 pad_token_id=model.config.eos_token_id)
        return out[0, len(ids):].tolist(), time.perf_counter() - began

    return generate


def format_figures(figures: dict[Path, dict[str, float]], max_new_tokens: int,
                   threads: int) -> str:
    lines = [f"held-out chat prompts x up to {max_new_tokens} new tokens, greedy; Swift "
             f"interpreter, target alone, no lookup; transformers generate, fp32, {threads} "
             "torch threads; pooled over the prompts",
             "| bundle | Swift, tokens/s | transformers, tokens/s | ratio | prompts agreeing |",
             "|---|---|---|---|---|"]
    for export_dir, f in figures.items():
        lines.append(f"| {export_dir} | {f['tokens_per_second']:.2f} | "
                     f"{f['reference_tokens_per_second']:.2f} | {f['ratio']:.2f}x | "
                     f"{f['agreeing_prompts']}/{f['prompts']} |")
    return "\n".join(lines)
