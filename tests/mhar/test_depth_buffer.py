"""headwise.DepthBuffer: in-place routing over one state buffer, with the fused backward
that accumulates every source gradient into one shared fp32 buffer."""

import pytest
import torch

import headwise
from headwise import reference
from headwise.testing import rel_err

TOL = 2.5e-6


def make_chain(d, layers, heads, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    sublayers = [torch.nn.Linear(d, d) for _ in range(layers)]
    for layer in sublayers:
        with torch.no_grad():
            layer.weight.copy_(torch.randn(d, d, generator=gen) / d**0.5)
            layer.bias.copy_(0.1 * torch.randn(d, generator=gen))
        layer.to(device)
    queries = [torch.nn.Parameter((0.3 * torch.randn(d, generator=gen)).to(device)) for _ in range(layers + 1)]
    norms = [torch.nn.Parameter((1 + 0.1 * torch.randn(d, generator=gen)).to(device)) for _ in range(layers + 1)]
    return sublayers, queries, norms


def run_chain(x, sublayers, queries, norms, heads, ops, mode):
    """x [B, T, d] -> routed chain: before sublayer i, route over states [0, i]; a final
    routing over all states. mode "buffer" uses DepthBuffer, "per_call" stacks states."""
    layers = len(sublayers)
    if mode == "buffer":
        buf = headwise.DepthBuffer(layers + 1, *x.shape, device=x.device, ops=ops)
        state = x
        for i in range(layers + 1):
            buf.write(i, state)
            mixed = buf.route(i, state, queries[i], norms[i], num_heads=heads)
            if i < layers:
                state = torch.tanh(sublayers[i](mixed))
        return mixed
    states = [x]
    for i in range(layers + 1):
        mixed = ops.mhar_route(torch.stack(states), queries[i], norms[i], num_heads=heads)
        if i < layers:
            states.append(torch.tanh(sublayers[i](mixed)))
    return mixed


def grads_of(x, params, out, grad):
    out.backward(grad)
    return [x.grad] + [p.grad for p in params]


# d = 512, 2 heads: heads of whole warps in the CUDA kernels' vector layout (their backward
# defers the head sums to the end of pass 1, and accumulates into the buffer).
@pytest.mark.parametrize("d,layers,heads", [(48, 4, 4), (37, 3, 1), (64, 6, 8),
                                            pytest.param(512, 3, 2, id="512-3-2-whole-warp-heads")])
def test_buffer_gradients_equal_per_call(backend, d, layers, heads):
    torch.manual_seed(1)
    x0 = torch.randn(2, 5, d, device=backend.device)
    grad = torch.randn(2, 5, d, device=backend.device)
    results = {}
    for mode in ("buffer", "per_call"):
        sublayers, queries, norms = make_chain(d, layers, heads, device=backend.device)
        x = x0.clone().requires_grad_()
        out = run_chain(x, sublayers, queries, norms, heads, backend, mode)
        params = [p for layer in sublayers for p in layer.parameters()] + queries + norms
        results[mode] = [out.detach()] + grads_of(x, params, out, grad)
    for got, want in zip(results["buffer"], results["per_call"]):
        assert rel_err(got, want) <= TOL


def test_backward_into_stores_then_accumulates(backend):
    n, b, t, d, h = 5, 2, 3, 32, 4
    sources = torch.randn(n, b, t, d, device=backend.device)
    query, norm_weight = 0.3 * torch.randn(d, device=backend.device), torch.ones(d, device=backend.device)
    lib = getattr(torch.ops, backend.ns)
    _, w = lib.mhar_route(sources, query, norm_weight, h, 3, 1e-6, None, None)
    grad_out = torch.randn(b, t, d, device=backend.device)
    grad_sources, gq, gg, _ = lib.mhar_route_backward(grad_out, sources, query, norm_weight, w, None, h, 3, 1e-6)
    buf = torch.full((n, b, t, d), 7.0, device=backend.device)
    gq2, gg2 = lib.mhar_route_backward_into(grad_out, sources, query, norm_weight, w, buf, h, 3, 1e-6, False)
    assert torch.equal(buf[:3], grad_sources[:3]) and torch.equal(buf[3:], torch.full_like(buf[3:], 7.0))
    assert torch.equal(gq, gq2) and torch.equal(gg, gg2)
    lib.mhar_route_backward_into(grad_out, sources, query, norm_weight, w, buf, h, 3, 1e-6, True)
    assert rel_err(buf[:3], 2 * grad_sources[:3]) <= 1e-7


def test_backward_into_opcheck(backend):
    n, b, t, d, h = 4, 2, 3, 16, 2
    sources = torch.randn(n, b, t, d, device=backend.device)
    query, norm_weight = torch.randn(d, device=backend.device), torch.ones(d, device=backend.device)
    lib = getattr(torch.ops, backend.ns)
    _, w = lib.mhar_route(sources, query, norm_weight, h, n, 1e-6, None, None)
    buf = torch.zeros(n, b, t, d, device=backend.device)
    torch.library.opcheck(lib.mhar_route_backward_into,
                          (torch.randn(b, t, d, device=backend.device), sources, query, norm_weight, w, buf, h, n,
                           1e-6, True))


def test_backward_into_rejects_a_wrong_buffer(host_backend):
    sources = torch.randn(3, 1, 2, 8)
    lib = getattr(torch.ops, host_backend.ns)
    q, g = torch.zeros(8), torch.ones(8)
    _, w = lib.mhar_route(sources, q, g, 2, 3, 1e-6, None, None)
    for bad, err in ((torch.zeros(3, 1, 2, 8, dtype=torch.bfloat16), TypeError), (torch.zeros(2, 1, 2, 8), ValueError)):
        with pytest.raises(err, match="grad_sources"):
            lib.mhar_route_backward_into(torch.randn(1, 2, 8), sources, q, g, w, bad, 2, 3, 1e-6, False)


def test_out_of_order_backward_is_refused(host_backend):
    buf = headwise.DepthBuffer(2, 1, 2, 8, ops=host_backend)
    q = torch.zeros(8, requires_grad=True)
    g = torch.ones(8)
    s0, s1 = torch.randn(1, 2, 8, requires_grad=True), torch.randn(1, 2, 8, requires_grad=True)
    buf.write(0, s0)
    out0 = buf.route(0, s0, q, g, num_heads=1)
    buf.write(1, s1)  # not computed from out0: the residual chain is broken
    buf.route(1, s1, q, g, num_heads=1)
    with pytest.raises(RuntimeError, match="last routing call"):
        out0.sum().backward()


def test_each_row_written_once_and_before_routing():
    buf = headwise.DepthBuffer(2, 1, 2, 8)
    s = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="written"):
        buf.route(0, s, torch.zeros(8), torch.ones(8), num_heads=1)
    buf.write(0, s)
    with pytest.raises(RuntimeError, match="once"):
        buf.write(0, s)


def test_matches_reference_on_a_single_call(host_backend):
    states = torch.randn(3, 2, 4, 16)
    q, g = 0.3 * torch.randn(16), torch.ones(16)
    buf = headwise.DepthBuffer(3, 2, 4, 16, ops=host_backend)
    for i in range(3):
        buf.write(i, states[i])
    torch.testing.assert_close(buf.route(2, states[2], q, g, num_heads=4),
                               reference.mhar_route(states, q, g, num_heads=4), rtol=2e-6, atol=2e-6)
