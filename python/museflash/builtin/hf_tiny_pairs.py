"""Tiny random Qwen3 and Llama 3.1 pairs, the built-in `tiny-qwen3` and `tiny-llama`.

Each is a target written by transformers' own `save_pretrained` (its config.json and
safetensors layout are transformers', not museflash's), a DFlash drafter in z-lab's layout for
it, and a fixture tokenizer in the family's tokenizer.json layout (tokenizer_layouts.py).

The drafter's config has the shape z-lab publishes for these targets (z-lab/Qwen3-4B-DFlash-b16
and z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat): `model_type` qwen3, `architectures`
DFlashDraftModel, every layer full attention without a sliding window, plain RoPE of its own
theta, and `dflash_config` holding `target_layer_ids` (z-lab's spacing: 1, ..., layers - 3),
`mask_token_id` and `block_size` 16. z-lab's model class is not part of transformers, so the
drafter's weights are written by checkpoint/tensor_files.py under z-lab's keys (`layers.N...`,
`norm`, `fc`, `hidden_norm`).

Vocabulary: the Qwen3 target has more embedding rows than its tokenizer has tokens (rounded up
to a multiple of 64, as the published 151936 rows for 151669 tokens are); the Llama target has
exactly its tokenizer's tokens (128256 for Llama 3.1). The mask token is a special token added
after the family's own. Everything is seeded: the same seed writes the same bytes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from museflash.builtin import tokenizer_layouts
from museflash.builtin.random_weights import randomize
from museflash.bundle import LayerType
from museflash.checkpoint.load import drafter_checkpoint_tensors
from museflash.checkpoint.tensor_files import write_safetensors
from museflash.models.dflash import ZLAB_ENCODER_KEYS, DFlashConfig, DFlashDrafter, DFlashEncoder

HF_TINY_PAIRS = ("tiny-qwen3", "tiny-llama")
MASK_TOKEN = "<|dflash_mask|>"
TARGET_LAYERS = 6
DRAFTER_LAYERS = 2
# The text the fixture BPE is trained on (with tokenizer_layouts' own extra text).
TRAINING_TEXT = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. 1234567890 times, said the family flag.",
    "import json\nfrom pathlib import Path\n\nprint(json.dumps({'hello': 'world'}))\n",
]

_GEOMETRY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=TARGET_LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
                 attention_bias=False)

# Per family: tokenizer layout, transformers config keywords (reduced width, otherwise the
# published settings' kinds: Qwen3 ties its small sizes' embeddings, Llama 3.1 has llama3
# RoPE scaling and an untied head), the drafter's RoPE theta, and whether the vocabulary is
# padded past the tokenizer.
_FAMILIES: dict[str, dict[str, Any]] = {
    "tiny-qwen3": {
        "layout": "qwen2",
        "config": dict(_GEOMETRY, rms_norm_eps=1e-6, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                       tie_word_embeddings=True, use_sliding_window=False),
        "special": {"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"},
        "drafter_rope_theta": 1_000_000.0,
        "pad_vocab_to": 64,
    },
    "tiny-llama": {
        "layout": "llama3",
        "config": dict(_GEOMETRY, mlp_bias=False, rms_norm_eps=1e-5,
                       max_position_embeddings=131072,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0,
                                        "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192},
                       tie_word_embeddings=False),
        "special": {"bos_token_id": "<|begin_of_text|>", "eos_token_id": "<|eot_id|>"},
        "drafter_rope_theta": 500_000.0,
        "pad_vocab_to": None,
    },
}


def zlab_target_layer_ids(target_layers: int, drafter_layers: int) -> list[int]:
    """z-lab's spacing of the tapped layers: from 1 to target_layers - 3, evenly (Qwen3-4B's
    36 layers and 5 drafter layers give 1, 9, 17, 25, 33)."""
    if drafter_layers == 1:
        return [target_layers // 2]
    first, last = 1, target_layers - 3
    return [first + round(i * (last - first) / (drafter_layers - 1))
            for i in range(drafter_layers)]


def zlab_drafter_config(target: dict[str, Any], mask_token_id: int, rope_theta: float,
                        layers: int = DRAFTER_LAYERS) -> dict[str, Any]:
    """A drafter config.json in the shape z-lab publishes, of `layers` layers, for the target
    config `target`."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 16,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": zlab_target_layer_ids(target["num_hidden_layers"], layers),
        },
        "dtype": "bfloat16",
        "head_dim": target["head_dim"],
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "layer_types": [LayerType.FULL_ATTENTION.value] * layers,
        "max_position_embeddings": target["max_position_embeddings"],
        "num_attention_heads": target["num_attention_heads"],
        "num_hidden_layers": layers,
        "num_key_value_heads": target["num_key_value_heads"],
        "num_target_layers": target["num_hidden_layers"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": target["vocab_size"],
    }


