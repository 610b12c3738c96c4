"""Measures peak memory while loading a medium synthetic target checkpoint.

    python -m museflash.tools.measure_load_memory [--work-dir DIR] [--dtype bf16|fp32]

Writes a ~270 MB bf16 checkpoint (generated tensor by tensor), then loads it in a fresh
process and prints the peak RSS increase during loading next to the loaded weight bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from museflash.checkpoint import target_checkpoint_key, write_safetensors
from museflash.demo_checkpoint import DEMO_TARGET_CONFIG
from museflash.models.muse_glimmer import MuseGlimmerConfig, MuseGlimmerForCausalLM

MEDIUM_TEXT_CONFIG = {
    "vocab_size": 16384,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "layer_types": DEMO_TARGET_CONFIG["text_config"]["layer_types"][:4] * 3,
    "layer_rope_theta": DEMO_TARGET_CONFIG["text_config"]["layer_rope_theta"][:4] * 3,
}


def write_medium_checkpoint(directory: Path) -> None:
    config = copy.deepcopy(DEMO_TARGET_CONFIG)
    config["text_config"].update(MEDIUM_TEXT_CONFIG)
    with torch.device("meta"):
        shell = MuseGlimmerForCausalLM(MuseGlimmerConfig.from_dict(config), max_context=256)
    generator = torch.Generator().manual_seed(0)
    tensors = (
        (target_checkpoint_key(name), torch.randn(param.shape, generator=generator) * 0.02)
        for name, param in shell.named_parameters()
    )
    write_safetensors(tensors, directory, config, dtype="bf16", max_shard_bytes=100_000_000)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure_in_this_process(directory: Path, dtype: str) -> None:
    from museflash.checkpoint import load_target

    baseline = _rss_kib("VmRSS")
    baseline_anon = _rss_kib("RssAnon")
    # VmHWM also counts mapped file pages (clean page cache the kernel can drop), so the
    # anonymous peak, which is what loading really costs, is sampled separately.
    anon_peak = [baseline_anon]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            anon_peak[0] = max(anon_peak[0], _rss_kib("RssAnon"))

    sampler = threading.Thread(target=sample)
    sampler.start()
    model = load_target(directory, dtype=dtype, max_context=256)
    done.set()
    sampler.join()
    anon_peak[0] = max(anon_peak[0], _rss_kib("RssAnon"))
    peak = _rss_kib("VmHWM")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({
        "dtype": dtype,
        "weight_mb": round(weight_bytes / 2**20, 1),
        "peak_rss_delta_mb": round((peak - baseline) / 1024, 1),
        "peak_anon_delta_mb": round((anon_peak[0] - baseline_anon) / 1024, 1),
        "anon_overhead_mb": round((anon_peak[0] - baseline_anon) / 1024
                                  - weight_bytes / 2**20, 1),
        "largest_tensor_mb": round(max(p.numel() * p.element_size()
                                       for p in model.parameters()) / 2**20, 1),
    }))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], action="append")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        _measure_in_this_process(args.measure, args.dtype[0])
        return
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        directory = Path(scratch) / "target"
        write_medium_checkpoint(directory)
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        print(f"checkpoint: {size / 2**20:.1f} MB of bf16 safetensors in {directory}")
        for dtype in args.dtype or ["bf16", "fp32"]:
            # A fresh process so the generator's memory does not hide the loader's peak.
            subprocess.run(
                [sys.executable, "-m", "museflash.tools.measure_load_memory",
                 "--measure", str(directory), "--dtype", dtype],
                check=True,
            )


if __name__ == "__main__":
    main()
