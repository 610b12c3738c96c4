"""A drafter checkpoint in z-lab's DFlashDraftModel layout, made from one written by
museflash.builtin.demo_checkpoint, for the tests that load that layout."""

import json
from pathlib import Path

from museflash.builtin.demo_checkpoint import TINY_TARGET_CONFIG
from museflash.bundle import LayerType
from museflash.models.dflash import ZLAB_ENCODER_KEYS


def to_zlab_layout(drafter_dir: Path, *, is_causal: bool = False,
                   target_depth: int = TINY_TARGET_CONFIG["text_config"]["num_hidden_layers"],
                   ) -> None:
    """Rewrites a drafter checkpoint written here (Meta layout) in z-lab's DFlashDraftModel
    layout, as z-lab/dflash's tests/fixtures show it: the encoder as `fc` / `hidden_norm`, the
    DFlash settings under `dflash_config`, model_type `qwen3`, `is_causal` and `layer_types`
    and `num_target_layers` stated (`target_depth`, the tiny target's by default). The weights
    are unchanged."""
    from safetensors.torch import load_file, save_file

    weights_path = Path(drafter_dir) / "model.safetensors"
    tensors = load_file(str(weights_path))
    for name, key in ZLAB_ENCODER_KEYS.items():
        tensors[key] = tensors.pop(name)
    save_file(tensors, str(weights_path))
    config_path = Path(drafter_dir) / "config.json"
    config = json.loads(config_path.read_text())
    moved = {k: config.pop(k) for k in ("block_size", "mask_token_id", "target_layer_ids")}
    config.update(model_type="qwen3", architectures=["DFlashDraftModel"], is_causal=is_causal,
                  dflash_config=moved, num_target_layers=target_depth,
                  layer_types=[LayerType.SLIDING_ATTENTION.value] * config["num_hidden_layers"])
    config_path.write_text(json.dumps(config, indent=2) + "\n")
