"""Inputs and the explicit per-(t, s) H x H oracle of the DCMHA tests."""

import torch

from headwise import DCMHAWeights


def make_weights(b, t, h, *, dtype=torch.float32, device="cpu", seed=0, scale=0.3):
    """Random dynamic weights of the magnitude DCMHA reaches in training (w1 normalized
    over heads as dcmha_weights returns it, w2 and g small)."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(b, t, 4, 2, h, generator=gen, dtype=torch.float64)
    w1 = w1 * torch.rsqrt(w1.square().mean(-1, keepdim=True) + 1e-6)
    w2 = scale * torch.randn(b, t, 4, 2, h, generator=gen, dtype=torch.float64) / h
    g = scale * torch.randn(b, t, 4, h, generator=gen, dtype=torch.float64)
    return DCMHAWeights(*(x.to(dtype).to(device) for x in (w1, w2, g)))


def explicit_compose(a, weights, slot, head_groups=1):
    """The explicit oracle: for every (t, s) the H x H matrix
    M[n, m] = delta_nm (1 + Gq[m] + Gk[m]) + sum_r W1q[r,n] W2q[r,m] + W1k[r,n] W2k[r,m]
    (zero across head groups), and A'[m] = sum_n A[n] M[n, m]. Forms [B, T, S, H, H]
    on purpose (small shapes only), in float64."""
    cq, ck = (0, 1) if slot == "pre" else (2, 3)
    w1, w2, g = (x.double() for x in weights)
    a = a.double()
    b, h, t, s = a.shape
    mq = torch.einsum("btrn,btrm->btnm", w1[:, :, cq], w2[:, :, cq])  # [B, T, H, H]
    mk = torch.einsum("bsrn,bsrm->bsnm", w1[:, :, ck], w2[:, :, ck])  # [B, S, H, H]
    m = mq[:, :, None] + mk[:, None, :]  # [B, T, S, H, H]
    diag = 1 + g[:, :, cq][:, :, None, :] + g[:, :, ck][:, None, :, :]  # [B, T, S, H]
    m = m + torch.diag_embed(diag)
    groups = torch.arange(h) // (h // head_groups)
    m = m * (groups[:, None] == groups[None, :]).double()
    return torch.einsum("bnts,btsnm->bmts", a, m)