def _tokenizer(layout: str) -> tuple[Any, dict[str, Any]]:
    """The fixture tokenizer of `layout` with the mask token added, and its config."""
    from tokenizers import AddedToken, Tokenizer

    text = tokenizer_layouts.layouts(TRAINING_TEXT)[layout]
    tokenizer = Tokenizer.from_str(text)
    tokenizer.add_special_tokens([AddedToken(MASK_TOKEN, special=True)])
    return tokenizer, tokenizer_layouts.tokenizer_config(layout)


def write_hf_tiny_pair(name: str, out_dir: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Writes out_dir/target (transformers' save_pretrained, with the tokenizer files) and
    out_dir/drafter (z-lab's layout); returns both paths."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if name not in _FAMILIES:
        raise ValueError(f"no tiny transformers pair {name!r}; choose one of {HF_TINY_PAIRS}")
    family = _FAMILIES[name]
    out_dir = Path(out_dir)
    target_dir, drafter_dir = out_dir / "target", out_dir / "drafter"
    tokenizer, tokenizer_config = _tokenizer(family["layout"])
    tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    pad = family["pad_vocab_to"]
    vocab = -(-tokens // pad) * pad if pad else tokens
    ids = {key: tokenizer.token_to_id(text) for key, text in family["special"].items()}
    mask_id = tokenizer.token_to_id(MASK_TOKEN)

    config_class, model_class = ((Qwen3Config, Qwen3ForCausalLM) if name == "tiny-qwen3"
                                 else (LlamaConfig, LlamaForCausalLM))
    config = config_class(vocab_size=vocab, **copy.deepcopy(family["config"]), **ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = model_class(config).eval()
    randomize(target, generator)
    if config.tie_word_embeddings:
        target.tie_weights()
    target.save_pretrained(target_dir, safe_serialization=True)
    tokenizer.save(str(target_dir / "tokenizer.json"))
    (target_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2) + "\n")

    written = json.loads((target_dir / "config.json").read_text())
    drafter_config = zlab_drafter_config(written, mask_id, family["drafter_rope_theta"])
    _write_zlab_drafter(drafter_config, drafter_dir, generator)
    return target_dir, drafter_dir


def _write_zlab_drafter(config: dict[str, Any], directory: Path,
                        generator: torch.Generator) -> None:
    """Random drafter layers, norm and encoder (fc, hidden_norm) under z-lab's keys."""

    parsed = DFlashConfig.from_dict(config)
    hidden = parsed.hidden_size
    drafter = DFlashDrafter(parsed, nn.Embedding(config["vocab_size"], hidden), None,
                            max_context=64, max_query_len=parsed.block_size)
    encoder = DFlashEncoder(parsed, hidden)
    for module in (drafter.layers, drafter.norm, encoder):
        randomize(module, generator)
    tensors = drafter_checkpoint_tensors(drafter, encoder)
    for museflash_key, zlab_key in ZLAB_ENCODER_KEYS.items():
        tensors[zlab_key] = tensors.pop(museflash_key)
    write_safetensors(tensors, directory, config, dtype="bf16")
