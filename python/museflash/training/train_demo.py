"""Train the demo Muse Glimmer target on the Python standard library's own sources, on CPU.

    ./bazelw run //:train_demo -- --output-dir DIR [--minutes 26 | --steps N] [--seed 0]
    (the command line: cli/train_demo_main.py)

Corpus: the `.py` files of the standard library of the interpreter running this tool
(`sysconfig.get_paths()["stdlib"]`), without site-packages, the test packages and two
generated data files (see `include_path`). Split by file: a file is held out when
the SHA-256 of its relative path falls in the first HELD_OUT_PERCENT of the hash range
(`is_held_out`), so the split depends on nothing but the path. Held-out text trains neither the
tokenizer nor the model.

Tokenizer: byte-level BPE trained with the `tokenizers` library on the training files only,
with the special tokens `<pad>` `<bos>` `<eos>` `<mask>` at ids 0..3 (`<mask>` is the DFlash
drafter's mask token). Every file is encoded as `<bos>` text `<eos>`.

Model: MuseGlimmerForCausalLM (the exporter's own model code) trained through its cache-free
`batch_logits`, on random windows of the concatenated training files, AdamW with a
warmup-stable-decay schedule. With `--minutes`, the step count is fixed when the decay starts
(at DECAY_FRACTION of the time left), so the run fits the time it was given and is reproduced
exactly by `--steps` with the count it prints.

Writes DIR/target/{config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json} and DIR/train_demo.json (settings, corpus figures, results), reloads the
checkpoint through museflash.checkpoint.load and reports, on the held-out files, the perplexity per
token and the bits per byte (held-out loss summed over its tokens / its UTF-8 bytes / ln 2),
computed with the reloaded bf16 weights.
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning. On a machine whose two cores are shared with
# other work, a spinning thread holds a core while its partner waits to be scheduled: measured
# here, 0.5-1.8k tokens/s spinning against 3.8k sleeping. Read when torch is first imported, so
# it only takes effect when a program imports this module before torch (cli/train_demo_main.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses
import hashlib
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from museflash.checkpoint.configs import check_configs
from museflash.checkpoint.load import load_target, target_checkpoint_tensors
from museflash.checkpoint.tensor_files import write_safetensors
from museflash.models.muse_glimmer import FULL, SLIDING, MuseGlimmerConfig, MuseGlimmerForCausalLM

# --- Corpus ----------------------------------------------------------------------------------

HELD_OUT_PERCENT = 5.0
# Directories never read: installed third-party packages, and (unless include_tests) the
# standard library's test suites.
EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
# Generated data rather than Python someone wrote: the build machine's configuration
# (`_sysconfigdata_*`, differs between builds of the same version) and the Sphinx-generated
# help text of pydoc (one 0.76 MB string table of English prose).
GENERATED_PREFIX = "_sysconfigdata_"
GENERATED_FILES = frozenset({"pydoc_data/topics.py"})
CORPUS_LICENCE = "PSF-2.0 (Python Software Foundation License Version 2; LICENSE.txt in the root)"


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the corpus root, POSIX separators
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[SourceFile, ...]
    held_out: tuple[SourceFile, ...]
    skipped: tuple[str, ...]  # files that are not UTF-8 text

    def stats(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "python": sys.version.split()[0],
            "licence": CORPUS_LICENCE,
            "held_out_percent": HELD_OUT_PERCENT,
            "train_files": len(self.train),
            "train_bytes": sum(f.nbytes for f in self.train),
            "held_out_files": len(self.held_out),
            "held_out_bytes": sum(f.nbytes for f in self.held_out),
            "skipped_not_utf8": list(self.skipped),
            "train_sha256": corpus_digest(self.train),
            "held_out_sha256": corpus_digest(self.held_out),
        }


def stdlib_root() -> Path:
    """The standard library directory of the interpreter running this code."""
    return Path(sysconfig.get_paths()["stdlib"])


def include_path(relative: str, include_tests: bool = False) -> bool:
    """Whether a `.py` file (path relative to the stdlib root) belongs to the corpus."""
    parts = relative.split("/")
    excluded = EXCLUDED_DIRS | (frozenset() if include_tests else TEST_DIRS)
    if any(part in excluded for part in parts[:-1]):
        return False
    return relative not in GENERATED_FILES and not parts[-1].startswith(GENERATED_PREFIX)


def path_bucket(relative: str) -> float:
    """A number in [0, 100) that depends only on the relative path (SHA-256 of its UTF-8)."""
    digest = hashlib.sha256(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


def is_held_out(relative: str, percent: float = HELD_OUT_PERCENT) -> bool:
    return path_bucket(relative) < percent


def corpus_paths(root: Path, include_tests: bool = False) -> list[str]:
    """Sorted relative POSIX paths of the corpus files under `root`."""
    root = Path(root)
    paths = (p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    return sorted(p for p in paths if include_path(p, include_tests))


def load_corpus(root: Path | None = None, *, include_tests: bool = False,
                percent: float = HELD_OUT_PERCENT) -> Corpus:
    """Reads the corpus and splits it by file (`is_held_out`)."""
    root = Path(root) if root is not None else stdlib_root()
    train, held_out, skipped = [], [], []
    for relative in corpus_paths(root, include_tests):
        try:
            text = (root / relative).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(relative)
            continue
        (held_out if is_held_out(relative, percent) else train).append(SourceFile(relative, text))
    if not train or not held_out:
        raise ValueError(f"{root}: the split left {len(train)} training and {len(held_out)} "
                         "held-out files; both must be non-empty")
    return Corpus(root, tuple(train), tuple(held_out), tuple(skipped))


def corpus_digest(files: Iterable[SourceFile]) -> str:
    """SHA-256 over (path, text) of the files in order: names the exact corpus used."""
    digest = hashlib.sha256()
    for f in files:
        for part in (f.path, f.text):
            data = part.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return digest.hexdigest()


# --- Tokenizer -------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>")
PAD_ID, BOS_ID, EOS_ID, MASK_ID = range(len(SPECIAL_TOKENS))
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """Byte-level BPE with exactly `vocab_size` ids (the special tokens at 0..3 included).
    Deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(f"the BPE trainer made {size} tokens, not {vocab_size} (too little text "
                         "for that many merges)")
    for token_id, text in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(text) != token_id:
            raise AssertionError(f"{text} got id {tokenizer.token_to_id(text)}, not {token_id}")
    return tokenizer


