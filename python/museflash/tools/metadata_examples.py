"""Golden metadata.json examples for both readers of the bundle contract.

  ./bazelw build //python:metadata_examples   (cli/metadata_examples_main.py OUTPUT.json)

`valid` holds the metadata the exporter writes for each kind of export (made by the exporter's
own plan, load and describe stages on the demo checkpoints, without converting anything);
`forward_compatible` the same with keys a later exporter of the same schema version might add
(and one without its null optional values, which readers accept absent);
`invalid` what a reader must refuse. Built by `//python:metadata_examples` and read by the
Swift decoder's tests and by tests/python/test_bundle.py, so a field changed on one side fails
the other side's test.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from museflash.bundle import (
    EMBEDDED_METADATA_KEY,
    METADATA_FILE,
    SUPPORTED_SCHEMA_VERSIONS,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    Metadata,
    Name,
    Source,
)

# name -> export flags, and the demo pair it exports: "plain", "with_tokenizer" (the target
# checkpoint has a tokenizer), "dflash2" (the drafter is a DFlash2 in z-lab's layout) or "qwen3"
# (the tiny Qwen3 pair: a target of global layers only, so only the global state pair, and a
# full-attention drafter; hf_tiny_pairs.py)
EXPORT_KINDS: dict[str, tuple[dict[str, Any], str]] = {
    "dflash": ({"fused_target": True, "dflash_drafter": True}, "plain"),
    "dflash_kv_slice": ({"fused_target": True, "dflash_drafter": True, "kv_write": "slice"},
                        "plain"),
    "dflash_with_tokenizer": ({"fused_target": True, "dflash_drafter": True}, "with_tokenizer"),
    "dflash2": ({"fused_target": True, "dflash_drafter": True}, "dflash2"),
    "dflash_global_only_target": ({"fused_target": True, "dflash_drafter": True}, "qwen3"),
    "ring": ({"with_drafter": True}, "plain"),
    "fused_target_only": ({"fused_target": True}, "plain"),
    "target_only": ({}, "plain"),
}


def exported_metadata() -> dict[str, Metadata]:
    """The metadata the exporter writes for each of EXPORT_KINDS (demo pair, default knobs)."""
    from museflash.builtin.demo_checkpoint import (
        TINY_DFLASH2_CONFIG,
        write_tiny_checkpoints,
        write_word_tokenizer,
    )
    from museflash.builtin.hf_tiny_pairs import write_hf_tiny_pair
    from museflash.export.describe import bundle_metadata
    from museflash.export.options import ExportOptions
    from museflash.export.placeholders import PlaceholderWeights
    from museflash.export.plan import load_modules, plan_export
    from museflash.export.progress import Progress

    examples = {}
    with tempfile.TemporaryDirectory(prefix="museflash-examples-") as scratch:
        target_dir, drafter_dir = write_tiny_checkpoints(Path(scratch) / "plain")
        with_tokenizer = Path(scratch) / "with_tokenizer"
        shutil.copytree(Path(scratch) / "plain", with_tokenizer)
        config = json.loads((drafter_dir / "config.json").read_text())
        write_word_tokenizer(with_tokenizer / target_dir.name,
                             json.loads((target_dir / "config.json").read_text())
                             ["text_config"]["vocab_size"],
                             {"<mask>": config["mask_token_id"]})
        write_tiny_checkpoints(Path(scratch) / "dflash2", drafter_config=TINY_DFLASH2_CONFIG)
        write_hf_tiny_pair("tiny-qwen3", Path(scratch) / "qwen3")
        for name, (flags, pair) in EXPORT_KINDS.items():
            options = ExportOptions(output_dir=Path(scratch) / name, **flags)
            root = Path(scratch) / pair
            drafter = root / drafter_dir.name if options.wants_drafter else None
            plan = plan_export(options, root / target_dir.name, drafter)
            modules = load_modules(options, plan, Progress(echo=lambda _line: None),
                                   PlaceholderWeights())
            source = Source(checkpoint="/checkpoints/muse-glimmer-demo",
                            drafter_checkpoint="/checkpoints/demo-drafter" if drafter else None)
            examples[name] = bundle_metadata(plan, modules, source, plan.context_length,
                                             None)
    return examples


# name -> export flags and compression options, over the trained demo pair (demo/): the tiny
# random pair has no weight large enough to compress.
COMPRESSED_KINDS: dict[str, dict[str, Any]] = {
    "target_only_4bit": {"compression": "4bit"},
    "dflash_mixed_rules": {"fused_target": True, "dflash_drafter": True, "compression_config": [
        {"match": "*embed_tokens.weight", "mode": "linear", "bits": 8},
        {"match": "lm_head.weight", "mode": "linear", "bits": 8},
        {"match": "*mlp.down_proj*", "mode": "palettize", "bits": 4, "group_size": 32},
        {"match": "*layers.0.mlp.*", "mode": "none"},
        {"match": "*", "mode": "linear", "bits": 4, "block_size": 32}]},
}


def compressed_metadata() -> dict[str, Metadata]:
    """The metadata of compressed exports of the trained demo pair: the plan as the exporter
    makes it, and the weights its merge would store (every streamed weight, compressed as
    planned) in place of a conversion."""
    from museflash.builtin.demo_checkpoint import builtin_checkpoints
    from museflash.export.describe import bundle_metadata
    from museflash.export.options import ExportOptions
    from museflash.export.pipeline import package_placeholders
    from museflash.export.placeholders import PlaceholderWeights
    from museflash.export.plan import load_modules, plan_export
    from museflash.export.progress import Progress
    from museflash.export.weights import StoredWeight

    examples = {}
    with tempfile.TemporaryDirectory(prefix="museflash-examples-") as scratch, \
            builtin_checkpoints("demo") as (target_dir, drafter_dir):
        for name, flags in COMPRESSED_KINDS.items():
            flags = dict(flags)
            if isinstance(flags.get("compression_config"), list):
                rules = Path(scratch) / f"{name}.json"
                rules.write_text(json.dumps(flags["compression_config"]))
                flags["compression_config"] = rules
            options = ExportOptions(output_dir=Path(scratch) / name, **flags)
            drafter = drafter_dir if options.wants_drafter else None
            plan = plan_export(options, target_dir, drafter)
            placeholders = PlaceholderWeights()
            modules = load_modules(options, plan, Progress(echo=lambda _line: None),
                                   placeholders)
            schemes = plan.compression.schemes
            stored = {}
            for assets in plan.packages().values():
                weights = {}
                for location in package_placeholders(assets, modules, placeholders).values():
                    weights[location.key] = StoredWeight.of(location.key, location.shape,
                                                            schemes.get(location.key))
                stored[assets[0].role] = weights
            source = Source(checkpoint="/checkpoints/muse-glimmer-demo",
                            drafter_checkpoint="/checkpoints/demo-drafter" if drafter else None)
            examples[name] = bundle_metadata(plan, modules, source, plan.context_length,
                                             None, stored)
    return examples


def _with_unknown_keys(raw: dict[str, Any]) -> dict[str, Any]:
    grown = copy.deepcopy(raw)
    grown["added_in_a_later_exporter"] = {"anything": [1, 2.5, None, "x"]}
    grown["target"]["new_setting"] = 3
    for asset in grown["assets"].values():
        asset["new_asset_field"] = "value"
        for function in asset["functions"].values():
            function["new_function_field"] = True
        for state in asset["states"]:
            state["new_state_field"] = [0]
    if grown.get("speculative_decoding"):
        grown["speculative_decoding"]["new_spec_field"] = None
        grown["speculative_decoding"]["drafter"]["new_drafter_field"] = 1
        if grown["speculative_decoding"].get("dflash2"):
            grown["speculative_decoding"]["dflash2"]["new_selector_field"] = "x"
    grown["source"]["revision"] = "abc123"
    if grown.get("compression"):
        grown["compression"]["new_compression_field"] = "x"
        for rule in grown["compression"]["rules"]:
            rule["new_rule_field"] = 0
        for group in grown["compression"]["groups"]:
            group["new_group_field"] = [1]
            for stored in group["packages"].values():
                stored["new_stored_field"] = {}
    return grown


def _without_null_values(raw: dict[str, Any]) -> dict[str, Any]:
    """Optional values may be absent as well as null."""
    if isinstance(raw, dict):
        return {k: _without_null_values(v) for k, v in raw.items() if v is not None}
    if isinstance(raw, list):
        return [_without_null_values(v) for v in raw]
    return raw


def _invalid(base: dict[str, Any]) -> list[dict[str, Any]]:
    def changed(edit) -> dict[str, Any]:
        raw = copy.deepcopy(base)
        edit(raw)
        return raw

    target = base["assets"]["target"]
    first_state = 0
    return [
        {"name": "unsupported_schema_version", "reason": "a schema version the reader does "
         "not know", "metadata": changed(lambda r: r.update(
             schema_version=max(SUPPORTED_SCHEMA_VERSIONS) + 1))},
        {"name": "missing_vocab_size", "reason": "a required key is absent",
         "metadata": changed(lambda r: r.pop("vocab_size"))},
        {"name": "missing_state_capacity", "reason": "a required nested key is absent",
         "metadata": changed(lambda r: r["assets"]["target"]["states"][first_state]
                             .pop("capacity"))},
        {"name": "context_length_is_a_string", "reason": "a value of the wrong type",
         "metadata": changed(lambda r: r.update(context_length=str(r["context_length"])))},
        {"name": "query_length_is_fractional", "reason": "an integer field holds a fraction",
         "metadata": changed(lambda r: r["assets"]["target"]["functions"]["main"].update(
             query_length=target["functions"]["main"]["query_length"] + 0.5))},
        {"name": "unknown_asset_kind", "reason": "an enumerated name the contract does not "
         "have", "metadata": changed(lambda r: r["assets"]["target"].update(kind="turbo"))},
        {"name": "unknown_kv_write", "reason": "an enumerated name the contract does not "
         "have", "metadata": changed(lambda r: r.update(kv_write="scatter"))},
        {"name": "unknown_drafter_kind", "reason": "an enumerated name the contract does not "
         "have", "metadata": changed(lambda r: r["speculative_decoding"].update(
             drafter_kind="medusa"))},
        {"name": "unknown_state_kind", "reason": "an enumerated name the contract does not "
         "have", "metadata": changed(lambda r: r["assets"]["target"]["states"][first_state]
                                     .update(kind="paged_kv"))},
        {"name": "unknown_asset_role", "reason": "an asset role the contract does not have",
         "metadata": changed(lambda r: r["assets"].update(vision=r["assets"]["target"]))},
        {"name": "not_an_object", "reason": "metadata must be a JSON object",
         "metadata": [base]},
        {"name": "unknown_compression_mode", "reason": "an enumerated name the contract does "
         "not have", "metadata": changed(lambda r: r["compression"]["groups"][0].update(
             mode="sparse"))},
        {"name": "compressed_group_without_bits", "reason": "a required nested key is absent",
         "metadata": changed(lambda r: r["compression"]["groups"][0].pop("bits"))},
    ]


def contract_names() -> dict[str, list[str]]:
    """Every closed set of contract names (bundle.Name's subclasses), class name -> spellings,
    so the Swift reader can compare its enums with them as sets."""
    return {names.__name__: [str(name) for name in names]
            for names in sorted(Name.__subclasses__(), key=lambda names: names.__name__)}


def contract_files() -> dict[str, Any]:
    """The bundle's fixed names (files and the embedded metadata key), so the Swift reader can
    compare its BundleContract with them."""
    return {"metadata_file": METADATA_FILE, "embedded_metadata_key": EMBEDDED_METADATA_KEY,
            "tokenizer_file": TOKENIZER_FILE, "tokenizer_files": list(TOKENIZER_FILES)}


def examples() -> dict[str, Any]:
    valid = {name: metadata.to_json() for name, metadata in
             {**exported_metadata(), **compressed_metadata()}.items()}
    return {
        "supported_schema_versions": list(SUPPORTED_SCHEMA_VERSIONS),
        "names": contract_names(),
        "files": contract_files(),
        "valid": [{"name": name, "metadata": raw} for name, raw in valid.items()],
        "forward_compatible": [{"name": f"{name}_with_unknown_keys", "base": name,
                                "metadata": _with_unknown_keys(raw)}
                               for name, raw in valid.items()] + [
            {"name": "target_only_without_its_null_values", "base": "target_only",
             "metadata": _without_null_values(valid["target_only"])}],
        "invalid": _invalid(valid["dflash_mixed_rules"]) + _invalid_dflash2(valid["dflash2"]),
    }


def _invalid_dflash2(base: dict[str, Any]) -> list[dict[str, Any]]:
    def changed(edit) -> dict[str, Any]:
        raw = copy.deepcopy(base)
        edit(raw)
        return raw

    return [
        {"name": "unknown_selector_decoding", "reason": "an enumerated name the contract does "
         "not have", "metadata": changed(lambda r: r["speculative_decoding"]["dflash2"].update(
             selector_decoding="beam"))},
        {"name": "dflash2_settings_without_top_k", "reason": "a required nested key is absent",
         "metadata": changed(lambda r: r["speculative_decoding"]["dflash2"].pop(
             "selector_top_k"))},
    ]
