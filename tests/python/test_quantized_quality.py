"""//:quantized_quality on the trained demo target: the uncompressed row is its own reference,
each preset compresses weights and moves the perplexity by what the paired losses say, and the
held-out files are cut as asked."""

import math

import pytest

from museflash.tools.quantized_quality import held_out_documents, quality


@pytest.fixture(scope="module")
def report():
    return quality("demo", ["8bit", "4bit"], documents=3, max_tokens=96, log=lambda _: None)


def test_the_uncompressed_target_is_the_reference(report):
    none = report["none"]
    assert none["compressed_tensors"] == 0
    assert none["top1_agreement_with_uncompressed"] == 1.0
    assert 1.0 < none["perplexity"] < 100.0 and none["bits_per_byte"] > 0


def test_each_preset_compresses_and_its_paired_loss_is_its_perplexity_ratio(report):
    assert set(report["paired_loss_per_token"]) == {"8bit - none", "4bit - none"}
    for preset in ("8bit", "4bit"):
        figures = report[preset]
        assert figures["compressed_tensors"] > 0
        ratio = figures["perplexity"] / report["none"]["perplexity"]
        paired = report["paired_loss_per_token"][f"{preset} - none"]
        assert math.isclose(math.exp(paired["loss_per_token"]), ratio, rel_tol=1e-9)
        assert paired["standard_error"] >= 0
    # 8-bit weights move the trained target's predictions far less than 4-bit ones do.
    assert report["8bit"]["top1_agreement_with_uncompressed"] > 0.95
    assert (report["8bit"]["top1_agreement_with_uncompressed"]
            >= report["4bit"]["top1_agreement_with_uncompressed"])


def test_held_out_files_are_bos_led_and_cut_to_the_limit():
    from tokenizers import Tokenizer

    from museflash.builtin.demo_checkpoint import builtin_checkpoints

    with builtin_checkpoints("demo") as (target_dir, _):
        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    documents, nbytes = held_out_documents(tokenizer, bos_id=7, documents=4, max_tokens=50)
    assert len(documents) == 4
    assert all(d[0] == 7 and len(d) == 50 for d in documents)
    assert 4 * 49 <= nbytes < 4 * 49 * 16
