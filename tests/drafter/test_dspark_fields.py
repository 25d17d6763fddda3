"""The dspark variant's checkpoint fields (drafter/dspark.py) as other checkpoints spell them, and
the drafter architectures as the target loader knows them."""

import json

import pytest

from dflash_train.drafter import dspark
from dflash_train.drafter.checkpoint import ARCHITECTURES, load_drafter_config, save_drafter, to_hf_config
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.target.loading import resolve_model_source
from dflash_train.utils.errors import ModelError

from .test_model import tiny_config


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_drafter_architecture_is_refused_as_a_target(tmp_path, architecture):
    """target/loading.py sits below drafter/ and names the drafter architectures itself: a drafter
    directory of each kind given as the target is named a drafter, not loaded as a model."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    with pytest.raises(ModelError, match="is a DFlash drafter, not a target model"):
        resolve_model_source(tmp_path)


def test_fields_are_read_from_dflash_config_first_then_the_top_level():
    top = {"projector_type": "dspark", "markov_rank": 64, "markov_head_type": "gated"}
    want = {"variant": "dspark", "markov_rank": 64, "markov_head_type": "gated"}
    assert dspark.fields_from_checkpoint(top) == want  # a config.json with the keys at the top only
    nested = {**top, "dflash_config": {"markov_rank": 8, "markov_head_type": "vanilla"}}
    assert dspark.fields_from_checkpoint(nested) == {**want, "markov_rank": 8, "markov_head_type": "vanilla"}
    assert dspark.fields_from_checkpoint({"dflash_config": {"projector_type": "mlp"}, **top}) == {
        "variant": "dflash", "markov_rank": 64, "markov_head_type": "gated"}
    assert dspark.fields_from_checkpoint({}) == {"variant": "dflash", "markov_rank": 256,
                                                "markov_head_type": "vanilla"}


def test_a_dflash_config_json_carries_no_dspark_key():
    data = to_hf_config(tiny_config())
    assert data["architectures"] == ["DFlashDraftModel"]
    keys = {"projector_type", "markov_rank", "markov_head_type", "sample_from_anchor", "draft_vocab_size",
            "dspark_bonus_anchor"}
    assert not keys & set(data) and not keys & set(data["dflash_config"])
    added = to_hf_config(tiny_config(variant="dspark", markov_rank=5))
    assert list(added)[-6:] == ["projector_type", "markov_rank", "markov_head_type", "sample_from_anchor",
                                "draft_vocab_size", "dspark_bonus_anchor"]  # after DFlash's keys, in this order


def test_an_unknown_head_type_is_refused(tmp_path):
    out = save_drafter(DFlashDrafter(tiny_config(variant="dspark", markov_rank=5)), tmp_path / "d")
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, "markov_head_type": "recurrent"}))
    with pytest.raises(ModelError) as err:
        load_drafter_config(out)
    assert str(err.value) == (f"{out / 'config.json'}: markov_head_type 'recurrent' is not supported "
                              "(one of ['vanilla', 'gated'])")
