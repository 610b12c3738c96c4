"""--kv-write (bundle.KVWrite, docs/kv-write.md): the flag's checks, and the eager models'
slice write against the blend. The exported graphs and both runtimes are checked on real
bundles in //tests/runtime and //tests/swift_runtime."""

import copy
from pathlib import Path

import pytest
import torch

from museflash.builtin.demo_checkpoint import TINY_TARGET_CONFIG, build_tiny_models
from museflash.bundle import KVWrite
from museflash.export.options import ExportError, ExportOptions, check_flag_rules
from museflash.export.plan import kv_write_strategy
from museflash.models.base import write_cache, write_cache_rows
from museflash.models.muse_glimmer import MuseGlimmerConfig


def test_an_unknown_strategy_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ExportError) as error:
        check_flag_rules(ExportOptions(output_dir=tmp_path, kv_write="scatter"))
    message = str(error.value)
    assert "--kv-write" in message and "scatter" in message
    assert all(strategy.value in message for strategy in KVWrite)
    assert "\n" not in message


def test_slice_is_refused_for_a_target_without_global_layers(tmp_path):
    raw = copy.deepcopy(TINY_TARGET_CONFIG)
    text = raw["text_config"]
    text["layer_types"] = ["sliding_attention"] * text["num_hidden_layers"]
    text["layer_rope_theta"] = [10000.0] * text["num_hidden_layers"]
    config = MuseGlimmerConfig.from_dict(raw)
    options = ExportOptions(output_dir=Path(tmp_path), kv_write="slice")
    with pytest.raises(ExportError, match="no global .*use --kv-write blend"):
        kv_write_strategy(options, config)
    assert kv_write_strategy(ExportOptions(output_dir=tmp_path), config) == KVWrite.BLEND


def test_the_tiny_target_accepts_slice():
    config = MuseGlimmerConfig.from_dict(TINY_TARGET_CONFIG)
    assert config.global_layer_ids
    options = ExportOptions(output_dir=Path("unused"), kv_write="slice")
    assert kv_write_strategy(options, config) == KVWrite.SLICE


def test_write_cache_rows_writes_t_rows_of_one_layer_and_clamps_into_the_cache():
    cache = torch.zeros(3, 2, 16, 4, dtype=torch.float16)
    values = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4) + 1
    written = write_cache_rows(cache, 1, torch.tensor([6], dtype=torch.int32), values)
    assert torch.equal(written[1, :, 6:11], values.half())
    untouched = torch.ones_like(written, dtype=torch.bool)
    untouched[1, :, 6:11] = False
    assert not written[untouched].any()
    assert not cache.any()  # a copy: the op is functional, write_cache makes it in place
    clamped = write_cache_rows(cache, 0, torch.tensor([14], dtype=torch.int32), values)
    assert torch.equal(clamped[0, :, 11:16], values.half())


def test_slice_and_blend_write_the_same_slots():
    generator = torch.Generator().manual_seed(0)
    blend, sliced = (torch.randn(2, 2, 32, 8, generator=generator).half(),) * 2
    blend, sliced = blend.clone(), sliced.clone()
    for start in (0, 5, 24):
        slots = torch.arange(start, start + 8, dtype=torch.int32)
        values = torch.randn(2, 8, 8, generator=generator)
        write_cache(blend, 1, slots, values, KVWrite.BLEND)
        write_cache(sliced, 1, slots, values, KVWrite.SLICE)
        assert torch.equal(blend, sliced), start


def test_the_eager_target_decodes_identically_with_either_strategy():
    """Chunks that roll back (a verify block rewritten from an earlier position, as after a
    rejection): logits, drafter features and every cache bit for bit."""
    results = {}
    for strategy in KVWrite:
        target, _ = build_tiny_models(seed=5, max_context=64)
        target.kv_write = strategy
        ids = torch.randint(0, target.config.vocab_size, (1, 40),
                            generator=torch.Generator().manual_seed(1))
        outputs = []
        with torch.no_grad():
            for start in (0, 8, 16, 12, 20, 19):
                positions = torch.arange(start, start + 8, dtype=torch.int32)
                logits, features = target(ids[:, start:start + 8], positions)
                outputs += [logits, features]
        caches = [target.globalKeyCache, target.globalValueCache, target.slidingKeyCache,
                  target.slidingValueCache]
        results[strategy] = outputs + [c.clone() for c in caches]
    for blend, sliced in zip(results[KVWrite.BLEND], results[KVWrite.SLICE], strict=True):
        assert torch.equal(blend, sliced)