def save_tokenizer(tokenizer, directory: Path, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json, the Hugging Face layout."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "mask_token": "<mask>",
        "model_max_length": model_max_length,
        # Decoding must give back the exact source text (no space clean-up around punctuation).
        "clean_up_tokenization_spaces": False,
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(directory: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))


def encode_files(tokenizer, files: Sequence[SourceFile]) -> list[list[int]]:
    """`<bos>` + text + `<eos>` per file. A special token's text inside a file would be
    encoded as that special token, so such a file is refused."""
    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    documents = []
    for f, encoding in zip(files, encodings, strict=True):
        if any(i < len(SPECIAL_TOKENS) for i in encoding.ids):
            raise ValueError(f"{f.path}: contains the text of a special token {SPECIAL_TOKENS}")
        documents.append([BOS_ID, *encoding.ids, EOS_ID])
    return documents


# --- Batching --------------------------------------------------------------------------------


def token_stream(documents: Iterable[list[int]]) -> torch.Tensor:
    """The documents concatenated, in order, as one int64 tensor."""
    return torch.tensor([token for doc in documents for token in doc], dtype=torch.int64)


def training_batches(stream: torch.Tensor, batch_size: int, context: int,
                     seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch_size, context + 1] windows of the stream (inputs and their next tokens).
    Each epoch cuts the stream into windows from a random offset and visits them in a random
    order, so every token is seen once per epoch; the sequence depends only on `seed`."""
    width = context + 1
    if len(stream) < width * batch_size:
        raise ValueError(f"{len(stream)} training tokens do not fill one batch of "
                         f"{batch_size} x {width}")
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        offset = int(torch.randint(0, width, (1,), generator=generator))
        count = (len(stream) - offset) // width
        windows = stream[offset:offset + count * width].reshape(count, width)
        order = torch.randperm(count, generator=generator)
        for start in range(0, count - batch_size + 1, batch_size):
            yield windows[order[start:start + batch_size]]
        epoch += 1


IGNORE = -100


def evaluation_windows(documents: Iterable[list[int]], context: int,
                       stride: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both [N, context], scoring every token of every document after its
    `<bos>` exactly once, each document on its own (it starts from empty context).

    A window starts every `stride` tokens (default context // 2) and scores only the targets no
    earlier window scored, so after the first window each scored token sees at least
    context - stride tokens of its file. Unscored targets are IGNORE; inputs past a document's
    end are `<pad>` (causal attention: they change nothing before them)."""
    stride = stride or max(1, context // 2)
    if not 0 < stride <= context:
        raise ValueError(f"stride {stride} must be in (0, {context}]")
    inputs, targets = [], []
    for doc in documents:
        scored_up_to = 0  # targets doc[1 .. scored_up_to] are scored already
        start = 0
        while scored_up_to < len(doc) - 1:
            window = doc[start:start + context + 1]
            x = torch.full((context,), PAD_ID, dtype=torch.int64)
            y = torch.full((context,), IGNORE, dtype=torch.int64)
            x[:len(window) - 1] = torch.tensor(window[:-1])
            first_new = scored_up_to - start  # index in the window's targets
            y[first_new:len(window) - 1] = torch.tensor(window[1 + first_new:])
            inputs.append(x)
            targets.append(y)
            scored_up_to = start + len(window) - 1
            start += stride
    return torch.stack(inputs), torch.stack(targets)


@torch.no_grad()
def summed_loss(model: MuseGlimmerForCausalLM, inputs: torch.Tensor, targets: torch.Tensor,
                batch_size: int = 16) -> tuple[float, int]:
    """(cross-entropy summed over the scored targets, in nats; number of scored targets)."""
    total, count = 0.0, 0
    for start in range(0, len(inputs), batch_size):
        x, y = inputs[start:start + batch_size], targets[start:start + batch_size]
        logits = model.batch_logits(x).float()
        total += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   y.reshape(-1), ignore_index=IGNORE,
                                                   reduction="sum"))
        count += int((y != IGNORE).sum())
    return total, count


