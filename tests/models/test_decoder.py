"""headwise.models.Decoder: the residual variants, buffer vs per-call routing, and the
reference_forward oracle."""

import math

import pytest
import torch

from headwise.models import Decoder, DecoderConfig
from headwise.models.decoder import BLOCK_RESIDUALS, RESIDUALS
from headwise.testing import rel_err

TOL = 2.5e-6
# forward vs reference_forward of the whole model: the mha layers' head merge runs the
# kernel against reference.head_merge there, so the merge's fp32 tolerance (tests/merge)
# applies on top of the routers' (sim, attnres: 2.8e-6 measured).
MODEL_TOL = 1e-5


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
            if router.delta:
                router.null_source.copy_(0.3 * torch.randn(router.null_source.shape, generator=gen))
                router.gate.copy_(0.5 + torch.rand((), generator=gen))


def loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("residual", ["attnres", "mhar", "cumulative_mhar"])
def test_buffer_and_per_call_agree_on_a_4_layer_model(backend, residual):
    torch.manual_seed(0)
    tokens = torch.randint(0, 61, (2, 9), device=backend.device)
    results = {}
    for impl in ("buffer", "per_call"):
        torch.manual_seed(0)
        model = Decoder(tiny(residual, impl), ops=backend)
        randomize_routers(model)
        model.to(backend.device)
        results[impl] = loss_and_grads(model, tokens)
    (loss_b, grads_b), (loss_p, grads_p) = results["buffer"], results["per_call"]
    assert rel_err(loss_b, loss_p) <= TOL
    assert grads_b.keys() == grads_p.keys()
    for name in grads_b:
        assert rel_err(grads_b[name], grads_p[name]) <= TOL, name


DELTA_CONFIGS = [dict(residual="delta_mhar"), dict(residual="block_mhar", num_blocks=2),
                 dict(residual="block_mhar", num_blocks=3, routing_heads=1)]


@pytest.mark.parametrize("residual", RESIDUALS)
def test_forward_matches_reference_forward(host_backend, residual):
    torch.manual_seed(0)
    model = Decoder(tiny(residual, num_blocks=3 if residual in BLOCK_RESIDUALS else None), ops=host_backend)
    if residual != "residual":
        randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 7))
    assert rel_err(model(tokens), model.reference_forward(tokens)) <= MODEL_TOL


@pytest.mark.parametrize("kw", DELTA_CONFIGS, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_delta_modes_compute_the_base_model_at_init(host_backend, kw):
    # Zero gate and zero null source: exactly the standard residual model with the same
    # weights, while the gates already receive a gradient.
    torch.manual_seed(0)
    base = Decoder(tiny("residual"), ops=host_backend)
    converted = Decoder(tiny(**kw), ops=host_backend)
    missing, unexpected = converted.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("routers.") for name in missing)
    tokens = torch.randint(0, 61, (2, 9))
    assert torch.equal(converted(tokens), base(tokens))
    _, grads = loss_and_grads(converted, tokens)
    assert all(grads[f"routers.{s}.gate"].abs() > 0 for s in range(len(converted.routers)))


def reference_loss_and_grads(model, tokens):
    fused_forward = model.forward
    model.forward = model.reference_forward
    try:
        return loss_and_grads(model, tokens)
    finally:
        model.forward = fused_forward


