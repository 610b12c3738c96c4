"""Config numbers a graph cannot survive are refused when config.json is read, naming the
field: a NaN or infinite value anywhere (JSON parsers accept both), an eps or soft cap of 0 or
below, a drafter block_size below 2 (issue: precision-audit-holes, part 2 and 3)."""

import json

import pytest

from museflash.builtin.demo_checkpoint import write_tiny_checkpoints
from museflash.checkpoint.configs import check_configs
from museflash.checkpoint.tensor_files import CheckpointError


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("pair"), tokenizer=True)


def _edited(path, edit):
    config = json.loads((path / "config.json").read_text())
    original = json.dumps(config)
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return original


def _refusal(pair, which, edit):
    target, drafter = pair
    directory = target if which == "target" else drafter
    original = _edited(directory, edit)
    try:
        with pytest.raises(CheckpointError) as error:
            check_configs(target, drafter)
    finally:
        (directory / "config.json").write_text(original)
    message = str(error.value)
    assert "\n" not in message and str(directory / "config.json") in message
    return message


def test_the_unedited_pair_passes(pair):
    assert check_configs(*pair).drafter.block_size >= 2


@pytest.mark.parametrize("which, edit, named", [
    ("drafter", lambda c: c.__setitem__("rms_norm_eps", float("nan")), "rms_norm_eps is nan"),
    ("target", lambda c: c["text_config"].__setitem__("rms_norm_eps", float("inf")),
     "text_config.rms_norm_eps is inf"),
    ("target", lambda c: c["text_config"].__setitem__("final_logit_softcapping", 0),
     "text_config.final_logit_softcapping is 0"),
    ("target", lambda c: c["text_config"].__setitem__("rms_norm_eps", -1e-6),
     "text_config.rms_norm_eps is -1e-06"),
    ("drafter", lambda c: c.__setitem__("block_size", 1), "block_size 1"),
    ("drafter", lambda c: c.__setitem__("block_size", 0), "block_size 0"),
])
def test_a_number_the_graph_cannot_survive_is_refused_naming_it(pair, which, edit, named):
    message = _refusal(pair, which, edit)
    assert named in message
    assert "--num-draft-tokens" not in message


def test_a_null_soft_cap_is_not_refused(pair):
    target, drafter = pair
    original = _edited(target, lambda c: c["text_config"].__setitem__(
        "final_logit_softcapping", None))
    try:
        assert check_configs(target, drafter).target.final_logit_softcapping is None
    finally:
        (target / "config.json").write_text(original)
