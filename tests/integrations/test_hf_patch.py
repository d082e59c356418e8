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


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("bias", [False, True])
def test_patched_model_matches_the_original(host_backend, kind, impl, bias):
    model = tiny_model(kind, impl, bias)
    with torch.no_grad():  # non-trivial q/k norm weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    logits, grads = loss_and_grads(model, tokens)
    assert patch_hf_attention(model, ops=host_backend) == 2
    patched_logits, patched_grads = loss_and_grads(model, tokens)
    assert rel_err(patched_logits, logits) <= TOL
    assert patched_grads.keys() == grads.keys()
    for name in grads:
        assert rel_err(patched_grads[name], grads[name]) <= TOL, name
    assert unpatch_hf_attention(model) == 2
    assert torch.equal(loss_and_grads(model, tokens)[0], logits)


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