@pytest.mark.parametrize("kw", DELTA_CONFIGS, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_delta_modes_gradients_as_accurate_as_reference(host_backend, kw):
    # Whole model, fp32: the fused routing's loss equals the reference model's, and its
    # parameter gradients are about as close to the fp64 truth (the reference model in
    # fp64) as the fp32 reference model's. Through 4 layers the fp32 reference itself is a few
    # 1e-6 from the truth, so fused-vs-reference alone would test rounding noise.
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    models = []
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        model = Decoder(tiny(**kw), ops=host_backend)
        randomize_routers(model)
        models.append(model.to(dtype))
    loss, grads = loss_and_grads(models[0], tokens)
    ref_loss, ref_grads = reference_loss_and_grads(models[0], tokens)
    _, truth = reference_loss_and_grads(models[1], tokens)
    assert rel_err(loss, ref_loss) <= TOL
    # Errors relative to max(|truth_n|, 1e-3 max_m |truth_m|): a gradient far below the
    # model's scale is what remains of cancelling terms of that scale (the last router's
    # gate here: |g| ~ 5e-6 where the others are 1e-3 to 3e-2), so its own relative error
    # measures rounding of those terms in whichever order each side sums them: 1.4e-5 for
    # the fp32 reference, 6e-5 / 1.6e-4 fused, on torch's AVX512 / AVX2 kernels (its
    # absolute error, 3e-10, is below the other parameters').
    scale = 1e-3 * max(t.abs().max().item() for t in truth.values())

    def err(actual, expected):
        return (actual.double() - expected.double()).abs().max().item() / max(expected.abs().max().item(), scale)

    fused_err = {n: err(grads[n], truth[n]) for n in grads}
    ref_err = {n: err(ref_grads[n], truth[n]) for n in grads}
    # Measured: fused/reference error ratios have a geometric mean of 0.9-1.3 over the
    # parameters, and the worst fused error is 0.2-2.1x the worst reference error.
    ratios = [max(fused_err[n], 1e-9) / max(ref_err[n], 1e-9) for n in grads]
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) <= 1.5
    worst = max(fused_err, key=fused_err.get)
    assert fused_err[worst] <= max(TOL, 3 * max(ref_err.values())), (worst, fused_err[worst], max(ref_err.values()))


# Sources per routing site of a 4-layer model (8 sublayers): the delta modes read the null
# source plus [e, completed blocks]; block_attnres reads [e, completed blocks, the current
# block's partial sum when it is not empty], with a final site.
@pytest.mark.parametrize("residual,num_blocks,expected", [
    ("delta_mhar", None, [1, 1, 2, 2, 3, 3, 4, 4]),       # blocks of 1 layer = 2 sublayers
    ("block_mhar", 2, [1, 1, 1, 1, 2, 2, 2, 2]),          # blocks of 2 layers
    ("block_mhar", 4, [1, 1, 2, 2, 3, 3, 4, 4]),          # num_blocks = n_layers: delta_mhar
    ("block_mhar", 3, [1, 1, 1, 1, 2, 2, 2, 2]),          # ceil(4 / 3) = 2 layers per block
    ("block_attnres", 1, [1, 2, 2, 2, 2, 2, 2, 2, 2]),
    ("block_attnres", 2, [1, 2, 2, 2, 2, 3, 3, 3, 3]),
])
def test_sources_per_site(residual, num_blocks, expected):
    model = Decoder(tiny(residual, num_blocks=num_blocks))
    counts = []
    for router in model.routers:
        router.register_forward_pre_hook(lambda m, args: counts.append(len(args[0])))
    model(torch.randint(0, 61, (1, 4)))
    assert counts == expected


