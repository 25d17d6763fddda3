"""One rank of tests/pipeline/test_sharded_target.py (run by torchrun, gloo): for each target
directory given, the target sharded over every rank against the whole model loaded by
transformers, on batches of documents of this rank's own lengths. Writes OUT/rank-N.json:
each tapped layer's largest difference (the Hugging Face forward; the packed forward, which
gathers each layer's weights itself, against the packed forward of the whole model), the
parameter bytes this rank holds before and after the forwards, and how many bytes of weights it
read from the files. A `preset:NAME` target is
drawn at random on each rank and compared with the same preset built whole; an `fp8:` prefix loads
the target with FP8 decoder linears, compared with the whole model converted alike."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

FP8 = "fp8:"  # a target spec with this prefix loads with target.fp8

from dflash_train.target import sharded
from dflash_train.target.fp8 import convert_decoder_linears
from dflash_train.target.language_model import find_decoder_layers
from dflash_train.target.loading import load_causal_lm
from dflash_train.target.presets import build_random_target, is_preset
from dflash_train.target.runner import TargetRunner


def count_reads() -> list[int]:
    """Bytes of checkpoint tensors this process reads through the sharded loader."""
    seen = [0]
    rows = sharded.ShardReader.rows

    def counting(self, key, start, stop):
        out = rows(self, key, start, stop)
        seen[0] += out.numel() * out.element_size()
        return out

    sharded.ShardReader.rows = counting
    return seen


def saved_buffer_bytes(model, path: str) -> int:
    """Bytes of the model's buffers that the checkpoint holds (read whole on every rank)."""
    keys = set() if is_preset(path) else set(sharded.checkpoint_keys(Path(path)))
    return sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name in keys)


def checkpoint_bytes(path: str) -> int:
    """Bytes of every tensor in a model directory's safetensors files (0 for a preset)."""
    total = 0
    for file in [] if is_preset(path) else sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            for key in fh.keys():
                t = fh.get_tensor(key)  # a tiny test model: reading it whole is cheap
                total += t.numel() * t.element_size()
    return total


def packed_rows(lengths_per_row: list[list[int]], width: int, vocab: int, gen: torch.Generator):
    """Packed [R, S] rows of documents of the given lengths, right padded: (ids, positions, documents)."""
    R = len(lengths_per_row)
    ids = torch.randint(0, vocab, (R, width), generator=gen)
    positions = torch.zeros(R, width, dtype=torch.long)
    documents = torch.full((R, width), -1, dtype=torch.long)
    for r, lengths in enumerate(lengths_per_row):
        start = 0
        for d, length in enumerate(lengths):
            positions[r, start:start + length] = torch.arange(length)
            documents[r, start:start + length] = d
            start += length
    return ids, positions, documents


def packed_against_whole(model, whole, n: int, rank: int) -> dict | None:
    """The packed forward (target/packed.py) on the sharded target against the same forward on the
    whole model: rows of several documents on one rank, one document a row on another (another
    attention path, the same gathers), need_final on and off, after a forward that raised inside a
    layer; and the bytes held right after that error. None for a family the packed forward does not
    take."""
    from dflash_train.target.packed import UnsupportedTarget

    try:
        ours = TargetRunner(model, list(range(n)), need_final=True, forward="packed")
    except UnsupportedTarget:
        return None
    ref = TargetRunner(whole, list(range(n)), need_final=True, forward="packed")
    gen = torch.Generator().manual_seed(100 + rank)
    rows = [[20], [14]] if rank % 2 else [[7, 9, 4], [12, 5]]
    ids, positions, documents = packed_rows(rows, 20, whole.config.vocab_size, gen)
    raise_in_layer(ours.packed, 1)  # every rank alike: the error ends the forward inside layer 1
    try:
        ours(ids, positions, documents)
    except LayerError:
        pass
    after_error = sharded.parameter_bytes(model)  # nothing left gathered
    del ours.packed.attention
    diffs = []
    for need_final in (True, False):
        a = ours(ids, positions, documents, need_final=need_final)
        b = ref(ids, positions, documents, need_final=need_final)
        diffs.append([float((a.taps - b.taps).abs().max())]
                     + ([float((a.final_hidden - b.final_hidden).abs().max())] if need_final else []))
    return {"diffs": diffs, "bytes_after_error": after_error}


class LayerError(RuntimeError):
    pass


def raise_in_layer(packed, layer: int) -> None:
    """The packed forward's attention raises in `layer` (an instance attribute over the method)."""
    calls = [0]
    attention = packed.attention

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == layer + 1:
            raise LayerError(f"in layer {layer}")
        return attention(*args, **kwargs)

    packed.attention = failing


def main(out: Path, targets: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="gloo")
    read = count_reads()
    report = {}
    for spec in targets:
        read[0] = 0
        fp8, path = spec.startswith(FP8), spec.removeprefix(FP8)
        model = sharded.load_sharded_target(path, dtype=torch.float32, device=torch.device("cpu"), group=group,
                                            fp8=fp8)
        loaded = sharded.parameter_bytes(model)
        whole = build_random_target(path, dtype=torch.float32, device="cpu") if is_preset(path) \
            else load_causal_lm(path, dtype=torch.float32)
        if fp8:
            convert_decoder_linears(whole, find_decoder_layers(whole))
        n = len(whole.model.layers)
        ours = TargetRunner(model, list(range(n)), need_final=True)
        ref = TargetRunner(whole, list(range(n)), need_final=True)
        gen = torch.Generator().manual_seed(rank)
        diffs = []
        for i, need_final in enumerate((True, False, True)):  # the forward also stops early, on every rank alike
            L = 9 + 3 * rank + i
            ids = torch.randint(0, whole.config.vocab_size, (3, L), generator=gen)
            lengths = torch.tensor([L, L - 3, 2])
            a, fa = ours.run_documents(ids, lengths, need_final=need_final)
            b, fb = ref.run_documents(ids, lengths, need_final=need_final)
            diffs.append([float((x - y).abs().max()) for x, y in zip(a + [fa] * need_final, b + [fb] * need_final)])
        report[spec] = {"diffs": diffs, "packed": packed_against_whole(model, whole, n, rank), "bytes_loaded": loaded,
                        "bytes_after": sharded.parameter_bytes(model),
                        "read_bytes": read[0], "checkpoint_bytes": checkpoint_bytes(path),
                        "buffer_bytes": saved_buffer_bytes(model, path),
                        "sharded": sharded.is_sharded(model)}
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
