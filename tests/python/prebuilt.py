"""Bundles the build exported once, as actions, for tests that read a bundle rather than test
the export itself: they copy it instead of exporting it again in their own process."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TINY_BUNDLE = "MUSEFLASH_TINY_BUNDLE"
# //tests/runtime:dflash2_bundle: the tiny target fused with a random DFlash2 drafter.
DFLASH2_BUNDLE = "MUSEFLASH_DFLASH2_BUNDLE"
# //tests/runtime:dflash2_slice_bundle: the same export with --kv-write slice.
DFLASH2_SLICE_BUNDLE = "MUSEFLASH_DFLASH2_SLICE_BUNDLE"
# //tests/integration:compressed_bundle: the demo pair at context 64, compressed by the rules of
# COMPRESSION_RULES (both modes, and one 'none' rule).
COMPRESSED_BUNDLE = "MUSEFLASH_COMPRESSED_BUNDLE"
COMPRESSION_RULES = "MUSEFLASH_COMPRESSION_RULES"


def prebuilt_bundle(into: Path, variable: str = TINY_BUNDLE) -> Path:
    """A writable copy, at `into`/bundle, of the bundle whose runfiles path `variable` holds
    (by default //tests/integration:demo_bundle, the tiny fused pair at context 64 with an
    8-token prefill)."""
    source = os.environ.get(variable)
    if not source:
        raise RuntimeError(f"{variable} is not set: run this test through Bazel, whose target "
                           "sets it to a bundle exported in the same build")
    copy = Path(into) / "bundle"
    # Bazel's outputs are read-only: copy the bytes, not the modes.
    shutil.copytree(source, copy, copy_function=shutil.copyfile)
    for directory, _, _ in os.walk(copy):
        os.chmod(directory, 0o755)
    return copy