def expected_site_inputs(cfg, e0, outputs):
    """The papers' recursions written out for sublayers with constant outputs
    (outputs[s] = e_{s+1}), zero queries (uniform routing), delta gates at 1 and null
    sources at 0: the input of every routing site's sublayer, then the final norm's input."""
    steps = 2 * cfg.n_layers
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    if cfg.residual == "residual":
        return [e0 + sum(outputs[:s]) for s in range(steps + 1)]
    if cfg.residual in ("attnres", "mhar"):  # x_s = route(e0, e1, .., e_s)
        return [mean([e0, *outputs[:s]]) for s in range(steps + 1)]
    if cfg.residual == "cumulative_mhar":  # x_s = route(h_0..h_s), h_{s+1} = x_s + e_{s+1}
        states, inputs = [e0], []
        for s in range(steps + 1):
            inputs.append(mean(states))
            if s < steps:
                states.append(inputs[-1] + outputs[s])
        return inputs
    per_block = 2 * -(-cfg.n_layers // (cfg.num_blocks or cfg.n_layers))  # sublayers per block
    blocks = [list(range(start, min(start + per_block, steps))) for start in range(0, steps, per_block)]
    if cfg.residual == "block_attnres":  # [e0, the sums of each block's outputs so far]
        return [mean([e0] + [sum(outputs[j] for j in b if j < s) for b in blocks if b[0] < s])
                for s in range(steps + 1)]
    # delta modes: h_s + mean([0, e0, completed block sums]); the final norm reads h_2L
    inputs = []
    for s in range(steps):
        deltas = [e0] + [sum(outputs[j] for j in b) for b in blocks if b[-1] < s]
        inputs.append(e0 + sum(outputs[:s]) + sum(deltas) / (len(deltas) + 1))
    return inputs + [e0 + sum(outputs)]


RECURSION_CASES = ([dict(residual=r) for r in ("residual", "attnres", "mhar", "cumulative_mhar", "delta_mhar")]
                   + [dict(residual=r, num_blocks=n) for r in ("block_attnres", "block_mhar") for n in (1, 2, 3, 5)]
                   + [dict(residual=r, routing_impl="per_call") for r in ("attnres", "mhar", "cumulative_mhar")])


@pytest.mark.parametrize("kw", RECURSION_CASES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_each_site_reads_the_papers_recursion(host_backend, kw):
    # 5 layers, so that num_blocks = 2 and 3 leave a shorter last block (3 + 2 and 2 + 2 + 1
    # layers), 1 is one block and 5 is one layer per block.
    model = Decoder(tiny(n_layers=5, **kw), ops=host_backend)
    for router in model.routers:
        if router.delta:
            with torch.no_grad():
                router.gate.fill_(1.0)
    tokens = torch.randint(0, 61, (2, 3), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    outputs = [torch.randn(2, 3, 48, generator=gen) for _ in range(10)]
    inputs = []

    def constant_sublayer(s, x, cos, sin, use_reference=False):
        inputs.append(x.detach().clone())
        return outputs[s]

    model._sublayer = constant_sublayer
    model.final_norm.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone()))
    with torch.no_grad():
        model(tokens)
        expected = expected_site_inputs(model.cfg, model.embed(tokens), outputs)
    assert len(inputs) == len(expected) == 11
    for s, (got, want) in enumerate(zip(inputs, expected)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"site {s}")


def test_mhar_site_2_reads_the_embedding_and_the_sublayer_outputs():
    # The example: constant sublayer outputs e1, e2 and zero queries; site 2 reads
    # (e0, e1, e2), not the cumulative states (e0, e0 + e1, e0 + e1/2 + e2).
    model = Decoder(tiny("mhar", n_layers=1))
    tokens = torch.randint(0, 61, (1, 4))
    e1, e2 = torch.full((1, 4, 48), 1.0), torch.full((1, 4, 48), -3.0)
    inputs = []

    def constant_sublayer(s, x, cos, sin, use_reference=False):
        inputs.append(x.detach())
        return (e1, e2)[s]

    model._sublayer = constant_sublayer
    model.final_norm.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
    with torch.no_grad():
        model(tokens)
        e0 = model.embed(tokens)
    torch.testing.assert_close(inputs[2], (e0 + e1 + e2) / 3, rtol=1e-6, atol=1e-6)


def test_routing_heads_defaults():
    assert tiny("mhar").routing_heads_resolved == 2  # n_kv_heads: the MHAR paper's H = KV
    assert tiny("delta_mhar").routing_heads_resolved == 2
    assert tiny("attnres").routing_heads_resolved == 1
    assert tiny("block_attnres", num_blocks=2).routing_heads_resolved == 1
    assert tiny("block_attnres", num_blocks=2, routing_heads=4).routing_heads_resolved == 4  # block_mh
    assert tiny("cumulative_mhar").routing_heads_resolved == 4  # n_heads, as before 2026-11-30
    assert len(Decoder(tiny("delta_mhar")).routers) == 8  # 2L sites, no final routing
    assert len(Decoder(tiny("block_attnres", num_blocks=2)).routers) == 9


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
    (dict(attention="flash"), "attention"),
    (dict(attention="dcmha"), "n_kv_heads"),  # tiny() uses GQA; DCMHA composes full heads
    (dict(routing_heads=5), "routing_heads"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(num_blocks=2), "num_blocks"),
    (dict(residual="block_mhar"), "num_blocks"),
    (dict(residual="block_attnres"), "num_blocks"),
    (dict(residual="attnres", routing_heads=2), "routing_heads"),
    (dict(routing_heads=0), "routing_heads"),
    (dict(residual="block_mhar", num_blocks=0), "num_blocks"),
    (dict(residual="delta_mhar", num_blocks=2), "num_blocks"),
])
def test_bad_config(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(**bad)


@pytest.mark.parametrize("kw", [dict(residual="mhar"), dict(residual="block_mhar", num_blocks=2),
                                dict(residual="block_attnres", num_blocks=2)])
def test_per_call_model_compiles_fullgraph(kw):
    torch.manual_seed(0)
    model = Decoder(tiny(routing_impl="per_call", n_layers=2, **kw))
    randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 9))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(tokens)
    out.square().mean().backward()
    torch.testing.assert_close(out, model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("residual", ["mhar", "delta_mhar", "block_attnres"])
def test_per_call_model_under_activation_checkpointing(host_backend, residual):
    torch.manual_seed(0)
    model = Decoder(tiny(residual, "per_call", n_layers=2, num_blocks=1 if residual in BLOCK_RESIDUALS else None),
                    ops=host_backend)
    randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 9))
    _, plain = loss_and_grads(model, tokens)
    model.zero_grad(set_to_none=True)
    logits = torch.utils.checkpoint.checkpoint(model, tokens, use_reentrant=False)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 61), tokens[:, 1:].reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert rel_err(p.grad, plain[name]) <= TOL, name


