"""The frozen target sharded over a group of ranks (`pipeline.target_group_size` G > 1).

FSDP2 (`torch.distributed.fsdp.fully_shard`) on the Hugging Face model: every decoder layer
is one FSDP unit, and so are the input embedding and an untied LM head; the root holds the
rest (final norm, rotary buffers, a tied embedding). Each rank keeps 1/G of every parameter
(dim-0 shards); a layer's forward all-gathers that layer's weights, runs, and frees them again
(`reshard_after_forward`), so a rank holds its shards plus at most one whole layer at a time.
Every rank of the group runs its own batches; only weights cross the group, never activations.
Why FSDP2 and not tensor parallelism: it needs no per-family plan of which projection splits
along which dimension, so the model's own forward runs unchanged for every family the
Hugging Face path takes (dense, MoE, sliding windows, recurrent layers); the packed forward,
which reads the weights itself, gathers each layer's explicitly (target/gathered.py).

Loading never holds the whole model in one place: the model is built with its parameters on
the meta device (buffers such as RoPE tables are real: they are computed; a buffer the checkpoint
holds, as GLM-4.5's router bias, is then read from it), sharded, given empty local shards, and
each rank reads from the safetensors files only the rows of its shards
(`safe_open(...).get_slice`). Per-expert MoE checkpoints (`experts.{e}.gate_proj`, ...; Mixtral's
`block_sparse_moe.experts.{e}.w1`) fill the stacked expert tensors transformers builds
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), by transformers' own
conversion mapping read backwards (target/checkpoint_names.py): a rank's dim-0 shard is a range
of experts, and it reads only those experts' tensors. A block-FP8 checkpoint (DeepSeek-V3's float8
weights with a scale per 128 x 128 block) is dequantized row by row as it is read. A `preset:`
target (a benchmark's random weights) draws each parameter whole, one at a time, and keeps its rows (`fill_random_shards`).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import AutoModelForCausalLM

from dflash_train.target.attn_impl import resolve_attn_implementation
from dflash_train.target.checkpoint_names import CheckpointNames
from dflash_train.target.fp8 import FP8Linear, convert_decoder_linears
from dflash_train.target.quantized import fp8_block, plain_rows, quantization_of
from dflash_train.target.language_model import find_decoder_layers
from dflash_train.target.loading import load_config, resolve_model_source
from dflash_train.target.presets import initialise_, is_preset, preset_config
from dflash_train.utils.errors import ModelError


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter created inside goes to the meta device (no memory, no init work);
    buffers are created as usual, so computed ones (RoPE frequencies) keep their values."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def group_mesh(group, device: torch.device) -> DeviceMesh:
    """The one-dimensional device mesh of a target group's process group."""
    return DeviceMesh.from_group(group, device.type)


