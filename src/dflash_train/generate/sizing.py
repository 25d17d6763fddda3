"""How many slots the built-in engine runs: `--batch-size auto` fits the KV cache to the device.

The engine's memory is its static KV cache, `[layers, slots, kv_heads, max_len, head_dim]` for
keys and again for values, allocated whole at the start; everything else it holds per slot
(tokens, positions, a row of logits) is a few hundred KB at most. So the slots that fit are the
memory left after the model loads, less a reserve for the prefill's activations, the CUDA
graphs' pools and the compiler, divided by one slot's cache:

* on a GPU: the free device memory, less max(2 GiB, 10%); at most 1,536 slots, the most measured
  (SmolLM2-135M on an H200: 113.9K new tok/s on the recipe's prompts, docs/generate.md);
* on a CPU: half of the memory the host has available (its other programs, the tokenizer and the
  prefill keep the rest); at most 64 slots, since a CPU's step time grows with the slots.

A given `--batch-size` is refused, before the model loads, when its cache alone exceeds the whole
device (a GPU's memory, a CPU host's available memory), and again after the load when it exceeds
what is free: one line with its size and what `auto` would take, never an allocator's traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.generate.attention import FLEX_BLOCK, ring_length
from dflash_train.generate.linear_state import state_bytes_per_slot
from dflash_train.target.language_model import layer_windows
from dflash_train.target.packed_mla import latent_head_dim

GPU_MAX_SLOTS = 1536
CPU_MAX_SLOTS = 64
GPU_RESERVE_BYTES = 2 * 2**30
GPU_RESERVE_FRACTION = 0.10
CPU_SHARE = 0.5


@dataclass(frozen=True)
class KvShape:
    """What one slot's cache costs: layers x kv heads x positions x head dim, keys and values; of
    them, `ring_layers` (sliding-window layers) hold a ring of `ring_positions` instead."""

    layers: int
    kv_heads: int
    head_dim: int
    positions: int
    element_bytes: int
    ring_layers: int = 0
    ring_positions: int = 0
    state_bytes: int = 0  # a hybrid's linear-attention layers: state and ring (generate/linear_state.py)

    @property
    def bytes_per_slot(self) -> int:
        positions = (self.layers - self.ring_layers) * self.positions + self.ring_layers * self.ring_positions
        return 2 * self.kv_heads * positions * self.head_dim * self.element_bytes + self.state_bytes


def cache_positions(max_prompt_tokens: int, max_new_tokens: int, attention: str) -> int:
    """The engine's cache length: prompt + answer, rounded up to whole attention blocks (flex reads
    128-key blocks, dense a multiple of 64)."""
    multiple = FLEX_BLOCK if attention == "flex" else 64
    return -(-(max_prompt_tokens + max_new_tokens) // multiple) * multiple


def kv_shape(text_config, positions: int, dtype: torch.dtype, attention: str = "dense") -> KvShape:
    """The cache shape of a decoder with this (text) config, as generate/decoder.py allocates it
    for the built-in engine (one token a step): sliding-window layers in rings where shorter."""
    heads = int(text_config.num_attention_heads)
    head_dim = getattr(text_config, "head_dim", None) or int(text_config.hidden_size) // heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if getattr(text_config, "kv_lora_rank", None):  # latent attention: one head of latent and rotary key
        head_dim, kv_heads = latent_head_dim(text_config), 1
    rings = [ring_length([w], 1, positions, attention) for w in layer_windows(text_config) if w]
    rings = [n for n in rings if n is not None]
    layers, state = int(text_config.num_hidden_layers), 0
    if "linear_attention" in (getattr(text_config, "layer_types", None) or ()):  # a hybrid: attention in a few
        layers = sum(t == "full_attention" for t in text_config.layer_types[:layers])
        state = state_bytes_per_slot(text_config, 1, dtype)
    return KvShape(layers, int(kv_heads), int(head_dim), positions, torch.empty((), dtype=dtype).element_size(),
                   len(rings), max(rings, default=0), state)


def host_available_bytes() -> int | None:
    """The memory this process can still take on the host: /proc/meminfo's MemAvailable, within a
    cgroup's limit where one applies (a container); None where neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: the limit less what the group uses already
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            left = max(0, int(limit) - used)
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available


def device_capacity_bytes(device: torch.device) -> int | None:
    """The most a KV cache could ever take there: a GPU's whole memory, a host's available memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_available_bytes()


def free_bytes(device: torch.device) -> int | None:
    """Memory free now (after the model loaded): the GPU's free memory, or the host's available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()


@dataclass(frozen=True)
class SlotChoice:
    slots: int
    kv_bytes: int
    budget_bytes: int | None
    why: str


def auto_slots(shape: KvShape, device: torch.device, free: int | None) -> SlotChoice:
    """The slots `--batch-size auto` takes on `device` with `free` bytes left after the model loaded."""
    per_slot = shape.bytes_per_slot
    if device.type == "cuda":
        cap = GPU_MAX_SLOTS
        budget = None if free is None else free - max(GPU_RESERVE_BYTES, int(GPU_RESERVE_FRACTION * free))
        where = "of the GPU's free memory less a reserve for prefill and graphs"
    else:
        cap = CPU_MAX_SLOTS
        budget = None if free is None else int(CPU_SHARE * free)
        where = "half of the host's available memory"
    if budget is None:
        slots, why = min(cap, 64), "the device's free memory is unknown"
    else:
        fit = max(budget, 0) // per_slot
        slots = int(max(1, min(cap, fit)))
        why = f"{_gib(budget)} budget, {where}" + (f"; capped at {cap}" if fit > cap else "")
    return SlotChoice(slots, slots * per_slot, budget, why)


def too_big(slots: int, shape: KvShape, available: int | None, where: str) -> str | None:
    """Why `slots` slots cannot have their cache in `available` bytes (`where`: what that is), or None."""
    need = slots * shape.bytes_per_slot
    if available is None or need <= available:
        return None
    return (f"--batch-size {slots:,} needs a KV cache of {_size(need)} ({slots:,} slots x {shape.positions:,} "
            f"positions x {shape.layers} layers), and {where} is {_size(available)}: use --batch-size auto "
            f"(it fits the cache to the memory), fewer slots, or a lower --max-prompt-tokens / --max-new-tokens")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} bytes"
