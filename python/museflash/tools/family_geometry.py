"""Real-geometry placeholder checkpoints of the Qwen3 and Llama 3.1 pairs, for the benchmark.

`./bazelw run //:benchmark -- --geometry qwen3-4b --paths streaming,streaming-4bit` writes a
target at the published model's geometry in transformers' layout (config.json from
transformers' own config class, weight keys from its model class built on the meta device, so
neither is museflash's guess), beside a DFlash drafter in z-lab's layout, with placeholder
weights generated one tensor at a time. The export then measures what the real pair would cost:
bundle size per preset and peak RSS. `state_bytes` gives the bytes the bundle's states take at a
context, from the modules the export builds (on the meta device: nothing is allocated).

The geometries are the public config.json values of Qwen/Qwen3-4B, Qwen/Qwen3-8B and
meta-llama/Llama-3.1-8B-Instruct. The drafters follow z-lab's published shape for them
(z-lab/Qwen3-4B-DFlash-b16, -8B-, LLaMA3.1-8B-Instruct-DFlash-UltraChat): 5 layers at the
target's width, tapping 5 target layers at z-lab's spacing, block 16. Those drafter files
cannot be downloaded here; the depth and tapped layers are as third-party code quotes them, and
the Llama drafter's mask token id is a reserved special token chosen here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

# name -> (transformers config class name, its keywords, drafter mask token id, drafter theta)
_QWEN3_COMMON = dict(vocab_size=151936, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, hidden_act="silu",
                     rms_norm_eps=1e-6, max_position_embeddings=40960, attention_bias=False,
                     use_sliding_window=False, bos_token_id=151643, eos_token_id=151645,
                     rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
FAMILY_GEOMETRIES: dict[str, tuple[str, dict[str, Any], int, float]] = {
    "qwen3-4b": ("Qwen3Config", dict(_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728,
                                     tie_word_embeddings=True), 151669, 1_000_000.0),
    "qwen3-8b": ("Qwen3Config", dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                                     tie_word_embeddings=False), 151669, 1_000_000.0),
    "llama3.1-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
        rms_norm_eps=1e-5, max_position_embeddings=131072, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}),
        128002, 500_000.0),
}
DRAFTER_LAYERS = 5
# The context the benchmark exports these at (a device-sized context; the bundle's size does
# not depend on it) and the contexts state_bytes reports.
EXPORT_CONTEXT = 4096
STATE_CONTEXTS = (4096, 32768)


def _placeholder(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    # Values that keep activations O(1) (the fp16 range audit runs the model): norms near 1
    # (these families' norms multiply by w, not 1 + w), matrices scaled by their fan-in.
    noise = torch.randn(shape, generator=generator)
    if "norm" in name:
        return noise.mul_(0.1).add_(1.0)
    if len(shape) == 2 and "embed" not in name:
        return noise.mul_(1 / math.sqrt(shape[1]))
    return noise


def family_configs(name: str, **overrides: Any) -> tuple[Any, dict[str, Any]]:
    """(transformers config object of the target, z-lab-shaped drafter config.json);
    `overrides` replace the target's keywords (the tests shrink the geometry)."""
    import transformers

    from museflash.builtin.hf_tiny_pairs import zlab_drafter_config

    if name not in FAMILY_GEOMETRIES:
        raise ValueError(f"no family geometry {name!r}; choose one of {list(FAMILY_GEOMETRIES)}")
    class_name, keywords, mask_id, drafter_theta = FAMILY_GEOMETRIES[name]
    config = getattr(transformers, class_name)(**dict(keywords, **overrides))
    written = config.to_dict()
    drafter = zlab_drafter_config(written, mask_id, drafter_theta, layers=DRAFTER_LAYERS)
    drafter["dtype"] = "bfloat16"
    return config, drafter


def write_family_checkpoints(name: str, directory: Path, seed: int = 0,
                             max_shard_bytes: int = 2_000_000_000,
                             **overrides: Any) -> tuple[Path, Path]:
    """Writes directory/target (transformers' layout) and directory/drafter (z-lab's); returns
    both paths. Memory: one shard at a time."""
    import transformers

    from museflash.checkpoint.tensor_files import write_safetensors
    from museflash.models.dflash import (
        ZLAB_ENCODER_KEYS,
        DFlashConfig,
        DFlashDrafter,
        DFlashEncoder,
        drafter_checkpoint_key,
    )

    config, drafter_config = family_configs(name, **overrides)
    model_class = {"Qwen3Config": transformers.Qwen3ForCausalLM,
                   "LlamaConfig": transformers.LlamaForCausalLM}[type(config).__name__]
    config.architectures = [model_class.__name__]  # as a model's save_pretrained sets them
    config.dtype = "bfloat16"  # the published weights' dtype, and these
    with torch.device("meta"):
        target = model_class(config)
    # What save_pretrained writes: every parameter once (a tied lm_head is not stored).
    shapes = {key: tuple(p.shape) for key, p in target.named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    target_dir, drafter_dir = directory / "target", directory / "drafter"
    write_safetensors(((key, _placeholder(key, shape, generator)) for key, shape in
                       shapes.items()), target_dir, config.to_dict(),
                      max_shard_bytes=max_shard_bytes)
    config.save_pretrained(target_dir)  # config.json exactly as transformers writes it

    parsed = DFlashConfig.from_dict(drafter_config)
    with torch.device("meta"):
        embedding = torch.nn.Embedding(config.vocab_size, parsed.hidden_size)
        drafter = DFlashDrafter(parsed, embedding, None, max_context=8,
                                max_query_len=parsed.block_size)
        encoder = DFlashEncoder(parsed, parsed.hidden_size)
    keys = [(drafter_checkpoint_key(n), tuple(p.shape)) for n, p in drafter.named_parameters()]
    keys += [(ZLAB_ENCODER_KEYS.get("encoder." + n, "encoder." + n), tuple(p.shape))
             for n, p in encoder.named_parameters()]
    write_safetensors(((key, _placeholder(key, shape, generator)) for key, shape in keys
                       if key is not None), drafter_dir, drafter_config,
                      max_shard_bytes=max_shard_bytes)
    return target_dir, drafter_dir


def state_bytes(target_dir: Path, drafter_dir: Path, context: int) -> dict[str, int]:
    """Bytes of each state the bundle of this pair declares at `context` (fp16, as Core ML
    states are), from the modules the export would trace, built on the meta device."""
    from museflash.bundle import StateName
    from museflash.checkpoint.configs import check_configs
    from museflash.models.dflash import DFlashDrafter
    from museflash.models.families import family_of

    checked = check_configs(target_dir, drafter_dir)
    family = family_of(checked.target)
    with torch.device("meta"):
        target = family.fused_class(checked.target, checked.drafter, max_context=context,
                                    max_query_len=16)
        drafter = DFlashDrafter.for_target(checked.drafter, target, max_query_len=16)
    states = {s.value for s in StateName}
    return {f"{role}.{name}": 2 * math.prod(buffer.shape)
            for role, module in (("target", target), ("drafter", drafter))
            for name, buffer in module.named_buffers(recurse=False) if name in states}
