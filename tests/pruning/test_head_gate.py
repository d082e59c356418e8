"""headwise.nn.HeadGate (BinConcrete and Hard-Concrete head gates) and L0Schedule."""

import math

import pytest
import torch

import headwise
from headwise import reference
from headwise.nn import HeadGate, L0Schedule
from headwise.testing import rel_err

PIS = torch.tensor([-2.0, -0.5, 0.0, 1.0, 2.0, 4.0])
SAMPLES = 200_000


def gate_with(pi, **kw):
    gate = HeadGate(pi.numel(), generator=torch.Generator().manual_seed(0), **kw)
    with torch.no_grad():
        gate.pi.copy_(pi)
    return gate


def test_bin_concrete_open_probability_and_expected_l0_match_monte_carlo():
    gate = gate_with(PIS)
    with torch.no_grad():
        g = gate.sample(SAMPLES)  # [SAMPLES, H]
    assert set(g.unique().tolist()) <= {0.0, 1.0}
    p = torch.sigmoid(PIS)
    # 5 standard errors of a Bernoulli mean over SAMPLES draws (<= 0.0056).
    tol = 5 * torch.sqrt(p * (1 - p) / SAMPLES) + 1e-6
    assert ((g.mean(0) - p).abs() <= tol).all(), (g.mean(0), p)
    assert abs(g.sum(1).mean().item() - gate.expected_l0().item()) <= 5 * math.sqrt((p * (1 - p)).sum() / SAMPLES)
    # The seed's numbers: init 2 opens a head with ~88% probability, init 0 with 50%.
    assert HeadGate(3).open_probability()[0].item() == pytest.approx(0.8808, abs=1e-4)
    assert HeadGate(3, init=0.0).open_probability()[0].item() == 0.5


def test_open_probability_does_not_depend_on_the_temperature():
    for tau in (0.1, 2 / 3, 3.0):
        gate = gate_with(torch.tensor([1.0]), temperature=tau)
        with torch.no_grad():
            freq = gate.sample(SAMPLES).mean().item()
        assert abs(freq - torch.sigmoid(torch.tensor(1.0)).item()) <= 0.005, tau


def test_hard_concrete_open_probability_and_expected_l0_match_monte_carlo():
    gate = gate_with(PIS, distribution="hard_concrete")
    with torch.no_grad():
        g = gate.sample(SAMPLES)
    assert g.min().item() >= 0 and g.max().item() <= 1
    assert ((g > 0) & (g < 1)).any() and (g == 0).any() and (g == 1).any()  # continuous, with mass at 0 and 1
    p = gate.open_probability().detach()
    tol = 5 * torch.sqrt(p * (1 - p) / SAMPLES) + 1e-6
    assert (((g > 0).float().mean(0) - p).abs() <= tol).all()
    assert abs((g > 0).float().sum(1).mean().item() - gate.expected_l0().item()) <= 0.02
    # Louizos et al.: P(g > 0) = sigmoid(pi - beta log(-gamma / zeta)) = 0.973 at pi = 2.
    assert HeadGate(1, distribution="hard_concrete").open_probability().item() == pytest.approx(0.9734, abs=1e-4)


@pytest.mark.parametrize("distribution", ["bin_concrete", "hard_concrete"])
def test_eval_gate_is_deterministic(distribution):
    gate = gate_with(PIS, distribution=distribution).eval()
    first = gate(5)
    assert torch.equal(first, gate(5)) and torch.equal(first, gate())
    assert first.shape == (PIS.numel(),)
    if distribution == "bin_concrete":
        assert torch.equal(first, (PIS > 0).float())
    assert torch.equal(gate.open_heads(), first > 0)


def test_per_row_samples_one_gate_row_per_batch_row():
    gate = gate_with(torch.zeros(4), per_row=True).train()
    g = gate(64)
    assert g.shape == (64, 4)
    assert not torch.equal(g, g[:1].expand_as(g))  # rows differ (P = 1/2 per entry)
    assert gate_with(torch.zeros(4)).train()(64).shape == (4,)


