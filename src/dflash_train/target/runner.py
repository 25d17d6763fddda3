"""Running the frozen target: tapped hidden states (and final states) for a packed batch.

* Only the tapped layers are captured, by forward hooks; the full `hidden_states` tuple
  of every layer is never built.
* With `data` labels the forward stops right after the last tapped layer (a hook raises
  `_StopForward`), so the layers above it, the final norm and the LM head never run.
* With `target`/`distill` labels it stops after the final norm: the caller computes
  logits only at the positions blocks need (drafter/labels.py). Logits over all S
  positions and the whole vocabulary are never computed.
* Packed rows hold several documents, but a Hugging Face model attends across its whole
  input. Documents are therefore unpacked into a right-padded [D, L] batch (documents of
  a batch come from one length bucket, so little is padding), run with ordinary causal
  attention, and the results are gathered back into the packed [R, S] layout
  (target/documents.py).
* `target.forward: packed` runs target/packed.py instead: the packed rows themselves, one
  fixed shape (compilable), the same taps; `target.sdpa_backend` forces the attention
  kernel of either forward.
* The tapped layers and the final norm are the language model's (target/language_model.py):
  a multimodal wrapper (Gemma 3) runs whole, and its vision tower is never tapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import BlockMask

from dflash_train.target.config import TargetConfig
from dflash_train.target.documents import DocumentLayout, unpack_documents
from dflash_train.target.language_model import find_decoder_layers, find_final_norm
from dflash_train.target.packed import PackedForward, rows_hold_one_document
from dflash_train.target.sdpa import sdpa_backend
from dflash_train.utils.flex_masks import causal_document_block_mask


class _StopForward(Exception):
    """Raised from a hook to end the target forward early (nothing after it is needed)."""


@dataclass
class TargetOutput:
    taps: torch.Tensor  # [R, S, n*H] outputs of the tapped decoder layers, concatenated
    final_hidden: torch.Tensor | None  # [R, S, H] after the final norm (target/distill labels)


class TargetRunner:
    """A frozen Hugging Face causal LM producing what the drafter needs, nothing more."""

    def __init__(self, model: nn.Module, target_layer_ids: list[int], *, need_final: bool = False,
                 forward: str = "hf", sdpa: str = "auto", compile: bool = False, document_attention: str = "gather",
                 grouped_kv: bool = False):
        self.model = model.eval().requires_grad_(False)
        self.layers = find_decoder_layers(model)
        self.layer_ids = list(target_layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"target layers {bad} do not exist: the target has {len(self.layers)} decoder layers")
        self.need_final = need_final  # default of each call; a call may ask otherwise
        try:
            self.final_norm = find_final_norm(model)
        except ValueError:
            if need_final:
                raise
            self.final_norm = None
        self._final_now = need_final
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        self.sdpa = sdpa
        if forward not in ("hf", "packed"):
            raise ValueError(f"unknown target forward {forward!r}: use hf or packed")
        if compile and forward != "packed":
            raise ValueError("a compiled target forward needs forward='packed'")
        if document_attention not in ("gather", "flex") or (document_attention == "flex" and forward != "packed"):
            raise ValueError(f"document attention {document_attention!r}: use gather, or flex with forward='packed'")
        self.document_attention = document_attention
        self.packed = PackedForward(model, self.layer_ids, sdpa=sdpa, compile=compile, grouped_kv=grouped_kv) \
            if forward == "packed" else None
        if self.packed is not None and self.packed.linear_layers and document_attention == "flex":
            raise ValueError("target.document_attention: flex keeps documents apart inside attention, but this "
                             "target's linear-attention layers read whole documents: use document_attention gather")
        if self.packed is not None:
            return  # no hooks: the packed forward stops after the last layer it needs by itself
        last = max(self.layer_ids)
        for i in self.layer_ids:
            self._handles.append(self.layers[i].register_forward_hook(self._tap_hook(i, last=(i == last))))
        if self.final_norm is not None:
            self._handles.append(self.final_norm.register_forward_hook(self._final_hook))

    @classmethod
    def from_config(cls, model: nn.Module, target_layer_ids: list[int], cfg: TargetConfig, *,
                    need_final: bool) -> TargetRunner:
        """The runner the `target:` section asks for."""
        return cls(model, target_layer_ids, need_final=need_final, forward=cfg.forward, sdpa=cfg.sdpa_backend,
                   compile=cfg.compile, document_attention=cfg.document_attention,
                   grouped_kv=cfg.grouped_kv is True)  # (auto is decided before: target/config.py decide_forward)

    @property
    def hidden_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[1]

    def _tap_hook(self, index: int, last: bool):
        def hook(module, args, output):
            self._captured[index] = output[0] if isinstance(output, (tuple, list)) else output
            if last and not self._final_now:
                raise _StopForward

        return hook

    def _final_hook(self, module, args, output):
        self._captured[-1] = output
        raise _StopForward

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @torch.no_grad()
    def run_documents(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, *, need_final: bool | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Right-padded [D, L] documents -> (tapped states per layer [D, L, H], final [D, L, H])."""
        self._final_now = self.need_final if need_final is None else need_final
        if self._final_now and self.final_norm is None:
            raise ValueError("this target's final norm was not found: target labels are unavailable")
        self._captured.clear()
        D, L = input_ids.shape
        full = bool((lengths == L).all())
        # No attention mask when nothing is padded lets SDPA take its fused causal kernel;
        # with right padding, real tokens never attend to pads under causal attention anyway.
        mask = None if full else (torch.arange(L, device=input_ids.device) < lengths[:, None]).long()
        try:
            with sdpa_backend(self.sdpa):
                self.model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        except _StopForward:
            if isinstance(self.model, FSDPModule):  # a sharded target (target/sharded.py): the stop skipped the
                self.model.reshard()  # root's post-forward, which would have freed its gathered weights
        missing = [i for i in self.layer_ids if i not in self._captured]
        if missing:
            raise RuntimeError(f"target forward did not reach layers {missing}")
        taps = [self._captured[i] for i in self.layer_ids]
        final = self._captured.get(-1) if self._final_now else None
        self._captured.clear()
        return taps, final

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor,
        *, need_final: bool | None = None, layout: DocumentLayout | BlockMask | None = None,
        one_document_rows: bool | None = None,
    ) -> TargetOutput:
        """Packed batch [R, S] -> TargetOutput in the packed layout (padding positions are 0).

        `layout` is `document_layout` and `one_document_rows` is `rows_hold_one_document`,
        both computed ahead (on the CPU copy of the batch, moved with non_blocking copies),
        which keeps their data-dependent shapes off the GPU's critical path: computed here
        from device tensors they cost host syncs.
        """
        if self.packed is not None:
            final_now = self.need_final if need_final is None else need_final
            if one_document_rows is None:
                one_document_rows = rows_hold_one_document(document_ids, position_ids)
            if not one_document_rows and layout is None:
                layout = self.document_layout(document_ids, position_ids)
            taps, final = self.packed(input_ids, position_ids, document_ids, need_final=final_now,
                                      layout=None if one_document_rows else layout)
            return TargetOutput(taps, final)
        layout = layout or unpack_documents(document_ids, position_ids)
        taps, final = self.run_documents(layout.docs(input_ids), layout.lengths, need_final=need_final)
        pad = (document_ids < 0)[..., None]
        packed = layout.packed(torch.cat(taps, dim=-1)).masked_fill_(pad, 0)
        final_packed = layout.packed(final).masked_fill_(pad, 0) if final is not None else None
        return TargetOutput(packed, final_packed)

    def document_layout(self, document_ids: torch.Tensor, position_ids: torch.Tensor,
                        device: torch.device | None = None) -> DocumentLayout | BlockMask:
        """What keeps a packed batch's documents apart, moved to `device`: the gather maps of
        `unpack_documents` (for the packed forward with its [D, L] rounded up, as its attention
        needs no padding mask), or with document_attention flex the causal-within-document
        BlockMask of the packed rows."""
        if self.document_attention == "flex":
            return causal_document_block_mask(document_ids, device=device)
        return unpack_documents(document_ids, position_ids, round_shape=self.packed is not None).to(device)

    def run_batch(self, batch, device: torch.device, *, need_final: bool | None = None) -> TargetOutput:
        """A packed batch still on the CPU (`data.batch.PackedBatch`) -> TargetOutput on `device`.

        The index maps are computed on the CPU copy and moved with non-blocking copies, so
        their data-dependent shapes never cost a host sync on the GPU."""
        one = rows_hold_one_document(batch.document_ids, batch.position_ids) if self.packed is not None else False
        layout = None
        if not one:  # the packed forward with one document per row needs no index maps
            layout = self.document_layout(batch.document_ids, batch.position_ids, device)
        b = batch.to(device, non_blocking=True)
        return self(b.input_ids, b.position_ids, b.document_ids, need_final=need_final, layout=layout,
                    one_document_rows=one)
