"""Tiny random chat models and a tiny ChatML tokenizer, built in-process (no downloads)."""

from __future__ import annotations

import torch

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "What is the capital of France? Paris is the capital of France.",
    "Write a short poem about the sea and the wind.",
    "How do I sort a list in Python? Use sorted(xs) or xs.sort().",
    "Explain gravity to a child: things fall down because the Earth pulls them.",
    "Name three fruits: apple, banana, cherry.",
] * 20


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    tok.chat_template = CHATML
    return tok


def make_model(kind: str = "llama", vocab: int = 384, seed: int = 0):
    """A 2-layer random model. A large init range makes logits peaked, so greedy choices
    are far from ties and fp32 rounding cannot flip them."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.15, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return LlamaForCausalLM(cfg).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)).eval()
    if kind == "qwen3_moe":  # 8 experts, 2 a token, in both layers
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                  moe_intermediate_size=32)).eval()
    raise ValueError(kind)
