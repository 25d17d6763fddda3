"""Where a model tensor lives in its checkpoint, for the sharded loader (target/sharded.py), which
reads each rank's rows from the safetensors files itself instead of through `from_pretrained`.

transformers 5 loads some checkpoints through a conversion mapping of their model type
(`transformers.conversion_mapping.get_checkpoint_conversion_mapping`), and saves them back in
that original layout: renamed modules (Mixtral's `.block_sparse_moe.` is the model's `.mlp.`;
the multimodal Gemma 3's `language_model` prefix) and experts stored one tensor per expert
(`experts.{e}.gate_proj` / `up_proj`, Mixtral's `w1` / `w3` / `w2`) that the model holds stacked
(`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]). The same
mapping read backwards gives each model tensor's checkpoint names, so a rank reads only its own
experts. Only the two conversions that stack experts (MergeModulelist on dim 0, then Concatenate
on dim 1) are read this way; a checkpoint needing any other is refused by the loader.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StackedExperts:
    """A model tensor (name ending in `target`) stacked from one checkpoint tensor per expert: each of
    `sources` (a name suffix, `*` the expert), concatenated along their rows when there are two."""

    target: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointNames:
    """A model type's renamings (checkpoint text, model text) and stacked expert tensors."""

    renamings: tuple[tuple[str, str], ...] = ()
    stacked: tuple[StackedExperts, ...] = ()

    @classmethod
    def of(cls, model_type: str | None) -> "CheckpointNames":
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

        renamings, stacked = [], []
        for rule in get_checkpoint_conversion_mapping(model_type) or []:
            if isinstance(rule, WeightRenaming):
                renamings += [(_literal(s), t) for s, t in zip(rule.source_patterns, rule.target_patterns)
                              if _literal(s) is not None]
            elif isinstance(rule, WeightConverter) and len(rule.target_patterns) == 1:
                ops = [(type(op), getattr(op, "dim", None)) for op in rule.operations]
                if ops in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
                    stacked.append(StackedExperts(rule.target_patterns[0], tuple(rule.source_patterns)))
        return cls(tuple(renamings), tuple(stacked))

    def names(self, key: str) -> Iterator[str]:
        """The checkpoint names a model tensor may have: its own, then each renaming undone."""
        yield key
        for checkpoint_text, model_text in self.renamings:
            anchored = checkpoint_text.startswith("^")
            old = checkpoint_text.removeprefix("^")
            if (key.startswith(model_text) if anchored else model_text in key):
                yield old + key[len(model_text):] if anchored else key.replace(model_text, old, 1)

    def stacked_rows(self, name: str, experts: range,
                     read: Callable[[str], torch.Tensor | None]) -> torch.Tensor | None:
        """Model tensor `name`'s rows for `experts` [E', ...], read per expert (`read(key)`: the whole
        checkpoint tensor, None when there is none of that name); None when `name` is not stacked."""
        for rule in self.stacked:
            if not name.endswith(rule.target):
                continue
            prefix = name[: len(name) - len(rule.target)]

            def expert(e: int) -> torch.Tensor | None:
                parts = [self._first(prefix + source.replace("*", str(e)), read) for source in rule.sources]
                return None if any(p is None for p in parts) else torch.cat(parts)

            blocks = [expert(e) for e in experts]
            if all(b is not None for b in blocks):
                return torch.stack(blocks) if blocks else None
        return None

    def _first(self, key: str, read: Callable[[str], torch.Tensor | None]) -> torch.Tensor | None:
        return next((t for t in map(read, self.names(key)) if t is not None), None)


def _literal(pattern: str) -> str | None:
    """A renaming's regex as plain text (a leading ^ kept as the anchor; `.` read as a dot); None
    for a pattern with other regex syntax, which cannot be undone as text."""
    body = pattern.removeprefix("^")
    return pattern if re.fullmatch(r"[\w.]*", body) else None