# --- Model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Architecture:
    """Defaults: the committed demo target (docs/demo.md says why this size)."""

    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    sliding_window: int = 64
    global_every: int = 3  # every third layer is a global (NoPE) layer, the others sliding
    rope_theta: float = 10000.0
    qk_scale_factor: float = 1.0
    final_logit_softcapping: float | None = 30.0


def target_config(vocab_size: int, arch: Architecture, context: int) -> dict[str, Any]:
    """config.json in the real layout (text settings under `text_config`)."""
    layer_types = [FULL if (i + 1) % arch.global_every == 0 else SLIDING
                   for i in range(arch.num_hidden_layers)]
    token_ids = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    return {
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "model_type": "muse_glimmer",
        "tie_word_embeddings": False,
        **token_ids,
        "text_config": {
            "model_type": "muse_glimmer_text",
            "vocab_size": vocab_size,
            "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size,
            "num_hidden_layers": arch.num_hidden_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_key_value_heads,
            "head_dim": arch.head_dim,
            "layer_types": layer_types,
            "layer_rope_theta": [arch.rope_theta if t == SLIDING else 0.0 for t in layer_types],
            "sliding_window": arch.sliding_window,
            "max_position_embeddings": context,
            "rms_norm_eps": 1e-6,
            "qk_scale_factor": arch.qk_scale_factor,
            "output_multiplier": 1.0,
            "final_logit_softcapping": arch.final_logit_softcapping,
            **token_ids,
        },
    }


