"""The statistics compression_figures reports beside perplexity."""

import math

import pytest
import torch

from museflash.compression import Scheme
from museflash.tools.compression_figures import paired_difference, weight_error


def test_paired_difference_is_per_token_with_documents_as_the_unit():
    counts = torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64)
    reference = torch.tensor([25.0, 40.0, 90.0], dtype=torch.float64)
    same = paired_difference(reference, reference, counts)
    assert same == {"loss_per_token": 0.0, "standard_error": 0.0}
    # the same shift on every token: known exactly, no spread between documents
    shifted = paired_difference(reference + 0.25 * counts, reference, counts)
    assert shifted["loss_per_token"] == pytest.approx(0.25)
    assert shifted["standard_error"] == pytest.approx(0.0, abs=1e-12)
    # differences 1, 1, 4 nats: 6 / 60 per token; residuals 0, -1, +1 around it
    spread = paired_difference(reference + torch.tensor([1.0, 1.0, 4.0], dtype=torch.float64),
                               reference, counts)
    assert spread["loss_per_token"] == pytest.approx(0.1)
    assert spread["standard_error"] == pytest.approx(math.sqrt(3 / 2 * 2) / 60)
    with pytest.raises(ValueError, match="two documents"):
        paired_difference(reference[:1], reference[:1], counts[:1])


def test_weight_error_counts_only_the_compressed_weights():
    original = {"a": torch.ones(2, 2), "b": torch.full((2, 2), 2.0), "kept": torch.ones(3)}
    params = {"a": torch.full((2, 2), 1.5), "b": torch.full((2, 2), 2.0), "kept": torch.zeros(3)}
    schemes = {key: Scheme("linear", 8) for key in ("a", "b")}
    # (4 * 0.25) / (4 * 1 + 4 * 4); "kept" is not compressed, so its difference is not counted
    assert weight_error(original, params, schemes) == pytest.approx(1 / 20)