@pytest.mark.parametrize("kw", [dict(residual="mhar"), dict(residual="mhar", routing_impl="per_call"),
                                dict(residual="block_mhar", num_blocks=2), dict(residual="block_attnres", num_blocks=2),
                                dict(residual="mhar", attention="dcmha", n_kv_heads=4)],
                         ids=["buffer", "per_call", "block_mhar", "block_attnres", "dcmha"])
def test_autocast_bf16_policy(host_backend, kw):
    # headwise ops are not cast by autocast: they run in their inputs' dtype. In the
    # decoder the residual stream stays fp32 under autocast (embedding fp32, fp32 + bf16
    # sublayer outputs), so routing runs in fp32 while the projections run in bf16: the
    # fused model then matches the reference model under the same autocast up to fp32
    # rounding of the routing.
    torch.manual_seed(0)
    model = Decoder(tiny(**kw), ops=host_backend)
    randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 9))
    seen = []
    for router in model.routers:
        router.register_forward_pre_hook(lambda m, args: seen.append(
            args[0].dtype if isinstance(args[0], torch.Tensor) else args[0][0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(model, tokens)
        ref_loss, ref_grads = reference_loss_and_grads(model, tokens)
    if kw.get("routing_impl", "buffer") != "buffer" or kw["residual"] in BLOCK_RESIDUALS:
        assert seen and set(seen) == {torch.float32}
    # With DCMHA the attention itself runs in bf16 (its autocast policy), where the fused
    # kernel and the reference math round differently and flip single bf16 roundings of
    # the logits: the losses then differ by 1e-5..5e-5 (measured: residual 5.2e-5, mhar
    # 1.8e-5, attnres 1.2e-5 relative), also without any routing.
    assert torch.isfinite(loss) and rel_err(loss, ref_loss) <= (1e-4 if kw.get("attention") == "dcmha" else 1e-5)
    # Gradients pass through bf16 matmuls, where an fp32 rounding difference upstream
    # flips bf16 roundings, so compare both autocast runs with the fp32 run: the fused
    # model's gradients are as close to it as the reference model's (geometric mean of
    # the Frobenius-error ratios over the parameters; measured 0.97 for block_mhar).
    _, fp32_grads = loss_and_grads(model, tokens)

    def err(a, b):
        return ((a - b).norm() / b.norm()).item()

    ratios = []
    for name in grads:
        assert torch.isfinite(grads[name]).all(), name
        if fp32_grads[name].norm() == 0:  # e.g. the query of the one-source first routing
            assert grads[name].norm() == 0, name
            continue
        ratios.append(max(err(grads[name], fp32_grads[name]), 1e-7) / max(err(ref_grads[name], fp32_grads[name]), 1e-7))
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) <= 1.25


def test_mhar_route_keeps_its_dtype_under_autocast(host_backend):
    sources = torch.randn(3, 2, 5, 16)
    query, norm_weight = 0.3 * torch.randn(16), torch.ones(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert host_backend.mhar_route(sources, query, norm_weight, num_heads=2).dtype == torch.float32
        out = host_backend.mhar_route(sources.bfloat16(), query, norm_weight, num_heads=2)
    assert out.dtype == torch.bfloat16


def test_buffer_model_under_torch_compile_with_graph_breaks():
    # DepthBuffer's backward mutates Python-side state (the shared accumulator and the
    # reverse-order check), which dynamo does not trace: each buffer routing call is a
    # graph break, and the compiled model still gives the eager loss and gradients.
    # (Per-call and delta routing compile with fullgraph=True, see above.)
    torch.manual_seed(0)
    model = Decoder(tiny("mhar", "buffer", n_layers=2))
    randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 9))
    loss, grads = loss_and_grads(model, tokens)
    compiled = torch.compile(model, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    logits = compiled(tokens)
    compiled_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 61), tokens[:, 1:].reshape(-1))
    compiled_loss.backward()
    assert rel_err(compiled_loss, loss) <= TOL
    for name, p in model.named_parameters():
        assert rel_err(p.grad, grads[name]) <= TOL, name


