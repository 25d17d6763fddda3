"""The speculative tests share the generate tests' one-thread setting, the eval tests' tiny targets,
and the engine tests' random targets (`targets`)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from dflash_train.target.loading import load_causal_lm, load_tokenizer

from ..eval.conftest import loaded_targets  # noqa: F401 - fixture
from ..generate.conftest import _one_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def targets(tiny_targets):
    """{"llama": (model, tokenizer), "qwen3": ..., "qwen3_moe": ...}: 6-layer random fp32 targets (the
    mixture: 8 experts, 2 a token, one dense layer), with the suite's tokenizer."""
    out = {k: (load_causal_lm(d, dtype=torch.float32), load_tokenizer(d)) for k, d in tiny_targets.items()}
    tok = out["qwen3"][1]
    cfg = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=len(tok), max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.3, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, mlp_only_layers=[3])
    torch.manual_seed(1)  # a seed whose greedy outputs do not fall into a short loop
    out["qwen3_moe"] = (AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval(), tok)
    return out