def test_straight_through_gradient_reaches_every_pi():
    tau = 0.5
    gate = gate_with(PIS, temperature=tau).train()
    weights = torch.arange(1.0, PIS.numel() + 1)
    g = gate()
    (g * weights).sum().backward()
    # The same noise again: soft = sigmoid((pi + L) / tau), d g / d pi = soft (1 - soft) / tau.
    u = torch.rand(PIS.numel(), generator=torch.Generator().manual_seed(0)).clamp(1e-6, 1 - 1e-6)
    logits = PIS + torch.log(u) - torch.log1p(-u)
    soft = torch.sigmoid(logits / tau)
    assert torch.equal(g.detach(), (logits > 0).float())
    assert rel_err(gate.pi.grad, weights * soft * (1 - soft) / tau) <= 1e-6
    assert (gate.pi.grad != 0).all()  # closed heads too


def test_straight_through_gradient_through_the_head_merge(host_backend):
    torch.manual_seed(0)
    b, h, q, dv, d = 2, 5, 7, 3, 6
    z, w = torch.randn(b, h, q, dv), torch.randn(d, h * dv)
    grads = []
    for merge in (host_backend.head_merge, reference.head_merge):
        gate = gate_with(torch.tensor([2.0, -1.0, 0.5, -0.5, 1.5])).train()
        g = gate()
        assert 0 < g.sum().item() < h  # some heads open, some closed in this sample
        merge(z, w, head_gate=g, rescale=True).square().sum().backward()
        grads.append(gate.pi.grad.clone())
    assert (grads[0] != 0).all()  # closed heads get a gradient through the merge too
    assert rel_err(grads[0], grads[1]) <= 1e-5


def test_freeze_makes_the_training_gate_the_deterministic_one():
    gate = gate_with(PIS).train()
    gate.freeze()
    assert torch.equal(gate(), (PIS > 0).float()) and not gate.pi.requires_grad
    assert bool(gate.state_dict()["frozen"])


def test_bad_arguments_are_named():
    for kwargs, name in [(dict(num_heads=0), "num_heads"), (dict(num_heads=2, distribution="gumbel"), "distribution"),
                         (dict(num_heads=2, temperature=0.0), "temperature"),
                         (dict(num_heads=2, init=float("nan")), "init")]:
        with pytest.raises(ValueError, match=name):
            HeadGate(**kwargs)


def test_l0_schedule_warms_up_then_freezes():
    sched = L0Schedule(0.02, warmup_steps=4000, freeze_after=16000)
    assert sched.lambda_at(0) == 0.0
    assert sched.lambda_at(1000) == pytest.approx(0.005)
    assert sched.lambda_at(4000) == sched.lambda_at(15999) == 0.02
    assert sched.lambda_at(16000) == 0.0 and sched.frozen_at(16000) and not sched.frozen_at(15999)
    gates = [gate_with(PIS), gate_with(PIS[:3])]
    penalty = sched.penalty(2000, gates)
    want = 0.01 * (torch.sigmoid(PIS).sum() + torch.sigmoid(PIS[:3]).sum())
    assert rel_err(penalty, want) <= 1e-6
    penalty.backward()
    assert all(g.pi.grad is not None for g in gates) and not any(bool(g.frozen) for g in gates)
    assert sched.penalty(16000, gates).item() == 0.0
    assert all(bool(g.frozen) and not g.pi.requires_grad for g in gates)
    assert L0Schedule(1.0, warmup_steps=0, freeze_after=5).lambda_at(0) == 1.0


def test_l0_schedule_bad_arguments_are_named():
    for kwargs, name in [(dict(lambda_max=-1.0), "lambda_max"), (dict(lambda_max=1.0, warmup_steps=-1), "warmup_steps"),
                         (dict(lambda_max=1.0, warmup_steps=10, freeze_after=5), "freeze_after")]:
        with pytest.raises(ValueError, match=name):
            L0Schedule(**kwargs)


def test_head_gate_is_exported():
    assert headwise.nn.HeadGate is HeadGate
