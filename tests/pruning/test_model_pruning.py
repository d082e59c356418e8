"""Head gates, score collection and physical pruning in whole models: the decoder zoo's
mha layers and tiny random transformers Llama / Qwen3 models patched by
patch_hf_attention (skipped without transformers, an optional test extra)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import headwise
from headwise import (AllHeadsClosedError, HeadMask, add_head_gates, attention_layers, clear_head_gates,
                      collect_head_scores, gate_masks, prune_model_heads, set_head_gates, set_head_masks)
from headwise.models import Decoder, DecoderConfig
from headwise.models.decoder import rotary
from headwise.nn import HeadGate
from headwise.testing import rel_err

TOL = 2e-5


def tiny_decoder(n_heads=4, n_kv_heads=2, n_layers=2, seed=0, ops=None, attention="mha"):
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=61, d_model=48, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                        residual="residual", attention=attention)
    return Decoder(cfg, ops=ops)


def tokens_of(b=2, t=9, vocab=61, seed=1):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def hf_model(kind, seed=0):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
                  attention_bias=kind == "qwen3")
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=12, **common))
    headwise.integrations.patch_hf_attention(model)
    return model.eval()


def logits_of(model, tokens):
    if isinstance(model, Decoder):
        return model(tokens)
    return model(input_ids=tokens, use_cache=False).logits


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


MODELS = ["decoder_mha", "decoder_gqa", "llama", "qwen3"]
GATED_MODELS = MODELS + ["decoder_dcmha"]  # DCMHA layers take gates and masks, not pruning


def build(name, seed=0):
    if name == "decoder_dcmha":
        return tiny_decoder(n_heads=4, n_kv_heads=4, seed=seed, attention="dcmha")
    if name == "decoder_mha":
        return tiny_decoder(n_heads=4, n_kv_heads=4, seed=seed)
    if name == "decoder_gqa":
        return tiny_decoder(n_heads=6, n_kv_heads=3, seed=seed)
    return hf_model(name, seed)


# -- gates in models ---------------------------------------------------------------------


@pytest.mark.parametrize("name", GATED_MODELS)
def test_large_pi_gated_model_equals_the_ungated_one(name):
    model = build(name)
    tokens = tokens_of()
    want = logits_of(model, tokens).detach()
    gates = add_head_gates(model, init=30.0, generator=torch.Generator().manual_seed(0))
    model.train()
    got = logits_of(model, tokens)
    assert all(torch.equal(g(), torch.ones(g.num_heads)) for g in gates)  # sampled, all open
    assert rel_err(got, want) <= TOL


@pytest.mark.parametrize("name", GATED_MODELS)
def test_the_model_trains_its_gates(name):
    model = build(name)
    gates = add_head_gates(model, init=0.0, generator=torch.Generator().manual_seed(0))
    assert {id(g.pi) for g in gates} <= {id(p) for p in model.parameters()}
    model.train()
    logits = logits_of(model, tokens_of())
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens_of()[:, 1:].reshape(-1))
    (loss + 0.01 * sum(g.expected_l0() for g in gates)).backward()
    for g in gates:
        assert g.pi.grad is not None and torch.isfinite(g.pi.grad).all() and (g.pi.grad != 0).all()


def test_per_row_gates_sample_each_batch_row():
    model = tiny_decoder()
    gates = add_head_gates(model, init=0.0, per_row=True, generator=torch.Generator().manual_seed(0))
    seen = []
    for layer in attention_layers(model):
        layer.register_forward_pre_hook(lambda mod, args: seen.append(mod.head_gate(args[0].shape[0])))
    tokens = tokens_of(b=16)
    model.train()
    logits_of(model, tokens).square().mean().backward()
    assert seen[0].shape == (16, 4) and not torch.equal(seen[0], seen[0][:1].expand_as(seen[0]))
    assert all(torch.isfinite(g.pi.grad).all() for g in gates)


@pytest.mark.parametrize("attention", ["mha", "dcmha"])
def test_decoder_reference_forward_applies_the_gate_too(attention):
    model = tiny_decoder(n_kv_heads=4 if attention == "dcmha" else 2, attention=attention)
    set_head_masks(model, torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 1]]), rescale=True)
    tokens = tokens_of()
    assert rel_err(model(tokens), model.reference_forward(tokens)) <= TOL
    clear_head_gates(model)
    assert rel_err(model(tokens), model.reference_forward(tokens)) <= TOL


def test_decoder_state_dict_is_unchanged_by_the_head_merge_rewiring():
    keys = set(tiny_decoder().state_dict())
    assert {"sublayers.0.o_proj.weight", "sublayers.0.q_proj.weight"} <= keys
    assert not any("head_gate" in k for k in keys)


def test_a_deep_copy_computes_the_same_function(backend):
    model = tiny_decoder(ops=backend)
    tokens = tokens_of().to(backend.device)
    model.to(backend.device)
    assert torch.equal(copy.deepcopy(model)(tokens), model(tokens))


def test_gates_of_the_wrong_size_are_refused_and_nothing_changes():
    model = tiny_decoder()
    keep = add_head_gates(model)
    with pytest.raises(ValueError, match=r"gates\[1\] has num_heads=3"):
        set_head_gates(model, [HeadGate(4), HeadGate(3)])
    with pytest.raises(ValueError, match="one entry per attention layer"):
        set_head_gates(model, [HeadGate(4)])
    with pytest.raises(ValueError, match=r"masks\[0\] must be \[H\] = \[4\]"):
        set_head_masks(model, torch.ones(2, 5))
    with pytest.raises(ValueError, match="only 0 and 1"):
        set_head_masks(model, torch.full((2, 4), 0.5))
    assert [layer.head_gate for layer in attention_layers(model)] == keep


# -- scores ------------------------------------------------------------------------------


def explicit_head_norms(layer, x, cos, sin):
    """z_norm, out_norm [B, T, H] of one decoder attention layer, by explicit products."""
    b, t, _ = x.shape
    h, kv, d = layer.n_heads, layer.n_kv, layer.head_dim
    q = layer.q_norm(layer.q_proj(x).view(b, t, h, d)).transpose(1, 2)
    k = layer.k_norm(layer.k_proj(x).view(b, t, kv, d)).transpose(1, 2)
    v = layer.v_proj(x).view(b, t, kv, d).transpose(1, 2)
    q, k = rotary(q, cos, sin), rotary(k, cos, sin)
    k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    logits = logits.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    z = torch.softmax(logits, dim=-1) @ v  # [B, H, T, d]
    w = layer.o_proj.weight.view(-1, h, d)  # [D, H, d]
    contribution = torch.einsum("bhtk,nhk->bthn", z, w)
    return z.norm(dim=-1).transpose(1, 2), contribution.norm(dim=-1)


def test_collected_scores_equal_explicit_per_head_norms_with_padding():
    model = tiny_decoder(n_heads=4, n_kv_heads=2, n_layers=3)
    batches = [tokens_of(seed=1), tokens_of(b=3, t=7, seed=2)]
    masks = [torch.ones(2, 9, dtype=torch.bool), torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5]).bool()]
    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: inputs.setdefault(i, []).append(args[:3]))
             for i, layer in enumerate(attention_layers(model))]
    scores = collect_head_scores(model, list(zip(batches, masks)))
    for hook in hooks:
        hook.remove()
    assert scores.tokens == int(sum(m.sum() for m in masks))
    with torch.no_grad():
        for i, layer in enumerate(attention_layers(model)):
            z_sum, out_sum = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
            for (x, cos, sin), m in zip(inputs[i], masks):
                z_norm, out_norm = explicit_head_norms(layer, x, cos, sin)
                z_sum += (z_norm * m[..., None]).sum((0, 1)).double()
                out_sum += (out_norm * m[..., None]).sum((0, 1)).double()
            assert rel_err(scores.ahon[i], z_sum / scores.tokens) <= 1e-5
            assert rel_err(scores.circuit[i], out_sum / scores.tokens) <= 1e-5
            ln = scores.get("ahon")[i]
            assert rel_err(ln, (z_sum / z_sum.mean()).float()) <= 1e-5
    assert model.training  # the collector restores the mode and the sinks
    assert all(layer.head_stats_sink is None for layer in attention_layers(model))


def test_collector_reads_hf_attention_masks():
    model = hf_model("qwen3")
    ids = tokens_of(b=2, t=8, vocab=97)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    scores = collect_head_scores(model, [{"input_ids": ids, "attention_mask": mask}])
    assert scores.tokens == 13 and scores.ahon.shape == (2, 4) and (scores.circuit > 0).all()
    # the first row alone (no padding) scores like a batch of that row
    alone = collect_head_scores(model, [ids[:1]])
    both = collect_head_scores(model, [{"input_ids": ids[:1], "attention_mask": mask[:1]}])
    assert rel_err(alone.ahon, both.ahon) <= 1e-5


def test_collector_bad_batches_are_named():
    model = tiny_decoder()
    with pytest.raises(TypeError, match="each batch must be"):
        collect_head_scores(model, ["text"])
    with pytest.raises(ValueError, match="no token was counted"):
        collect_head_scores(model, [])
    with pytest.raises(ValueError, match="no gateable attention layers"):
        collect_head_scores(torch.nn.Linear(2, 2), [tokens_of()])


# -- pruning -----------------------------------------------------------------------------


ASKED = {  # per model: an [L, H] mask asked for (0 = remove)
    "decoder_mha": [[1, 0, 1, 0], [0, 1, 1, 1]],
    # KV groups of 2. Layer 0: group 1 whole, groups 0 and 2 close one head each (kept as asked).
    # Layer 1: group 1 whole, groups 0 and 2 close 1 and 0 heads -> min = 0 each (head 0 reopens).
    "decoder_gqa": [[0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 1, 1]],
    "llama": [[0, 1, 1, 1], [1, 0, 0, 1]],
    "qwen3": [[0, 0, 1, 1], [1, 1, 0, 1]],
}
PRUNED = {
    "decoder_mha": [[1, 0, 1, 0], [0, 1, 1, 1]],
    "decoder_gqa": [[0, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1]],
    "llama": [[1, 1, 1, 1], [1, 0, 0, 1]],  # groups {0,1},{2,3}: min(1, 0) = 0 and min(1, 1) = 1
    "qwen3": [[0, 0, 1, 1], [1, 1, 1, 1]],  # layer 1: groups close 0 and 1 heads -> min = 0
}


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_pruned_model_equals_the_masked_model(name, rescale):
    model = build(name)
    tokens = tokens_of(vocab=61)
    asked = torch.tensor(ASKED[name], dtype=torch.float32)
    pruned_model = copy.deepcopy(model)
    report = prune_model_heads(pruned_model, asked, rescale=rescale)
    assert [m.tolist() for m in report.asked] == ASKED[name]
    assert [m.tolist() for m in report.pruned] == PRUNED[name]
    set_head_masks(model, report.pruned, rescale=rescale)
    want = logits_of(model, tokens)
    got = logits_of(pruned_model, tokens)
    assert rel_err(got, want) <= TOL
    for layer, mask in zip(attention_layers(pruned_model), report.pruned):
        assert layer.head_gate is None
        assert layer.o_proj.weight.shape[1] == int(mask.sum()) * (48 // 4 if name != "decoder_gqa" else 8)
    # and it still trains: the new parameters get gradients
    logits_of(pruned_model, tokens).square().mean().backward()
    assert [n for n, p in pruned_model.named_parameters() if "_proj" in n and p.grad is None] == []


def test_pruned_model_with_rescale_differs_from_the_unscaled_pruning():
    model = tiny_decoder(n_heads=4, n_kv_heads=4)
    masks = torch.tensor([[1.0, 0, 1, 1], [1, 1, 1, 1]])
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    prune_model_heads(a, masks, rescale=True)
    prune_model_heads(b, masks, rescale=False)
    wa, wb = attention_layers(a)[0].o_proj.weight, attention_layers(b)[0].o_proj.weight
    assert rel_err(wa, wb * 4 / 3) <= 1e-7  # s_g = H / H_open folded into the kept columns
    assert torch.equal(attention_layers(a)[1].o_proj.weight, attention_layers(b)[1].o_proj.weight)


@pytest.mark.parametrize("name", ["decoder_gqa", "llama"])
def test_a_layer_with_every_head_closed_is_refused_before_anything_changes(name):
    model = build(name)
    h = attention_layers(model)[0].o_proj.weight.shape[1] // (8 if name == "decoder_gqa" else 12)
    masks = torch.ones(2, h)
    masks[0, 0] = 0  # layer 0 would be pruned ...
    masks[1] = 0  # ... but layer 1 closes every head
    before = state(model)
    with pytest.raises(AllHeadsClosedError, match="layer 1 closes every head"):
        prune_model_heads(model, masks)
    assert same_state(state(model), before)
    assert isinstance(AllHeadsClosedError("x"), ValueError)


@pytest.mark.parametrize("masks,match", [
    (torch.ones(3, 4), "one row per attention layer"),
    (torch.ones(2, 2, 4), r"\[num_layers, H\]"),
    (torch.ones(2, 5), r"masks\[0\] must be \[H\] = \[4\]"),
    (torch.full((2, 4), 0.5), "only 0 and 1"),
])
def test_bad_masks_are_named_errors_and_nothing_changes(masks, match):
    model = tiny_decoder()
    before = state(model)
    with pytest.raises(ValueError, match=match):
        prune_model_heads(model, masks)
    assert same_state(state(model), before)
    assert [layer.n_heads for layer in attention_layers(model)] == [4, 4]


def test_gate_masks_read_the_deterministic_gates():
    model = tiny_decoder()
    gates = add_head_gates(model)
    with torch.no_grad():
        gates[0].pi.copy_(torch.tensor([1.0, -1.0, 0.5, -0.1]))
    set_head_gates(model, [gates[0], HeadMask(torch.tensor([0.0, 1, 1, 1]))])
    assert [m.tolist() for m in gate_masks(model)] == [[1, 0, 1, 0], [0, 1, 1, 1]]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_pruned_hf_model_runs_unpatched(kind):
    # Pruning leaves a plain transformers model (smaller q/k/v/o_proj, num_key_value_groups
    # per layer): the original attention forwards compute the same logits.
    model = hf_model(kind)
    prune_model_heads(model, torch.tensor([[1.0, 0, 1, 0], [0, 0, 1, 1]]))
    tokens = tokens_of()
    pruned = logits_of(model, tokens)
    assert headwise.integrations.unpatch_hf_attention(model) == 2
    assert rel_err(logits_of(model, tokens), pruned) <= TOL


def test_dcmha_layers_collect_scores_but_refuse_pruning():
    model = build("decoder_dcmha")
    scores = collect_head_scores(model, [tokens_of()])
    assert scores.ahon.shape == (2, 4) and (scores.ahon > 0).all() and (scores.circuit > 0).all()
    before = state(model)
    with pytest.raises(TypeError, match=r"attention layer 0 \(DCMHAttention\) has no separate q/k/v/o"):
        prune_model_heads(model, torch.tensor([[1.0, 0, 1, 1], [1, 1, 1, 1]]))
    assert same_state(state(model), before)
