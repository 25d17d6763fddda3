import pytest
import torch

from dflash_train.data.batch import pack_documents
from dflash_train.target.runner import TargetRunner, find_decoder_layers


def tiny_target(kind="llama", layers=6, vocab=97):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, attn_implementation="sdpa"))
    return model.eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    docs = [(10 + i, torch.randint(0, 97, (n,), generator=g), torch.ones(n, dtype=torch.bool))
            for i, n in enumerate([7, 5, 9, 3])]
    return pack_documents(docs, [[0, 1], [2, 3]])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("need_final", [False, True])
def test_taps_equal_per_document_hidden_states(kind, need_final):
    model = tiny_target(kind)
    batch = _batch()
    runner = TargetRunner(model, [0, 2, 3], need_final=need_final)
    out = runner(batch.input_ids, batch.position_ids, batch.document_ids)
    runner.close()  # the reference below runs the plain model
    R, S = batch.input_ids.shape
    assert out.taps.shape == (R, S, 3 * 32)
    for r in range(R):
        for d in batch.document_ids[r].unique().tolist():
            if d < 0:
                continue
            cols = (batch.document_ids[r] == d).nonzero().flatten()
            ref = model(input_ids=batch.input_ids[r, cols][None], output_hidden_states=True)
            want = torch.cat([ref.hidden_states[i + 1][0] for i in (0, 2, 3)], dim=-1)
            torch.testing.assert_close(out.taps[r, cols], want, atol=1e-5, rtol=1e-5)
            if need_final:
                torch.testing.assert_close(out.final_hidden[r, cols], ref.hidden_states[-1][0], atol=1e-5, rtol=1e-5)
    assert (out.taps[batch.document_ids < 0] == 0).all()
    assert (out.final_hidden is None) == (not need_final)


def test_forward_stops_after_the_last_tapped_layer():
    model = tiny_target(layers=6)
    calls = []
    for i, layer in enumerate(find_decoder_layers(model)):
        layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    head_calls = []
    model.lm_head.register_forward_hook(lambda m, a, o: head_calls.append(1))
    batch = _batch()
    runner = TargetRunner(model, [1, 2], need_final=False)
    runner(batch.input_ids, batch.position_ids, batch.document_ids)
    runner.close()
    assert calls == [0, 1, 2] and not head_calls
    calls.clear()
    TargetRunner(model, [1, 2], need_final=True)(batch.input_ids, batch.position_ids, batch.document_ids)
    assert max(calls) == 5 and not head_calls  # all layers + final norm, still no LM head


def test_bad_layer_ids():
    with pytest.raises(ValueError, match="do not exist"):
        TargetRunner(tiny_target(layers=4), [1, 4], need_final=False)