def shard_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 units: each decoder layer, the input embedding and an untied LM head, then the root."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    for layer in find_decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # a tied embedding stays in the root (FSDP2 keeps a shared parameter in one unit): the root
    # gathers it at the start of each forward; untied, the embedding is gathered only while it
    # runs and the LM head (never run: the target's forward stops at the final norm) never
    if not tied:
        fully_shard(embed, mesh=mesh, reshard_after_forward=True)
        if head is not None:
            fully_shard(head, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def checkpoint_keys(directory: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of a model directory."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {k: directory / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


class ShardReader:
    """Reads row ranges of checkpoint tensors, each file opened once; a block-FP8 checkpoint's
    float8 weights (`block`: its weight_block_size) come out dequantized (`dequantized_rows`)."""

    def __init__(self, directory: Path, block: tuple[int, int] | None = None):
        self.where = checkpoint_keys(directory)
        self.block = block
        self._open: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def _slice(self, key: str):
        f = self.where[key]
        if f not in self._open:
            self._open[f] = self._stack.enter_context(safe_open(str(f), "pt"))
        return self._open[f].get_slice(key)

    def rows(self, key: str, start: int, stop: int | None) -> torch.Tensor:
        return plain_rows(self._slice(key)[start:stop], start, self.block, key, self.where, self._slice)

    def close(self) -> None:
        self._stack.close()


def shard_rows(n: int, rank: int, size: int) -> tuple[int, int]:
    """The dim-0 rows [start, stop) FSDP2 gives `rank` of `size` (torch.chunk's split: equal
    chunks of ceil(n / size) rows, the last ones shorter or empty)."""
    chunk = math.ceil(n / size)
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


def _read_shard(reader: ShardReader, names: CheckpointNames, name: str,
                rows: tuple[int, int]) -> torch.Tensor:
    """The rows of model parameter `name`: of the checkpoint tensor of that name (or of the name the
    model type's conversion mapping gives it), or for experts the checkpoint stores one tensor each,
    those experts' tensors stacked (target/checkpoint_names.py)."""
    for key in names.names(name):
        if key in reader.where:
            return reader.rows(key, *rows)
    stacked = names.stacked_rows(name, range(*rows), lambda key: reader.rows(key, 0, None) if key in reader.where
                                 else None)
    if stacked is not None:
        return stacked
    raise ModelError(f"sharded target: the checkpoint has no tensor for the model's {name} (its tensors are named "
                     f"differently from the model's): load this target whole, pipeline.target_group_size 1")


@torch.no_grad()
def _checkpoint_name(name: str) -> str | None:
    """The checkpoint tensor behind a model parameter: an FP8Linear's float8 weight is quantised
    from the linear's weight (with its scales, so `row_scale` has none of its own)."""
    if name.endswith(".row_scale"):
        return None
    return name.removesuffix("_fp8") if name.endswith(".weight_fp8") else name


def _fill_local(model: nn.Module, name: str, local: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> None:
    """This rank's rows of parameter `name`, given the same rows of its checkpoint tensor: copied,
    or quantised in the model's dtype (an FP8Linear: per output channel, as the whole model's)."""
    if tuple(rows.shape) != tuple(local.shape):
        raise ModelError(f"sharded target: {name}'s rows are {tuple(rows.shape)} in the checkpoint, the model's "
                         f"shard is {tuple(local.shape)}")
    if name.endswith(".weight_fp8"):
        scale = model.get_parameter(name.removesuffix("weight_fp8") + "row_scale").to_local()
        FP8Linear.fill_rows(local, scale, rows.to(dtype))
    else:
        local.copy_(rows)


def _local_shards(model: nn.Module, rank: int, size: int
                  ) -> Iterator[tuple[str, str, torch.Size, torch.Tensor, tuple[int, int]]]:
    """(parameter name, its checkpoint tensor's name, its whole shape, the local shard, its rows) of
    every parameter filled from a checkpoint tensor, in `named_parameters()` order."""
    for name, param in model.named_parameters():
        source = _checkpoint_name(name)
        if source is None:
            continue
        local, rows = param.to_local(), shard_rows(param.shape[0], rank, size)
        if local.shape[0] != rows[1] - rows[0]:
            raise RuntimeError(f"{name}: local shard of {tuple(local.shape)} rows, expected rows {rows}")
        yield name, source, param.shape, local, rows


@torch.no_grad()
def load_shards(model: nn.Module, directory: Path, rank: int, size: int, dtype: torch.dtype,
                block: tuple[int, int] | None = None) -> None:
    """Fill every parameter's local shard (a DTensor sharded on dim 0), and every buffer the checkpoint
    holds, from the checkpoint (`block`: a block-FP8 checkpoint's weight_block_size)."""
    reader, names = ShardReader(directory, block), CheckpointNames.of(getattr(model.config, "model_type", None))
    try:
        for name, source, _, local, rows in _local_shards(model, rank, size):
            if local.shape[0]:
                _fill_local(model, name, local, _read_shard(reader, names, source, rows), dtype)
        # buffers the checkpoint holds (GLM-4.5's router score correction): the model built on the meta
        # device computed its buffers, and a saved one is not computed; FSDP2 shards parameters only,
        # so every rank reads each whole
        for name, buffer in model.named_buffers():
            key = next((k for k in names.names(name) if k in reader.where), None)
            if key is not None:
                buffer.copy_(reader.rows(key, 0, None))
    finally:
        reader.close()


@torch.no_grad()
def fill_random_shards(model: nn.Module, rank: int, size: int, dtype: torch.dtype, seed: int = 0) -> None:
    """A preset's weights (`presets.build_random_target`'s: the same generator drawing the same
    parameters in the same order), each rank keeping its rows of each; one parameter at a time is
    drawn whole, on this rank's device, so a sharded preset holds the unsharded one's values."""
    device = next(p.to_local().device for p in model.parameters())
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, source, shape, local, (start, stop) in _local_shards(model, rank, size):
        whole = initialise_(torch.empty(shape, dtype=dtype if source != name else local.dtype, device=device),
                            source, gen)
        _fill_local(model, name, local, whole[start:stop], dtype)


def load_sharded_target(spec: str, *, dtype: torch.dtype, device: torch.device, group,
                        trust_remote_code: bool = False, attn_implementation: str = "auto",
                        attn_option: str = "target.attn_implementation", fp8: bool = False) -> nn.Module:
    """The frozen target sharded over `group` (this rank holds 1/G of each parameter), read shard by
    shard; `fp8`: its decoder linears float8 (target/fp8.py), each rank quantising only its rows."""
    if is_preset(spec):  # a benchmark's random weights of a real shape: nothing to read
        source, config, block = None, preset_config(spec), None
    else:
        source = resolve_model_source(spec)
        if source.gguf_file or not any(source.directory.glob("*.safetensors")):
            raise ModelError(f"sharded target {source.describe()}: each rank reads its shard from safetensors files, "
                             f"and this target has none: save it as a Hugging Face model directory, or use "
                             f"pipeline.target_group_size 1")
        config = load_config(source, trust_remote_code=trust_remote_code)
        block = fp8_block_of(source, config)
    attn = resolve_attn_implementation(config, attn_implementation, trust_remote_code=trust_remote_code,
                                       option=attn_option)
    kwargs = {"attn_implementation": attn} if attn else {}
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    if fp8:  # on the meta device: float8 weights and scales laid out by output channel, sharded as such
        convert_decoder_linears(model, find_decoder_layers(model))
    buffers = {name: b.to(device) for name, b in model.named_buffers()}
    shard_model(model, group_mesh(group, device))
    model.to_empty(device=device)  # allocates the local shards only (and empties the buffers: put back below)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if source is None:
        fill_random_shards(model, rank, size, dtype)
    else:
        load_shards(model, source.directory, rank, size, dtype, block)
    model.eval()
    model.requires_grad_(False)
    return model


def fp8_block_of(source, config) -> tuple[int, int] | None:
    """The weight_block_size of a block-FP8 checkpoint (DeepSeek-V3, MiniMax-M2), whose rows
    the reader dequantizes; None for a plain one; a ModelError for other quantized checkpoints."""
    quantized, block = quantization_of(config), fp8_block(config)
    if quantized is None or block is not None:
        return block
    raise ModelError(f"sharded target {source.describe()}: a {quantized.get('quant_method', 'quantized')}-quantized "
                     f"checkpoint; each rank reads plain or block-FP8 tensors of its shard: save the target "
                     f"dequantized (bf16) first, or use pipeline.target_group_size 1")


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the parameters this rank holds, bytes of the whole model's parameters)."""
    local = whole = 0
    for p in model.parameters():
        mine = p.to_local() if hasattr(p, "to_local") else p
        local += mine.numel() * mine.element_size()
        whole += p.numel() * p.element_size()
    return local, whole
