"""Converters to a fused QKV layout, checked by output parity of whole attention
modules: nn.MultiheadAttention and Hugging Face Llama / Qwen3 attention on tiny random
models built from transformers configs (nothing is downloaded)."""

import pytest
import torch
import torch.nn.functional as F

import headwise
from headwise.testing import rel_err

TOL = 2e-5


def _attend(q, k, v, out_proj, *, scale, causal=False):
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                       enable_gqa=k.shape[1] != q.shape[1])
    b, h, s, dv = o.shape
    return out_proj(o.transpose(1, 2).reshape(b, s, h * dv))


@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_parity(backend, bias):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(12, 3, bias=bias, batch_first=True).to(backend.device)
    with torch.no_grad():
        if bias:
            mha.in_proj_bias.normal_()  # nn.MultiheadAttention zero-initializes it
    layout, weight, b = headwise.from_multihead_attention(mha)
    assert layout == headwise.QKVLayout(3, 3, 4) and weight.shape == (36, 12)
    assert (b is None) == (not bias)
    x = torch.randn(2, 5, 12, device=backend.device)
    # MHA scales the logits by head_dim ** -0.5: fold it into q, attend with scale 1.
    q, k, v = backend.qkv_project(x, weight, b, layout=layout, scale_q=layout.head_dim ** -0.5)
    got = _attend(q, k, v, mha.out_proj, scale=1.0)
    want, _ = mha(x, x, x, need_weights=False)
    assert rel_err(got, want) <= TOL
    # Gradients through the converted projection reach the module's parameters' values.
    xg = x.clone().requires_grad_()
    wg = weight.clone().requires_grad_()
    q, k, v = backend.qkv_project(xg, wg, b, layout=layout, scale_q=layout.head_dim ** -0.5)
    _attend(q, k, v, mha.out_proj, scale=1.0).square().sum().backward()
    mha.zero_grad()
    xr = x.clone().requires_grad_()
    mha(xr, xr, xr, need_weights=False)[0].square().sum().backward()
    assert rel_err(xg.grad, xr.grad) <= TOL
    assert rel_err(wg.grad, mha.in_proj_weight.grad) <= TOL


def test_multihead_attention_rejects_separate_kdim():
    mha = torch.nn.MultiheadAttention(8, 2, kdim=6, vdim=6)
    with pytest.raises(ValueError, match="kdim/vdim"):
        headwise.from_multihead_attention(mha)


