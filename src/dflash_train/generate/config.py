"""`GenerateConfig`: everything `dflash-train generate` can be told, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_train.generate.sampling import Sampling
from dflash_train.target.attn_impl import AttnImplementation


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class GenerateConfig:
    output: str = field(default="", metadata=_help("output JSONL file (appended to; a rerun resumes)"))
    target: str = field(default="builtin", metadata=_help("'builtin', a model directory or a .gguf file"))
    prompts: list[str] = field(default_factory=list, metadata=_help("prompt files/dirs whose assistant turns to regenerate"))
    synthesize: int = field(default=0, metadata=_help("also write N new conversations, user turn written by the target"))
    skip_bad: bool = field(default=False, metadata=_help("skip malformed prompt rows instead of stopping"))
    mix: bool = field(default=False, metadata=_help(
        "take the prompt files one row of each in turn and start synthesised conversations at their share of what "
        "is left, so a run stopped early (a time limit) holds every source; default: the files in order, then synthesis"))

    engine: Literal["builtin", "http"] = field(default="builtin", metadata=_help("builtin (in-process) or http (OpenAI-compatible server)"))
    # answers
    max_new_tokens: int = field(default=1024, metadata=_help("token limit of each assistant turn"))
    temperature: float = field(default=0.0, metadata=_help("answer sampling temperature; 0 = greedy"))
    top_p: float = field(default=1.0, metadata=_help("answer nucleus sampling; 1 = off"))
    top_k: int = field(default=0, metadata=_help("answer top-k sampling; 0 = off"))
    seed: int = field(default=0, metadata=_help("sampling seed (sampled rows are reproducible per conversation)"))
    # synthesised user turns (--synthesize)
    prompt_temperature: float = field(default=1.0, metadata=_help("sampling temperature of synthesised user turns"))
    prompt_top_p: float = field(default=0.95, metadata=_help("top-p of synthesised user turns"))
    prompt_top_k: int = field(default=0, metadata=_help("top-k of synthesised user turns"))
    prompt_max_tokens: int = field(default=128, metadata=_help("synthesised user turns must end within this many tokens"))
    prompt_min_chars: int = field(default=16, metadata=_help("shorter synthesised user turns are dropped"))
    system_prompt: str | None = field(default=None, metadata=_help("system message for synthesised conversations (default: the template's)"))
    max_attempts_factor: float = field(default=20.0, metadata=_help("give up after synthesize x this many user-turn attempts"))

    # built-in engine
    batch_size: int | Literal["auto"] = field(default="auto", metadata=_help(
        "built-in engine: concurrent sequences (slots); auto = as many as the device's memory holds (the KV "
        "cache fitted to the GPU's free memory, or to half the host's available memory on a CPU; at most 1,536 "
        "on a GPU, 64 on a CPU), said with its size at the start"))
    max_prompt_tokens: int = field(default=2048, metadata=_help("longer prompts are skipped (built-in: sizes the KV cache)"))
    device: str = field(default="auto", metadata=_help("auto, cpu, cuda, cuda:N"))
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(default="auto", metadata=_help("auto = bfloat16 on GPU, float32 on CPU"))
    attn_implementation: AttnImplementation = field(default="auto", metadata=_help(
        "attention the target is loaded with: auto = sdpa where the model supports it, else eager; a choice the "
        "model does not support is refused before it loads"))
    cuda_graphs: bool = field(default=True, metadata=_help("capture the decode step in CUDA graphs (GPU only)"))
    compile: bool = field(default=True, metadata=_help("torch.compile the per-layer decode functions (GPU only)"))
    attention: Literal["auto", "dense", "flex"] = field(default="auto", metadata=_help(
        "built-in engine's decode attention: dense (SDPA over every slot's cache up to the longest row's bucket), "
        "flex (FlexAttention reading each slot's own 128-key blocks; compiled on GPU) or auto "
        "(flex on a GPU with --compile, else dense)"))

    # HTTP engine
    base_url: str = field(default="http://localhost:8000/v1", metadata=_help("OpenAI-compatible server"))
    model: str | None = field(default=None, metadata=_help("served model name (default: the server's first)"))
    concurrency: int = field(default=64, metadata=_help("HTTP requests in flight"))
    retries: int = field(default=5, metadata=_help("retries of a failed HTTP request (connection, 429, 5xx)"))
    retry_backoff_s: float = field(default=1.0, metadata=_help("first retry delay; doubles each retry (max 30 s)"))
    request_timeout_s: float = field(default=600.0, metadata=_help("HTTP timeout of one request"))

    # output
    flush_rows: int = field(default=32, metadata=_help("fsync the output after this many rows"))
    flush_seconds: float = field(default=5.0, metadata=_help("... or after this many seconds"))
    append_other_settings: bool = field(default=False, metadata=_help(
        "append to an output whose rows were written with other settings (model, sampling, seed, "
        "max_new_tokens); else such an output is refused, naming what differs"))
    summary: Literal["text", "json"] = field(default="text", metadata=_help(
        "how the run's summary is printed at the end: text (a few lines) or json (every counter, the "
        "engine's included: what scripts read)"))
    progress: bool = field(default=True, metadata=_help("show a progress bar"))
    log_every_seconds: float = field(default=60.0, metadata=_help(
        "without the progress bar: a progress line (rows, new tok/s) this often; 0 = none"))
    max_minutes: float = field(default=0.0, metadata=_help(
        "time box: after this many minutes take no new prompt, finish the conversations started and end "
        "with the summary (a rerun resumes); 0 = no limit"))

    def __post_init__(self) -> None:
        if not self.output:
            raise ValueError("output is required (--output FILE.jsonl)")
        if not self.output.endswith(".jsonl"):
            raise ValueError(f"output must be a .jsonl file, got {self.output!r}")
        if not self.prompts and self.synthesize <= 0:
            raise ValueError("nothing to do: give --prompts FILE... and/or --synthesize N")
        for name in ("synthesize", "prompt_min_chars", "retries", "top_k", "prompt_top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size != "auto" and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or auto, got {self.batch_size}")
        for name in ("max_new_tokens", "prompt_max_tokens", "max_prompt_tokens", "concurrency", "flush_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_attempts_factor < 1:
            raise ValueError(f"max_attempts_factor must be >= 1, got {self.max_attempts_factor}")
        if self.max_minutes < 0 or self.log_every_seconds < 0:
            raise ValueError("max_minutes and log_every_seconds must be >= 0")
        if self.retry_backoff_s < 0 or self.request_timeout_s <= 0 or self.flush_seconds < 0:
            raise ValueError("retry_backoff_s and flush_seconds must be >= 0, request_timeout_s > 0")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        self.answer_sampling  # noqa: B018 - validates temperature/top_p/top_k
        self.prompt_sampling  # noqa: B018

    @property
    def answer_sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)

    @property
    def prompt_sampling(self) -> Sampling:
        return Sampling(self.prompt_temperature, self.prompt_top_p, self.prompt_top_k)
