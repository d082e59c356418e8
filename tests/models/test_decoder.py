"""headwise.models.Decoder: the residual variants, buffer vs per-call routing, and the
reference_forward oracle."""

import pytest
import torch

import headwise
from headwise.models import Decoder, DecoderConfig
from headwise.testing import rel_err

TOL = 2.5e-6


def tiny(residual="mhar", routing_impl="buffer", n_layers=4, **kw):
    args = dict(vocab_size=61, d_model=48, n_layers=n_layers, n_heads=4, n_kv_heads=2, residual=residual,
                routing_impl=routing_impl)
    return DecoderConfig(**{**args, **kw})


def randomize_routers(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in model.routers:
            router.query.copy_(0.5 * torch.randn(router.query.shape, generator=gen))
            router.norm_weight.copy_(1 + 0.1 * torch.randn(router.norm_weight.shape, generator=gen))


def loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("residual", ["attnres", "mhar"])
def test_buffer_and_per_call_agree_on_a_4_layer_model(backend, residual):
    torch.manual_seed(0)
    tokens = torch.randint(0, 61, (2, 9))
    results = {}
    for impl in ("buffer", "per_call"):
        torch.manual_seed(0)
        model = Decoder(tiny(residual, impl), ops=backend)
        randomize_routers(model)
        results[impl] = loss_and_grads(model, tokens)
    (loss_b, grads_b), (loss_p, grads_p) = results["buffer"], results["per_call"]
    assert rel_err(loss_b, loss_p) <= TOL
    assert grads_b.keys() == grads_p.keys()
    for name in grads_b:
        assert rel_err(grads_b[name], grads_p[name]) <= TOL, name


@pytest.mark.parametrize("residual", ["residual", "attnres", "mhar"])
def test_forward_matches_reference_forward(host_backend, residual):
    torch.manual_seed(0)
    model = Decoder(tiny(residual), ops=host_backend)
    if residual != "residual":
        randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 7))
    assert rel_err(model(tokens), model.reference_forward(tokens)) <= TOL


def test_zero_init_routing_is_the_uniform_average():
    model = Decoder(tiny("mhar", n_layers=1))
    assert all(torch.equal(r.query, torch.zeros_like(r.query)) for r in model.routers)
    assert len(model.routers) == 3  # 2L + 1 routing calls
    states = torch.randn(3, 2, 5, 48)
    torch.testing.assert_close(model.routers[2](states), states.mean(0), rtol=1e-6, atol=1e-6)


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = Decoder(tiny("mhar", n_layers=2))
    tokens = torch.randint(0, 61, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss, _ = loss_and_grads(model, tokens)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("bad,match", [
    (dict(residual="hyper"), "residual"),
    (dict(routing_impl="stack"), "routing_impl"),
    (dict(attention="dcmha"), "attention"),
    (dict(routing_heads=5), "routing_heads"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(num_blocks=2), "num_blocks"),
])
def test_bad_config(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(**bad)


def test_per_call_model_compiles_fullgraph():
    torch.manual_seed(0)
    model = Decoder(tiny("mhar", "per_call", n_layers=2))
    randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 9))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(tokens)
    out.square().mean().backward()
    torch.testing.assert_close(out, model(tokens), rtol=0, atol=0)


def test_per_call_model_under_activation_checkpointing(host_backend):
    torch.manual_seed(0)
    model = Decoder(tiny("mhar", "per_call", n_layers=2), ops=host_backend)
    randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 9))
    _, plain = loss_and_grads(model, tokens)
    model.zero_grad(set_to_none=True)
    logits = torch.utils.checkpoint.checkpoint(model, tokens, use_reentrant=False)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 61), tokens[:, 1:].reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert rel_err(p.grad, plain[name]) <= TOL, name
