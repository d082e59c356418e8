"""headwise.integrations: tiny random Hugging Face Llama / Qwen3 models (built from
configs, nothing downloaded) patched to run attention through qkv_project + head_merge
give the unpatched model's logits and parameter gradients."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise.integrations import patch_hf_attention, unpatch_hf_attention  # noqa: E402
from headwise.testing import rel_err  # noqa: E402

TOL = 2e-5


def tiny_model(kind, attn_implementation, bias=False):
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attn_implementation=attn_implementation, attention_bias=bias)
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=12, **common)).eval()


def loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=tokens, labels=tokens, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_patch_matches_the_original(model, ops):
    """Patching model's two layers keeps its logits and gradients on a fixed batch (within
    TOL); unpatching restores its logits bitwise."""
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    logits, grads = loss_and_grads(model, tokens)
    assert patch_hf_attention(model, ops=ops) == 2
    patched_logits, patched_grads = loss_and_grads(model, tokens)
    assert rel_err(patched_logits, logits) <= TOL
    assert patched_grads.keys() == grads.keys()
    for name in grads:
        assert rel_err(patched_grads[name], grads[name]) <= TOL, name
    assert unpatch_hf_attention(model) == 2
    assert torch.equal(loss_and_grads(model, tokens)[0], logits)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("bias", [False, True])
def test_patched_model_matches_the_original(host_backend, kind, impl, bias):
    model = tiny_model(kind, impl, bias)
    with torch.no_grad():  # non-trivial q/k norm weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    assert_patch_matches_the_original(model, host_backend)


def test_patched_model_generates_with_a_cache():
    model = tiny_model("qwen3", "sdpa")
    tokens = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(tokens, max_new_tokens=6, do_sample=False)
        patch_hf_attention(model)
        got = model.generate(tokens, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_patched_model_under_autocast_bf16():
    # The projections follow nn.Linear's autocast policy, so the patched model runs the
    # same bf16 GEMMs as the original; the two differ only by bf16 rounding points.
    model = tiny_model("qwen3", "sdpa")
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = loss_and_grads(model, tokens)
        patch_hf_attention(model)
        got, grads = loss_and_grads(model, tokens)
    assert got.dtype == want.dtype
    assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()
    assert all(torch.isfinite(g).all() for g in grads.values())


def left_padded_batch(vocab, lengths, total, seed):
    """Token ids [B, total] and an attention mask, row i left-padded to `total` from
    lengths[i] real tokens (pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), total, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, total - n:] = torch.randint(1, vocab, (n,), generator=gen)
        mask[i, total - n:] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["llama", "qwen3", "neox"])
def test_left_padded_batched_generation(host_backend, kind):
    # Per-row position ids (HF derives them from the left-padded mask): [B, S, R] rotary
    # tables reach qkv_project, and the patched model generates the unpatched tokens.
    model = tiny_model(kind, "sdpa") if kind != "neox" else tiny_neox("sdpa")
    ids, mask = left_padded_batch(97, [7, 4, 2], 7, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        assert patch_hf_attention(model, ops=host_backend) == 2
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "neox"])
def test_per_row_position_ids_parity(host_backend, kind):
    # Packed documents: each row restarts its positions at a different token.
    model = tiny_model(kind, "eager") if kind != "neox" else tiny_neox("eager")
    tokens = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(5))
    position_ids = torch.stack([torch.arange(9), torch.arange(9) % 4, (torch.arange(9) - 5).clamp(min=0)])

    def loss_and_grads_at(model):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, position_ids=position_ids, labels=tokens, use_cache=False)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits, grads = loss_and_grads_at(model)
    patch_hf_attention(model, ops=host_backend)
    got, got_grads = loss_and_grads_at(model)
    assert rel_err(got, logits) <= TOL
    assert got_grads.keys() == grads.keys()
    for name in grads:
        assert rel_err(got_grads[name], grads[name]) <= TOL, name


def tiny_neox(attn_implementation, rotary_pct=0.25, bias=True):
    # head_size 16, rotary_pct 0.25: 4 rotated dims per head (partial rotary).
    cfg = transformers.GPTNeoXConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64, rotary_pct=rotary_pct,
                                     attention_bias=bias, attn_implementation=attn_implementation)
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initializes biases to 0 and weights small: make them count
        for name, p in model.named_parameters():
            if "attention" in name:
                p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("rotary_pct,bias", [(0.25, True), (0.5, False), (1.0, True)])
def test_patched_neox_matches_the_original(host_backend, impl, rotary_pct, bias):
    model = tiny_neox(impl, rotary_pct, bias)
    assert model.gpt_neox.layers[0].attention.rotary_ndims == int(16 * rotary_pct)
    assert_patch_matches_the_original(model, host_backend)