def test_routing_saves_only_the_weights_in_a_whole_model():
    # Buffer routing: the whole model saves for backward exactly what the standard residual
    # model saves plus w [s + 1, B, T, H] (fp32) of each routing call s; the states live in
    # the DepthBuffer, written once.
    from headwise.bench.timing import saved_bytes

    tokens = torch.randint(0, 61, (2, 9))
    saved = {}
    for residual in ("residual", "mhar"):
        torch.manual_seed(0)
        model = Decoder(tiny(residual))
        randomize_routers(model)
        saved[residual] = saved_bytes(lambda: model(tokens), list(model.parameters()))
    n_layers, heads = 4, tiny("mhar").routing_heads_resolved
    weights = sum((s + 1) * 2 * 9 * heads * 4 for s in range(2 * n_layers + 1))
    assert saved["mhar"] - saved["residual"] == weights


@pytest.mark.parametrize("residual", ["residual", "mhar"])
def test_dcmha_attention_decoder_matches_reference_forward(host_backend, residual):
    torch.manual_seed(0)
    model = Decoder(tiny(residual, n_kv_heads=4, attention="dcmha", n_layers=2), ops=host_backend)
    if residual != "residual":
        randomize_routers(model)
    tokens = torch.randint(0, 61, (2, 9))
    loss, grads = loss_and_grads(model, tokens)
    ref_loss, ref_grads = reference_loss_and_grads(model, tokens)
    assert rel_err(loss, ref_loss) <= 1e-5
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) <= 1e-4, name