def build_model(config: dict[str, Any], context: int, seed: int) -> MuseGlimmerForCausalLM:
    """Freshly initialised fp32 model, every parameter trainable (the loader freezes them).
    Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), (1 + w) norm weights 0."""
    model = MuseGlimmerForCausalLM(MuseGlimmerConfig.from_dict(config), max_context=context,
                                   max_query_len=8)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = 1.0 if "embed" in name else param.shape[1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model.requires_grad_(True)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- Training --------------------------------------------------------------------------------

DECAY_FRACTION = 0.2


@dataclass(frozen=True)
class Settings:
    output_dir: Path
    seed: int = 0
    minutes: float | None = 26.0  # training-loop budget; ignored when `steps` is set
    steps: int | None = None
    threads: int = 2
    vocab_size: int = 4096
    context: int = 256
    batch_size: int = 8
    learning_rate: float = 6e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    eval_stride: int | None = None
    include_tests: bool = False
    arch: Architecture = Architecture()
    corpus_root: Path | None = None
    log_every: int = 25


def decay_steps(total: int) -> int:
    return round(total * DECAY_FRACTION)


def learning_rate_at(step: int, total: int | None, peak: float, warmup: int) -> float:
    """Warmup-stable-decay: linear warmup over `warmup` steps, flat, then linear decay to 0
    over the last DECAY_FRACTION of `total` steps (total None: not decided yet, still flat)."""
    rate = peak * min(1.0, (step + 1) / max(1, warmup))
    if total is not None:
        decay_start = total - decay_steps(total)
        if step >= decay_start:
            rate *= (total - step) / max(1, total - decay_start)
    return rate


def total_steps_for(decay_start: int) -> int:
    """The smallest step count whose decay starts at or after `decay_start`."""
    total = decay_start
    while total - decay_steps(total) < decay_start:
        total += 1
    return total


def train(model: MuseGlimmerForCausalLM, batches: Iterator[torch.Tensor], settings: Settings,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the optimisation in place; returns figures of the run."""
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.dim() == 2 else no_decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.learning_rate, betas=(0.9, 0.95), eps=1e-8)
    total = settings.steps
    budget = None if total is not None else settings.minutes * 60.0
    vocab = model.config.vocab_size
    losses: list[float] = []
    window: list[float] = []
    tokens = 0
    start = time.perf_counter()
    model.train()
    step = 0
    while total is None or step < total:
        elapsed = time.perf_counter() - start
        if total is None and elapsed >= budget * (1 - DECAY_FRACTION):
            total = total_steps_for(step)
            log(f"step {step}: {elapsed:.0f} s of {budget:.0f} s used, {total} steps in all "
                f"(reproduce with --steps {total})")
            continue
        rate = learning_rate_at(step, total, settings.learning_rate, settings.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = rate
        batch = next(batches)
        logits = model.batch_logits(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch[:, :-1].numel()
        losses.append(loss.item())
        window.append(losses[-1])
        step += 1
        if step % settings.log_every == 0 or step == total:
            elapsed = time.perf_counter() - start
            log(f"step {step}{'/' + str(total) if total else ''}  loss "
                f"{sum(window) / len(window):.3f}  lr {rate:.2e}  {tokens / elapsed:.0f} tok/s  "
                f"{elapsed:.0f} s")
            window.clear()
    model.eval()
    seconds = time.perf_counter() - start
    return {"steps": step, "train_seconds": round(seconds, 1), "train_tokens": tokens,
            "tokens_per_second": round(tokens / seconds, 1), "losses": losses}


def held_out_figures(model: MuseGlimmerForCausalLM, documents: list[list[int]],
                     nbytes: int, context: int, stride: int | None) -> dict[str, Any]:
    inputs, targets = evaluation_windows(documents, context, stride)
    nats, count = summed_loss(model, inputs, targets)
    return loss_figures(nats, count, nbytes)


def loss_figures(nats: float, count: int, nbytes: int) -> dict[str, Any]:
    """held_out_figures' report of a loss (nats summed over `count` scored tokens of text that
    is `nbytes` bytes of UTF-8)."""
    return {
        "held_out_scored_tokens": count,
        "held_out_bytes": nbytes,
        "held_out_loss_per_token": nats / count,
        "held_out_perplexity": math.exp(nats / count),
        "held_out_bits_per_byte": nats / nbytes / math.log(2),
    }


def greedy_sample(model: MuseGlimmerForCausalLM, tokenizer, prompt: str, count: int) -> str:
    """The model's greedy continuation of `prompt` (decoded text), through the cached forward
    the exporter converts."""
    ids = [BOS_ID, *tokenizer.encode(prompt, add_special_tokens=False).ids]
    model.reset_caches()
    out: list[int] = []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids), dtype=torch.int32))
        for _ in range(count):
            token = int(logits[0, -1].argmax())
            if token == EOS_ID or len(ids) + len(out) >= model.max_context:
                break
            out.append(token)
            position = len(ids) + len(out) - 1
            logits = model(torch.tensor([[token]]), torch.tensor([position], dtype=torch.int32))
    return tokenizer.decode(ids[1:] + out)


def run(settings: Settings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole tool: corpus, tokenizer, training, checkpoint, reload, held-out figures."""
    if settings.steps is None and not settings.minutes:
        raise ValueError("give a step count or a time budget in minutes")
    torch.set_num_threads(settings.threads)
    torch.set_flush_denormal(True)  # AdamW's tiny second moments: denormals cost ~5x per op
    torch.manual_seed(settings.seed)
    wall = time.perf_counter()
    corpus = load_corpus(settings.corpus_root, include_tests=settings.include_tests)
    stats = corpus.stats()
    log(f"corpus {corpus.root}: {stats['train_files']} training files "
        f"({stats['train_bytes']} bytes), {stats['held_out_files']} held out "
        f"({stats['held_out_bytes']} bytes)")
    tokenizer = train_tokenizer((f.text for f in corpus.train), settings.vocab_size)
    train_docs = encode_files(tokenizer, corpus.train)
    held_out_docs = encode_files(tokenizer, corpus.held_out)
    stream = token_stream(train_docs)
    # Token counts with each file's <bos> and <eos>; the held-out figures score all but <bos>.
    stats["train_tokens"] = len(stream)
    stats["held_out_tokens"] = sum(len(d) for d in held_out_docs)
    log(f"tokenizer: {settings.vocab_size} tokens, {stats['train_tokens']} training tokens "
        f"({stats['train_bytes'] / stats['train_tokens']:.2f} bytes per token)")

    config = target_config(settings.vocab_size, settings.arch, settings.context)
    model = build_model(config, settings.context, settings.seed)
    params = parameter_count(model)
    log(f"model: {params} parameters ({2 * params} bytes in bf16), "
        f"{settings.arch.num_hidden_layers} layers, hidden {settings.arch.hidden_size}")
    batches = training_batches(stream, settings.batch_size, settings.context, settings.seed)
    figures = train(model, batches, settings, log)
    losses = figures.pop("losses")

    target_dir = Path(settings.output_dir) / "target"
    write_safetensors(target_checkpoint_tensors(model), target_dir, config, dtype="bf16")
    save_tokenizer(tokenizer, target_dir, settings.context)
    checked = check_configs(target_dir)
    reloaded = load_target(target_dir, dtype=torch.float32, max_context=settings.context)
    held_out_bytes = stats["held_out_bytes"]
    results = held_out_figures(reloaded, held_out_docs, held_out_bytes, settings.context,
                               settings.eval_stride)
    sample = greedy_sample(reloaded, tokenizer, "def ", 48)
    report = {
        "settings": _jsonable(dataclasses.asdict(settings)),
        "corpus": stats,
        "parameters": params,
        "weight_bytes_bf16": 2 * params,
        **figures,
        "first_loss": losses[0],
        "last_losses_mean": sum(losses[-25:]) / len(losses[-25:]),
        **results,
        "tokenizer_special_tokens": checked.tokenizer.special_tokens,
        "greedy_sample": sample,
        "wall_seconds": round(time.perf_counter() - wall, 1),
    }
    (Path(settings.output_dir) / "train_demo.json").write_text(json.dumps(report, indent=2)
                                                                + "\n")
    log(f"held out ({results['held_out_scored_tokens']} tokens, {held_out_bytes} bytes, bf16 "
        f"weights reloaded): perplexity per token {results['held_out_perplexity']:.3f}, "
        f"{results['held_out_bits_per_byte']:.4f} bits per byte")
    log(f"greedy sample: {sample!r}")
    log(f"wrote {target_dir} in {report['wall_seconds']:.0f} s")
    return report


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items() if k not in ("output_dir",)}
    if isinstance(value, Path):
        return str(value)
    return value
