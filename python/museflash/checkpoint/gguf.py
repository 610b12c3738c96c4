"""GGUF checkpoints (llama.cpp, Ollama, LM Studio): one `.gguf` file read into the Hugging Face
layout the rest of museflash reads.

`GGUFCheckpoint` reads the file with the `gguf` package that ggml's project publishes:
- the config: the architecture's metadata (`llama.*`, `qwen3.*`) mapped onto transformers'
  config.json fields, the token ids from `tokenizer.ggml.*`;
- the tensors, one at a time: renamed to transformers' keys, dequantized to float32 by the
  `gguf` package's own kernels (QUANT_TYPES), and for Llama the Q/K row permutation that
  llama.cpp's converter applies for its RoPE undone (`unpermute_rows`);
- the tokenizer: a byte-level BPE (`tokenizer.ggml.model` "gpt2") rebuilt as a `tokenizer.json`
  with the pre-tokenizer `tokenizer.ggml.pre` names, its control tokens as special tokens, and
  the chat template (`tokenizer.chat_template`) in `tokenizer_config.json`.

`write_hf_checkpoint` writes all of it as a checkpoint folder (float32 safetensors, in shards
so that at most one shard is held in memory); the export reads a `.gguf` `--checkpoint` through
one (`staged_checkpoint`). Anything the reader does not implement (another architecture,
quantization type, tokenizer model or pre-tokenizer, Llama 3's RoPE frequency table) is
refused by name, as is a truncated file, before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from museflash.checkpoint.chat_template import TOKENIZER_CONFIG_FILE
from museflash.checkpoint.tensor_files import CONFIG_FILE, CheckpointError, write_safetensors

GGUF_SUFFIX = ".gguf"
# Quantization types whose dequantization is implemented and tested here (the gguf package's
# numpy kernels); any other is refused by name.
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
               "Q6_K")
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}
GENERATION_CONFIG_FILE = "generation_config.json"
SHARD_BYTES = 1 << 30

# GGUF tensor names (after `blk.N.`) -> transformers' (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizers by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab splits text before BPE.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read into a checkpoint; names the file and the problem."""


def is_gguf(path: str | Path | None) -> bool:
    return path is not None and Path(path).suffix.lower() == GGUF_SUFFIX


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's converter's permutation of a Llama q_proj / k_proj weight [heads *
    head_dim, in]: it regroups each head's rows from transformers' rotate-half pairing (i, i +
    head_dim / 2) into interleaved pairs (2i, 2i + 1); this puts them back."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@dataclass(frozen=True)
class GGUFTensorInfo:
    gguf_name: str
    index: int  # in the file's tensor list
    key: str  # transformers' checkpoint key
    quant_type: str
    shape: tuple[int, ...]  # transformers' (row-major) order


def open_reader(gguf: Any, path: Path) -> Any:
    """gguf.GGUFReader over `path`, the file's header parsed through a plain ndarray view of its
    mapping. The reader takes a slice of its np.memmap for every value it parses (two per
    string of a tokenizer's vocabulary and merges), and every memmap slice runs numpy's
    Python-level memmap bookkeeping: SmolLM2's file took 4.7 s to open that way, 1.3 s this
    way. The fields and tensors are the same values, still backed by the mapped file and
    read-only (tests/python/test_gguf.py compares them with the plain reader's)."""

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            values = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return values.view(values.dtype.newbyteorder(order))

    return Reader(str(path), "r")


