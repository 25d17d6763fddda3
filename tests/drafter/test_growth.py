"""drafter.init_from into a larger drafter (drafter/checkpoint.growth, load_drafter_as): more layers
after the saved ones and/or the dspark head; the grown drafter computes exactly what the saved
one did until trained, and anything else is refused."""

import pytest
import torch

from dflash_train.drafter.checkpoint import growth, load_drafter_as, save_drafter
from dflash_train.drafter.labels import build_block_labels
from dflash_train.drafter.dspark import previous_tokens
from dflash_train.drafter.masks import build_layer_masks
from dflash_train.drafter.model import DFlashDrafter, block_input_ids, block_positions
from dflash_train.utils.errors import ModelError

from .test_model import TAPS, H, V, _batch, tiny_config

SLIDING, FULL = "sliding_attention", "full_attention"
R, S, B = 2, 18, 4


def test_growth_says_what_each_config_adds():
    saved = tiny_config()  # 2 layers: sliding, full
    assert growth(saved, tiny_config()) == []
    assert growth(saved, tiny_config(num_hidden_layers=4, layer_types=[SLIDING, FULL, FULL, SLIDING])) == [
        "2 layer(s) after its 2 (o_proj and down_proj zero)"]
    assert growth(saved, tiny_config(variant="dspark", markov_rank=5)) == [
        "the dspark bigram head (vanilla, rank 5, markov_w2 zero)"]
    assert growth(saved, tiny_config(variant="dspark", markov_rank=5, markov_head_type="gated")) == [
        "the dspark bigram head (gated, rank 5, markov_w2 zero)"]
    assert len(growth(saved, tiny_config(num_hidden_layers=3, layer_types=[SLIDING, FULL, FULL],
                                         variant="dspark", markov_rank=5))) == 2
    # not a growth: fewer layers, the saved layers' types changed, another shape, dspark -> dflash
    assert growth(saved, tiny_config(num_hidden_layers=1, layer_types=[SLIDING])) is None
    assert growth(saved, tiny_config(num_hidden_layers=3, layer_types=[FULL, FULL, FULL])) is None
    assert growth(saved, tiny_config(num_hidden_layers=3, layer_types=[SLIDING, FULL, FULL], intermediate_size=32)) is None
    assert growth(tiny_config(variant="dspark", markov_rank=5), saved) is None
    assert growth(tiny_config(variant="dspark", markov_rank=5),
                  tiny_config(variant="dspark", markov_rank=5, markov_head_type="gated")) is None


def _block_hidden(model, seed=0):
    """The final hidden states of one batch's blocks, [R, N*B, H] (autograd on)."""
    ids, pos, doc, loss, anchors, valid = _batch(seed)
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, H, generator=g)
    taps = torch.randn(R, S, TAPS * H, generator=g)
    masks = build_layer_masks(model.config, doc, pos, anchors, valid, backend="dense")
    return model(taps, pos, emb[block_input_ids(ids, anchors, B, model.config.mask_token_id)],
                 block_positions(pos, anchors, B), masks)


def _logits(model, seed=0):
    """The block logits of one batch (the dspark bias with teacher-forced previous tokens)."""
    hidden = _block_hidden(model, seed)
    logits = hidden @ torch.randn(V, H, generator=torch.Generator().manual_seed(99)).T
    if model.markov_head is not None:
        ids, pos, doc, loss, anchors, valid = _batch(seed)
        labels, lv = build_block_labels(ids, doc, loss, anchors, valid, B)
        prev = previous_tokens(ids, anchors, labels, lv).view(R, -1)
        head = model.markov_head
        logits = logits + head.widen(hidden, prev)[..., H:] @ head.markov_w2.weight.T
    return logits


@pytest.mark.parametrize("head", [None, "vanilla", "gated"])
def test_a_grown_drafter_computes_exactly_what_the_saved_one_did(tmp_path, head):
    torch.manual_seed(0)
    small = DFlashDrafter(tiny_config())
    small.reset_parameters(std=0.3)  # weights large enough that a non-zero new branch would show
    out = save_drafter(small, tmp_path / "small", dtype=torch.float32)
    config = tiny_config(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL],
                         **(dict(variant="dspark", markov_rank=5, markov_head_type=head) if head else {}))
    grown = load_drafter_as(out, config)
    assert grown.config == config
    state = grown.state_dict()
    for name, tensor in small.state_dict().items():
        assert torch.equal(state[name], tensor), name
    for layer in grown.layers[2:]:  # the new layers: their residual branches end in zeros
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert layer.self_attn.q_proj.weight.any() and layer.mlp.up_proj.weight.any()
    with torch.no_grad():
        assert torch.equal(_logits(grown), _logits(small))


def test_a_grown_gated_head_learns(tmp_path):
    """markov_w2 starts at zero, so at first only it gets gradients; once it moves, the code
    table and the gate do too."""
    torch.manual_seed(2)
    out = save_drafter(DFlashDrafter(tiny_config()), tmp_path / "small", dtype=torch.float32)
    grown = load_drafter_as(out, tiny_config(variant="dspark", markov_rank=5, markov_head_type="gated"))
    head = grown.markov_head
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        _logits(grown).logsumexp(-1).sum().backward()
        assert head.markov_w2.weight.grad.any()
        moved = step > 0  # behind a zero markov_w2 nothing else of the head has a gradient
        assert bool(head.markov_w1.weight.grad.any()) == moved and bool(head.gate_proj.weight.grad.any()) == moved
        opt.step()


def test_a_grown_drafter_learns_in_its_new_layers(tmp_path):
    """The zeroed weights get gradients at once, and after they move, every new weight does."""
    torch.manual_seed(1)
    out = save_drafter(DFlashDrafter(tiny_config()), tmp_path / "small", dtype=torch.float32)
    grown = load_drafter_as(out, tiny_config(num_hidden_layers=3, layer_types=[SLIDING, FULL, FULL]))
    opt = torch.optim.SGD(grown.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        _block_hidden(grown).pow(2).mean().backward()
        new = grown.layers[2]
        if step == 0:
            assert new.self_attn.o_proj.weight.grad.any() and new.mlp.down_proj.weight.grad.any()
            assert not new.self_attn.q_proj.weight.grad.any()  # behind a zero o_proj
        else:
            assert new.self_attn.q_proj.weight.grad.any() and new.mlp.up_proj.weight.grad.any()
        opt.step()


def test_a_drafter_that_does_not_grow_into_the_config_is_refused(tmp_path):
    out = save_drafter(DFlashDrafter(tiny_config()), tmp_path / "small", dtype=torch.float32)
    with pytest.raises(ModelError, match="its drafter config differs from this one"):
        load_drafter_as(out, tiny_config(num_hidden_layers=1, layer_types=[SLIDING]))
    with pytest.raises(ModelError, match="its drafter config differs from this one"):
        load_drafter_as(out, tiny_config(num_hidden_layers=3, layer_types=[FULL, FULL, FULL]))
