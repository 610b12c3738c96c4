"""A checkpoint's tokenizer: checked against the model before any work, copied into the bundle
and described in metadata.json."""

import json
import shutil

import pytest
from prebuilt import prebuilt_bundle

from museflash.builtin.demo_checkpoint import (
    TINY_DRAFTER_CONFIG,
    builtin_checkpoints,
    shallow_tiny_pair_configs,
    write_tiny_checkpoints,
    write_word_tokenizer,
)
from museflash.bundle import TOKENIZER_FILE, Metadata
from museflash.checkpoint.configs import check_configs
from museflash.checkpoint.tensor_files import CheckpointError
from museflash.checkpoint.tokenizer import read_tokenizer
from museflash.export.options import ExportOptions
from museflash.export.pipeline import export_bundle
from museflash.export.progress import Progress

VOCAB = 512
MASK = TINY_DRAFTER_CONFIG["mask_token_id"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny pair over the target's first four layers (the tokenizer does not depend on
    depth), with a tokenizer of two special tokens."""
    root = tmp_path_factory.mktemp("checkpoints")
    target_config, drafter_config = shallow_tiny_pair_configs()
    target, drafter = write_tiny_checkpoints(root, target_config=target_config,
                                             drafter_config=drafter_config)
    write_word_tokenizer(target, VOCAB, {"<pad>": 0, "<mask>": MASK})
    return target, drafter


def test_the_tokenizer_is_described_from_the_file(checkpoints):
    target, drafter = checkpoints
    tokenizer = check_configs(target, drafter).tokenizer
    assert tokenizer.files == ["tokenizer.json", "tokenizer_config.json"]
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.special_tokens == {"<pad>": 0, "<mask>": MASK}


def test_a_checkpoint_without_tokenizer_has_none(tmp_path):
    target, drafter = write_tiny_checkpoints(tmp_path)
    assert check_configs(target, drafter).tokenizer is None


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, checkpoints):
    write_word_tokenizer(tmp_path, VOCAB + 12, {"<mask>": 7})
    with pytest.raises(CheckpointError) as error:
        read_tokenizer(tmp_path, VOCAB)
    # Both sizes are named, so the user sees which side is off.
    assert str(VOCAB + 12) in str(error.value) and str(VOCAB) in str(error.value)
    assert "vocab_size" in str(error.value)


def test_a_tokenizer_smaller_than_the_vocabulary_leaves_padding_rows(tmp_path):
    """Real checkpoints have more embedding rows than tokens (Qwen3: 151936 for 151669)."""
    write_word_tokenizer(tmp_path, VOCAB - 12, {"<mask>": 7})
    described = read_tokenizer(tmp_path, VOCAB, 7)
    assert described.vocab_size == VOCAB - 12
    assert described.special_tokens == {"<mask>": 7}


def test_a_mask_token_that_is_not_special_is_refused(tmp_path):
    write_word_tokenizer(tmp_path, VOCAB, {"<pad>": 0})
    with pytest.raises(CheckpointError, match=f"mask_token_id {MASK} is not one of the "
                                              r"tokenizer's special tokens \[0\]"):
        read_tokenizer(tmp_path, VOCAB, MASK)


def test_an_unreadable_tokenizer_is_refused(tmp_path):
    (tmp_path / TOKENIZER_FILE).write_text('{"model": 3}')
    with pytest.raises(CheckpointError, match="not a tokenizer the tokenizers library reads"):
        read_tokenizer(tmp_path, VOCAB)


def test_the_export_copies_the_tokenizer_and_records_it(tmp_path):
    """The build's export of the built-in tiny pair (//tests/integration:demo_bundle), whose
    target has a word-level tokenizer, rather than another export here."""
    out = prebuilt_bundle(tmp_path)
    metadata = Metadata.read(out)
    assert metadata.source.checkpoint == "builtin:tiny"
    assert metadata.tokenizer.files == ["tokenizer.json", "tokenizer_config.json"]
    with builtin_checkpoints("tiny") as (target, _):
        for name in metadata.tokenizer.files:
            assert (out / name).read_bytes() == (target / name).read_bytes()
    assert metadata.speculative_decoding.mask_token_id in metadata.tokenizer.special_tokens.values()


def test_a_bad_tokenizer_stops_the_export_before_anything_is_written(checkpoints, tmp_path):
    target, drafter = checkpoints
    broken = tmp_path / "target"
    shutil.copytree(target, broken)
    data = json.loads((broken / TOKENIZER_FILE).read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<mask>"]
    (broken / TOKENIZER_FILE).write_text(json.dumps(data))
    out = tmp_path / "bundle"
    with pytest.raises(CheckpointError, match=f"mask_token_id {MASK} is not one of"):
        export_bundle(ExportOptions(output_dir=out, checkpoint=broken,
                                    drafter_checkpoint=drafter, fused_target=True,
                                    dflash_drafter=True, conversion_processes=1),
                      Progress(echo=lambda _line: None))
    assert not out.exists()


@pytest.mark.parametrize("template, construct", [
    ("{% macro turn(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{{ turn(m) }}"
     "{% endfor %}", "{% macro %}"),
    ("{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m.content }}{% endfor %}",
     "function strftime_now()"),
    ("{% for m in messages %}{{ m.content | wordwrap(8) }}{% endfor %}", "filter wordwrap"),
    ("{% for m in messages %}{{ m.content }", "not valid Jinja"),
])
def test_a_template_the_swift_renderer_lacks_stops_the_export(checkpoints, tmp_path, template,
                                                              construct):
    """No bundle ships a chat template its runtime cannot render: the export names the construct
    and the file before anything is written."""
    target, drafter = checkpoints
    templated = tmp_path / "target"
    shutil.copytree(target, templated)
    (templated / "chat_template.jinja").write_text(template)
    out = tmp_path / "bundle"
    with pytest.raises(CheckpointError) as error:
        export_bundle(ExportOptions(output_dir=out, checkpoint=templated,
                                    drafter_checkpoint=drafter, fused_target=True,
                                    dflash_drafter=True, conversion_processes=1),
                      Progress(echo=lambda _line: None))
    message = str(error.value)
    assert construct in message and "chat_template.jinja" in message and "fix:" in message
    assert "\n" not in message
    assert not out.exists()


def test_a_renderable_template_is_copied_and_its_turn_end_recorded(checkpoints, tmp_path):
    target, _ = checkpoints
    templated = tmp_path / "target"
    shutil.copytree(target, templated)
    write_word_tokenizer(templated, VOCAB, {"<pad>": 0, "<mask>": MASK, "<end>": 3})
    (templated / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content | trim }}<end>\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    described = read_tokenizer(templated, VOCAB, MASK)
    assert "chat_template.jinja" in described.files
    assert described.end_of_turn_ids == [3]