def _hf_attention(family, bias):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                  intermediate_size=64, num_hidden_layers=1, vocab_size=32, attention_bias=bias,
                  max_position_embeddings=64)
    if family == "llama":
        from transformers.models.llama import modeling_llama as mod

        cfg = transformers.LlamaConfig(**common)
        attn_cls, rope_cls = mod.LlamaAttention, mod.LlamaRotaryEmbedding
    else:
        from transformers.models.qwen3 import modeling_qwen3 as mod

        cfg = transformers.Qwen3Config(**common)
        attn_cls, rope_cls = mod.Qwen3Attention, mod.Qwen3RotaryEmbedding
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    attn = attn_cls(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.normal_(1.0, 0.2)
    return attn, rope_cls(cfg)


@pytest.mark.parametrize("family,bias", [("llama", False), ("llama", True), ("qwen3", False)])
def test_hf_attention_parity(host_backend, family, bias):
    attn, rotary = _hf_attention(family, bias)
    layout, weight, b, norms = headwise.from_hf_attention(attn)
    assert layout == headwise.QKVLayout(6, 2, 16)
    assert (norms is not None) == (family == "qwen3")
    assert (b is not None) == bias
    x = torch.randn(2, 7, 48)
    position_ids = torch.arange(7).unsqueeze(0).expand(2, -1)
    cos, sin = rotary(x, position_ids)
    with torch.no_grad():
        want, _ = attn(x, position_embeddings=(cos, sin), attention_mask=None)
    kw = dict(layout=layout, rope=(cos[0], sin[0]), scale_q=attn.scaling)
    if norms is not None:
        kw.update(q_norm=norms[0], k_norm=norms[1], norm_eps=norms[2])
    with torch.no_grad():
        q, k, v = host_backend.qkv_project(x, weight, b, **kw)
        got = _attend(q, k, v, attn.o_proj, scale=1.0, causal=True)
    assert rel_err(got, want) <= TOL


def test_hf_qwen3_projection_parity_with_grads(host_backend):
    # The projection alone, against the module's own q/k/v path (norm, view, transpose, rope).
    attn, rotary = _hf_attention("qwen3", False)
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    layout, weight, b, (qn, kn, eps) = headwise.from_hf_attention(attn)
    x = torch.randn(2, 5, 48)
    cos, sin = rotary(x, torch.arange(5).unsqueeze(0).expand(2, -1))
    xr = x.clone().requires_grad_()
    shape = (2, 5, -1, 16)
    hq = attn.q_norm(attn.q_proj(xr).view(shape)).transpose(1, 2)
    hk = attn.k_norm(attn.k_proj(xr).view(shape)).transpose(1, 2)
    hv = attn.v_proj(xr).view(shape).transpose(1, 2)
    hq, hk = apply_rotary_pos_emb(hq, hk, cos, sin)
    xg = x.clone().requires_grad_()
    qn_g, kn_g = qn.clone().requires_grad_(), kn.clone().requires_grad_()
    q, k, v = host_backend.qkv_project(xg, weight, b, layout=layout, q_norm=qn_g, k_norm=kn_g, norm_eps=eps,
                                       rope=(cos[0], sin[0]))
    for got, want in ((q, hq), (k, hk), (v, hv)):
        assert rel_err(got, want) <= TOL
    loss = lambda a, b_, c: (a.square().sum() + (b_ * 3).sum() + c.square().sum())  # noqa: E731
    loss(hq, hk, hv).backward()
    loss(q, k, v).backward()
    assert rel_err(xg.grad, xr.grad) <= TOL
    assert rel_err(qn_g.grad, attn.q_norm.weight.grad) <= TOL
    assert rel_err(kn_g.grad, attn.k_norm.weight.grad) <= TOL


@pytest.mark.parametrize("rotary_pct,bias", [(0.25, True), (0.5, False)])
def test_hf_gpt_neox_attention_parity(host_backend, rotary_pct, bias):
    # GPT-NeoX's packed query_key_value (per head: q, k, v rows) is the kv_group layout;
    # its rotary tables cover head_size * rotary_pct dims: partial rotary in the epilogue.
    # Per-row position ids give [B, S, R] tables.
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_neox import modeling_gpt_neox as mod

    cfg = transformers.GPTNeoXConfig(hidden_size=48, num_attention_heads=3, intermediate_size=64,
                                     num_hidden_layers=1, vocab_size=32, max_position_embeddings=64,
                                     rotary_pct=rotary_pct, attention_bias=bias)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(2)
    attn = mod.GPTNeoXAttention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
    layout, weight, b, norms = headwise.from_hf_attention(attn)
    assert layout == headwise.QKVLayout(3, 3, 16, interleave="kv_group") and norms is None
    assert weight.data_ptr() == attn.query_key_value.weight.data_ptr() and (b is not None) == bias
    x = torch.randn(2, 7, 48)
    position_ids = torch.stack([torch.arange(7), (torch.arange(7) - 3).clamp(min=0)])
    cos, sin = mod.GPTNeoXRotaryEmbedding(cfg)(x, position_ids)
    assert cos.shape == (2, 7, int(16 * rotary_pct))
    with torch.no_grad():
        want, _ = attn(x, attention_mask=None, position_embeddings=(cos, sin))
        q, k, v = host_backend.qkv_project(x, weight, b, layout=layout, rope=(cos, sin), scale_q=attn.scaling)
        got = _attend(q, k, v, attn.dense, scale=1.0, causal=True)
    assert rel_err(got, want) <= TOL
