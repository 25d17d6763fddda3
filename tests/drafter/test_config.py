import pytest

from dflash_train.drafter.config import DrafterConfig, default_target_layer_ids, drafter_config_from_target

from .test_model import tiny_config


def test_default_target_layers():
    assert default_target_layer_ids(30) == [1, 8, 14, 21, 27]  # SmolLM2-135M
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(4) == [1]
    for L in range(1, 80):
        ids = default_target_layer_ids(L)
        assert ids == sorted(set(ids)) and all(0 <= i < L for i in ids)
        if L >= 8:
            assert ids[0] == 1 and ids[-1] == L - 3 and len(ids) == 5


def test_from_qwen3_and_llama_configs():
    from transformers import LlamaConfig, Qwen3Config

    q = Qwen3Config(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_hidden_layers=12,
                    intermediate_size=300, vocab_size=1000, rms_norm_eps=1e-5, max_position_embeddings=4096)
    cfg = drafter_config_from_target(q, mask_token_id=999)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 8, 2, 32)
    assert cfg.num_hidden_layers == 5 and cfg.block_size == 16 and cfg.target_layer_ids == [1, 3, 5, 7, 9]
    assert cfg.num_target_layers == 12 and cfg.intermediate_size == 300 and cfg.rms_norm_eps == 1e-5
    assert cfg.layer_types == ["full_attention"] * 5 and cfg.rope_scaling is None
    lcfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=8, vocab_size=500,
                       rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1234.0})
    d = drafter_config_from_target(lcfg, mask_token_id=0, sliding_window=128, block_size=8)
    assert d.head_dim == 16 and d.rope_theta == 1234.0 and d.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert d.layer_types == ["sliding_attention"] * 5 and d.sliding_window == 128


@pytest.mark.parametrize("kw,msg", [
    (dict(target_layer_ids=[0, 7]), "outside the target"),
    (dict(mask_token_id=23), "outside the embedding table"),
    (dict(num_key_value_heads=3), "multiple"),
    (dict(block_size=1), "block_size"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=None), "sliding_window"),
    (dict(layer_types=["full_attention"]), "entries"),
    (dict(layer_types=["weird", "full_attention"]), "unknown layer types"),
    (dict(target_layer_ids=[1, 1]), "duplicates"),
])
def test_validation_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_config(**kw)


def test_mask_variants_group_layers():
    cfg = tiny_config(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert cfg.mask_variants() == [(6, True), (None, False)]
    assert isinstance(cfg, DrafterConfig)