class GGUFCheckpoint:
    """One `.gguf` file: its config, tensors and tokenizer in the Hugging Face layout."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: GGUF file not found")
        import gguf

        self._gguf = gguf
        try:
            self._reader = open_reader(gguf, self.path)
        except Exception as error:  # noqa: BLE001 - the reader raises plain errors on bad input
            raise GGUFError(f"{self.path}: not a readable GGUF file ({type(error).__name__}: "
                            f"{error}); re-download it or re-convert it with llama.cpp") from error
        self.architecture = self._string("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not one museflash "
                f"reads; it reads {sorted(ARCHITECTURES)} (or give a Hugging Face checkpoint "
                "folder)")
        self._check_complete()
        self.config = self._config()
        self._tensors = self._tensor_infos()
        self._check_tensor_set()

    # --- metadata ----------------------------------------------------------------------------

    def _field(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        return None if field is None else field.contents()

    def _string(self, key: str) -> str | None:
        value = self._field(key)
        return None if value is None else str(value)

    def _arch(self, key: str, required: bool = True) -> Any:
        value = self._field(f"{self.architecture}.{key}")
        if value is None and required:
            raise GGUFError(f"{self.path}: metadata {self.architecture}.{key} is missing "
                            "(a damaged or incomplete GGUF file)")
        return value

    def _check_complete(self) -> None:
        size = self.path.stat().st_size
        for tensor in self._reader.tensors:
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size:
                raise GGUFError(
                    f"{self.path}: tensor {tensor.name!r} ends at byte {end} but the file has "
                    f"{size} bytes (truncated); re-download it")

    def _config(self) -> dict[str, Any]:
        model_type, architecture = ARCHITECTURES[self.architecture]
        heads = int(self._arch("attention.head_count"))
        hidden = int(self._arch("embedding_length"))
        head_dim = self._arch("attention.key_length", required=False)
        head_dim = self._arch("rope.dimension_count", required=False) if head_dim is None \
            else head_dim
        tokens = self._field("tokenizer.ggml.tokens")
        vocab = self._arch("vocab_size", required=False)
        vocab = int(vocab) if vocab is not None else len(tokens or ())
        names = {t.name for t in self._reader.tensors}
        if "rope_freqs.weight" in names:
            raise GGUFError(
                f"{self.path}: tensor 'rope_freqs.weight' (Llama 3's scaled RoPE frequencies) "
                "is not implemented for GGUF files yet; export the Hugging Face checkpoint "
                "folder of this model instead")
        scaling = self._string(f"{self.architecture}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise GGUFError(f"{self.path}: RoPE scaling {scaling!r} is not implemented for GGUF "
                            "files; export the Hugging Face checkpoint folder instead")
        config = {
            "architectures": [architecture],
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", required=False)
                                       or heads),
            "head_dim": int(head_dim) if head_dim is not None else hidden // heads,
            "max_position_embeddings": int(self._arch("context_length")),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._arch("rope.freq_base", required=False) or 10_000.0),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": "float32",
        }
        if model_type == "llama":
            config["mlp_bias"] = False
        for name in ("bos", "eos", "padding", "unknown"):
            value = self._field(f"tokenizer.ggml.{name}_token_id")
            if value is not None:
                key = {"padding": "pad", "unknown": "unk"}.get(name, name)
                config[f"{key}_token_id"] = int(value)
        return config

    # --- tensors ----------------------------------------------------------------------------

    def _tensor_infos(self) -> list[GGUFTensorInfo]:
        infos = []
        for index, tensor in enumerate(self._reader.tensors):
            quant = tensor.tensor_type.name
            key = self._hf_key(tensor.name)
            if quant not in QUANT_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {tensor.name!r} is quantized as {quant}, which "
                    f"museflash does not dequantize (it reads {', '.join(QUANT_TYPES)}); "
                    "re-quantize the model to one of those with llama.cpp's llama-quantize")
            infos.append(GGUFTensorInfo(tensor.name, index, key, quant,
                                        tuple(int(d) for d in reversed(tensor.shape))))
        return infos

    def _check_tensor_set(self) -> None:
        """Every tensor the config's model needs is in the file."""
        per_layer = [name for name in _LAYER_TENSORS
                     if self.architecture == "qwen3" or "_norm.weight" not in name
                     or name in ("attn_norm.weight", "ffn_norm.weight")]
        wanted = ["token_embd.weight", "output_norm.weight"] + [
            f"blk.{layer}.{name}" for layer in range(self.config["num_hidden_layers"])
            for name in per_layer]
        present = {info.gguf_name for info in self._tensors}
        missing = [name for name in wanted if name not in present]
        if missing:
            raise GGUFError(f"{self.path}: tensor {missing[0]!r} is missing ({len(missing)} "
                            f"of the {len(wanted)} a {self.architecture} model of "
                            f"{self.config['num_hidden_layers']} layers needs); the file is "
                            "damaged or of another model")

    def _hf_key(self, name: str) -> str:
        if name in _TOP_TENSORS:
            return _TOP_TENSORS[name]
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and \
                parts[2] in _LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
        raise GGUFError(f"{self.path}: tensor {name!r} is not one of a {self.architecture} "
                        "model museflash reads (a different or newer architecture variant)")

    @property
    def tensor_infos(self) -> list[GGUFTensorInfo]:
        return list(self._tensors)

    def tensor(self, info: GGUFTensorInfo) -> np.ndarray:
        """One tensor, dequantized to float32 in transformers' layout (Llama's q/k rows
        un-permuted)."""
        raw = self._reader.tensors[info.index]
        values = self._gguf.quants.dequantize(raw.data, raw.tensor_type)
        values = np.asarray(values, dtype=np.float32).reshape(info.shape)
        if self.architecture == "llama":
            if info.key.endswith("self_attn.q_proj.weight"):
                values = unpermute_rows(values, self.config["num_attention_heads"])
            elif info.key.endswith("self_attn.k_proj.weight"):
                values = unpermute_rows(values, self.config["num_key_value_heads"])
        # Own, writable memory: an F32 tensor is otherwise a view of the read-only file map.
        return np.array(values, dtype=np.float32, order="C", copy=True)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(transformers key, float32 values), one tensor at a time, in file order."""
        for info in self._tensors:
            yield info.key, self.tensor(info)

    # --- tokenizer --------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._string("tokenizer.chat_template")

    def _token_name(self, key: str) -> str | None:
        token_id = self._field(f"tokenizer.ggml.{key}_token_id")
        tokens = self._field("tokenizer.ggml.tokens")
        return None if token_id is None or tokens is None else str(tokens[int(token_id)])

    def tokenizer_json(self) -> str | None:
        """The byte-level BPE tokenizer as a `tokenizer.json` (None when the file has none)."""
        from tokenizers import (
            AddedToken,
            Regex,
            Tokenizer,
            decoders,
            models,
            pre_tokenizers,
            processors,
        )

        model = self._string("tokenizer.ggml.model")
        if model is None:
            return None
        if model != "gpt2":
            raise GGUFError(
                f"{self.path}: tokenizer model {model!r} is not implemented (museflash reads "
                "byte-level BPE, 'gpt2'); export the Hugging Face checkpoint folder instead")
        pre = self._string("tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{self.path}: pre-tokenizer {pre!r} is not implemented (museflash "
                            f"reads {', '.join(PRE_TOKENIZERS)})")
        tokens = [str(t) for t in self._field("tokenizer.ggml.tokens")]
        types = list(self._field("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(str(m).split(" ", 1)) for m in self._field("tokenizer.ggml.merges")
                  or ()]
        vocab = {token: i for i, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise GGUFError(f"{self.path}: tokenizer.ggml.tokens repeats a token; a BPE "
                            "vocabulary needs each token once")
        llama3 = pre in ("llama-bpe", "llama3")
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                         byte_fallback=False, ignore_merges=llama3))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                              use_regex=pre in ("default", "gpt2", "smollm"))
        if pre == "smollm":
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("default", "gpt2"):
            tokenizer.pre_tokenizer = byte_level
        else:
            split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if llama3 else _QWEN2_SPLIT),
                                         behavior="isolated", invert=False)
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                      for i, kind in enumerate(types) if kind == _CONTROL])
        tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                              for i, kind in enumerate(types) if kind == _USER_DEFINED])
        bos = self._token_name("bos")
        if self._field("tokenizer.ggml.add_bos_token") and bos is not None:
            bos_id = vocab[bos]
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        else:
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return tokenizer.to_str()

    def tokenizer_config(self) -> dict[str, Any]:
        """`tokenizer_config.json`: the special tokens by role and the chat template."""
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "add_bos_token": bool(self._field(
                                      "tokenizer.ggml.add_bos_token") or False)}
        for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                          ("padding", "pad_token")):
            token = self._token_name(key)
            if token is not None:
                config[name] = token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return config

    def generation_config(self) -> dict[str, Any]:
        """`generation_config.json`: the ids that end generation (eos, and end-of-turn)."""
        ends = [self._field(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")]
        ends = sorted({int(e) for e in ends if e is not None})
        config: dict[str, Any] = {}
        if "bos_token_id" in self.config:
            config["bos_token_id"] = self.config["bos_token_id"]
        if ends:
            config["eos_token_id"] = ends[0] if len(ends) == 1 else ends
        return config


def write_hf_checkpoint(checkpoint: GGUFCheckpoint, out_dir: str | Path) -> Path:
    """The GGUF file as a Hugging Face checkpoint folder: config.json, float32 safetensors
    (written one tensor at a time into shards of at most SHARD_BYTES), tokenizer.json,
    tokenizer_config.json (with the chat template) and generation_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = checkpoint.tokenizer_json()  # refused tokenizers fail before any tensor
    tensors = ((key, torch.from_numpy(values)) for key, values in checkpoint.tensors())
    write_safetensors(tensors, out_dir, checkpoint.config, dtype="fp32",
                      max_shard_bytes=SHARD_BYTES)
    if tokenizer is not None:
        (out_dir / "tokenizer.json").write_text(tokenizer)
        (out_dir / TOKENIZER_CONFIG_FILE).write_text(
            json.dumps(checkpoint.tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    (out_dir / GENERATION_CONFIG_FILE).write_text(
        json.dumps(checkpoint.generation_config(), indent=2) + "\n")
    return out_dir


@contextlib.contextmanager
def staged_checkpoint(path: str | Path) -> Iterator[Path]:
    """A `.gguf` file as a temporary Hugging Face checkpoint folder, removed afterwards."""
    checkpoint = GGUFCheckpoint(path)
    with tempfile.TemporaryDirectory(prefix="museflash-gguf-") as scratch:
        staged = write_hf_checkpoint(checkpoint, Path(scratch) / Path(path).stem)
        try:
            yield staged
        except CheckpointError as error:
            # Name the user's file, not the temporary folder it was read into.
            message = str(error).replace(f"{staged / CONFIG_FILE}", f"{path} (its config)")
            raise type(error)(message.replace(str(staged), str(path))) from error

