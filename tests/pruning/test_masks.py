"""Hard masks from scores (quantile, fixed threshold) and the GQA rule that makes a mask
prunable."""

import math

import pytest
import torch

from headwise import prunable_mask, quantile_masks, threshold_masks


def distinct_scores(layers=4, heads=8, seed=0):
    return torch.rand(layers, heads, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q", [0.0, 0.125, 0.25, 0.3, 0.5, 0.75, 1.0])
def test_quantile_masks_close_the_heads_below_the_quantile(q):
    scores = distinct_scores()
    masks = quantile_masks(scores, q)
    n = scores.numel()
    assert masks.shape == scores.shape and masks.dtype == torch.float32
    assert set(masks.unique().tolist()) <= {0.0, 1.0}
    assert int((masks == 0).sum()) == math.ceil(q * (n - 1))
    # the closed heads are exactly the lowest-scoring ones
    if 0 < q:
        assert scores[masks == 0].max() < scores[masks == 1].min()


def test_quantile_masks_per_layer_close_the_same_number_in_every_layer():
    scores = distinct_scores()
    masks = quantile_masks(scores, 0.5, per_layer=True)
    assert ((masks == 0).sum(1) == math.ceil(0.5 * 7)).all()


def test_threshold_masks():
    scores = torch.tensor([[0.05, 0.5, 1.5, 2.0], [0.2, 0.09, 1.0, 2.71]])
    assert torch.equal(threshold_masks(scores, 0.1), torch.tensor([[0.0, 1, 1, 1], [1, 0, 1, 1]]))
    assert torch.equal(threshold_masks(scores[0], 0.0), torch.ones(4))


@pytest.mark.parametrize("q", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_quantile_outside_the_unit_interval_is_a_named_error(q):
    scores = distinct_scores()
    before = scores.clone()
    with pytest.raises(ValueError, match="quantile must be a number in \\[0, 1\\]"):
        quantile_masks(scores, q)
    assert torch.equal(scores, before)


def test_bad_scores_and_tau_are_named_errors():
    with pytest.raises(ValueError, match="scores"):
        quantile_masks(torch.zeros(2, 3, 4), 0.5)
    with pytest.raises(ValueError, match="scores must be finite"):
        threshold_masks(torch.tensor([1.0, float("nan")]), 0.1)
    with pytest.raises(ValueError, match="tau"):
        threshold_masks(torch.ones(3), float("inf"))


@pytest.mark.parametrize("mask,kv,want", [
    # MHA: the asked mask is prunable as is.
    ([1, 0, 1, 0], 4, [1, 0, 1, 0]),
    # GQA groups {0,1},{2,3},{4,5}: group 1 fully closed goes whole; groups 0 and 2 lose min(1, 0) = 0.
    ([0, 1, 0, 0, 1, 1], 3, [1, 1, 0, 0, 1, 1]),
    # every group loses the same number: min(1, 1, 2) = 1 per group, group 2 prunes its first closed head.
    ([0, 1, 1, 0, 1, 1, 0, 0, 1], 3, [0, 1, 1, 0, 1, 1, 0, 1, 1]),
    # group 1 whole; groups 0 and 2 close 1 and 2 heads -> 1 each
    ([1, 0, 1, 0, 0, 0, 0, 0, 1], 3, [1, 0, 1, 0, 0, 0, 0, 1, 1]),
    # nothing closed
    ([1, 1, 1, 1], 2, [1, 1, 1, 1]),
    # every head closed: stays all-closed (a caller decides what that means)
    ([0, 0, 0, 0], 2, [0, 0, 0, 0]),
])
def test_prunable_mask_gqa_rule(mask, kv, want):
    got = prunable_mask(torch.tensor(mask, dtype=torch.float32), kv)
    assert got.tolist() == want
    assert all(g == 1 for a, g in zip(mask, got.tolist()) if a == 1)  # never closes a head the mask keeps


def test_prunable_mask_follows_the_priority_within_a_group():
    mask = torch.tensor([0.0, 1, 1, 0, 0, 1])  # groups of 3 close 1 and 2 heads -> k = 1 per group
    assert prunable_mask(mask, 2).tolist() == [0, 1, 1, 0, 1, 1]  # ties: the lower index
    prio = torch.tensor([0.0, 0, 0, 5.0, 1.0, 0])  # group 1 prunes its lower-priority closed head (4)
    assert prunable_mask(mask, 2, priority=prio).tolist() == [0, 1, 1, 1, 0, 1]


def test_prunable_mask_bad_input_is_named():
    with pytest.raises(ValueError, match="num_kv_heads"):
        prunable_mask(torch.ones(6), 4)
    with pytest.raises(ValueError, match="only 0 and 1"):
        prunable_mask(torch.tensor([1.0, 0.5]), 1)
    with pytest.raises(ValueError, match="priority"):
        prunable_mask(torch.ones(4), 2, priority=torch.ones(3))
