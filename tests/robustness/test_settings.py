"""Run-time settings (README, "Run-time settings"; csrc/common/env_settings.h): a value the
launchers cannot use is refused with a ValueError naming the variable by the call that reads
it, and an empty value is the default."""

import os
import re
import subprocess
import sys

import pytest
import torch

from headwise import DCMHAWeights
from headwise.bench.checkout import ROOT
from headwise.testing import backend

SIM = backend("sim")


def dynamic_weights(t, h):
    w1, w2 = (0.3 * torch.randn(1, t, 4, 2, h) for _ in range(2))
    return DCMHAWeights(*(x.bfloat16() for x in (w1, w2, 0.3 * torch.randn(1, t, 4, h))))


def dcmha_attention_bf16():
    # 130 rows: three query chunks at HEADWISE_DCMHA_SCRATCH_BYTES=1.
    q, k, v = (torch.randn(1, 2, 130, 16).bfloat16() for _ in range(3))
    return SIM.dcmha_attention(q, k, v, dynamic_weights(130, 2))


def dcmha_compose_backward_bf16():
    a = torch.randn(1, 4, 37, 37).bfloat16().requires_grad_()
    SIM.dcmha_compose(a, dynamic_weights(37, 4), slot="pre").sum().backward()
    return a.grad


def mhar_route(backward, heads=2, dtype=torch.bfloat16):
    # d = 512: heads of 32 vectors (H = 2), or one head of 64, which the staged backward's
    # HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS form takes. fp32 sources take no staged kernel, yet
    # the switches are read for them too.
    sources = torch.randn(3, 1, 5, 512).to(dtype).requires_grad_(backward)
    query, norm_weight = 0.1 * torch.randn(512), torch.ones(512)
    out, _ = torch.ops.headwise_sim.mhar_route(sources, query, norm_weight, heads, 3, 1e-6, None, None)
    if not backward:
        return out
    out.float().sum().backward()
    return sources.grad


def head_merge_bf16():
    z = torch.randn(2, 5, 3, 16).bfloat16()  # [B, Q, H, Dv] memory, read as [B, H, Q, Dv]
    w = torch.randn(24, 48).bfloat16()
    return SIM.head_merge(z.transpose(1, 2), w, None)


CALLS = {
    "dcmha_attention": dcmha_attention_bf16,
    "dcmha_compose_backward": dcmha_compose_backward_bf16,
    "mhar_route": lambda: mhar_route(False),
    "mhar_route_backward": lambda: mhar_route(True),
    "mhar_route_backward_one_head": lambda: mhar_route(True, heads=1),
    "mhar_route_fp32": lambda: mhar_route(False, dtype=torch.float32),
    "mhar_route_backward_fp32": lambda: mhar_route(True, dtype=torch.float32),
    "head_merge": head_merge_bf16,
}

INTEGER = "must be an integer (from|of at least)"
SWITCH = "must be 0 or 1"
BAD = [
    ("HEADWISE_DCMHA_SCRATCH_BYTES", "512MiB", INTEGER, "dcmha_attention"),
    ("HEADWISE_DCMHA_SCRATCH_BYTES", "0", INTEGER, "dcmha_attention"),
    ("HEADWISE_DCMHA_COMPOSE_BWD_ROWS", "3", INTEGER, "dcmha_compose_backward"),
    ("HEADWISE_DCMHA_COMPOSE_BWD_ROWS", " 1", INTEGER, "dcmha_compose_backward"),
    ("HEADWISE_SIM_SMEM_OPTIN", "abc", INTEGER, "dcmha_compose_backward"),
    ("HEADWISE_SIM_SMEM_OPTIN", "240000", INTEGER, "dcmha_compose_backward"),
    ("HEADWISE_MHAR_FWD_STAGED", "false", SWITCH, "mhar_route"),
    ("HEADWISE_MHAR_BWD_STAGED", "10", SWITCH, "mhar_route_backward"),
    ("HEADWISE_MHAR_FWD_STAGED", "off", SWITCH, "mhar_route_fp32"),
    ("HEADWISE_MHAR_BWD_STAGED", "1 ", SWITCH, "mhar_route_backward_fp32"),
    ("HEADWISE_SIM_LIBRARY_GEMM", "yes", SWITCH, "head_merge"),
    ("HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS", "2", SWITCH, "mhar_route_backward_one_head"),
]


@pytest.mark.parametrize("name,value,message,call", BAD, ids=[f"{n}={v!r}" for n, v, _, _ in BAD])
def test_unusable_value_is_refused_with_its_name(monkeypatch, name, value, message, call):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"headwise: {name} {message}.*, got '{re.escape(value)}'"):
        CALLS[call]()


@pytest.mark.parametrize("name,value,call", [
    ("HEADWISE_DCMHA_SCRATCH_BYTES", "1", "dcmha_attention"),
    ("HEADWISE_DCMHA_COMPOSE_BWD_ROWS", "1", "dcmha_compose_backward"),
    ("HEADWISE_SIM_SMEM_OPTIN", "101376", "dcmha_compose_backward"),
    ("HEADWISE_MHAR_FWD_STAGED", "0", "mhar_route"),
    ("HEADWISE_MHAR_BWD_STAGED", "0", "mhar_route_backward"),
    ("HEADWISE_SIM_LIBRARY_GEMM", "1", "head_merge"),
    ("HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS", "1", "mhar_route_backward_one_head"),
])
def test_empty_value_is_the_default_and_a_valid_one_is_taken(monkeypatch, name, value, call):
    torch.manual_seed(0)
    default = CALLS[call]()
    monkeypatch.setenv(name, "")
    torch.manual_seed(0)
    assert torch.equal(CALLS[call](), default)
    monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    torch.testing.assert_close(CALLS[call](), default, rtol=2e-2, atol=2e-2)


def test_poison_switch_is_refused_with_its_name():
    # Read once per process (the first op that allocates an output), so in a child.
    code = "import torch, headwise; torch.ops.headwise.head_merge(torch.ones(1, 1, 1, 2), torch.ones(2, 2), None, None, False, False)"
    env = dict(os.environ, HEADWISE_POISON_OUTPUTS="yes")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "headwise: HEADWISE_POISON_OUTPUTS must be 0 or 1, got 'yes'" in run.stderr, run.stderr[-2000:]


def test_emulator_stack_size_is_refused_with_its_name_until_mended():
    # HW_SIM_STACK_KB (csrc/common/simt/README.md) is read by the first launch that maps a
    # fiber stack and kept once a launch succeeds, so in a child: each bad value is refused
    # by the launch, and the launch after the value is mended runs.
    code = """
import os, torch
from headwise.testing import backend
z, w = torch.ones(1, 1, 1, 2), torch.ones(2, 2)
for bad in ("1M", "63", "1048577", " 256", "+256", "99999999999999999999999"):
    os.environ["HW_SIM_STACK_KB"] = bad
    try:
        backend("sim").head_merge(z, w)
    except RuntimeError as e:
        assert f"headwise sim: HW_SIM_STACK_KB must be an integer from 64 to 1048576 (KiB), got '{bad}'" in str(e), e
    else:
        raise AssertionError(bad)
os.environ["HW_SIM_STACK_KB"] = "64"
assert backend("sim").head_merge(z, w).flatten().tolist() == [2.0, 2.0]
print("mended")
"""
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "mended", run.stderr[-2000:]


def test_every_setting_is_read_by_the_validated_reader_and_listed_in_the_readme():
    # The op libraries read the environment only in env_settings.h (the emulator's runtime,
    # which does not link c10, reads its own HW_SIM_STACK_KB), and each HEADWISE_ variable
    # named in csrc/ is a row of the README's table.
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in {".h", ".cuh", ".cpp", ".cu"}]
    assert sources
    readers = {p.relative_to(ROOT).as_posix() for p in sources if re.search(r"\bgetenv\(", p.read_text())}
    assert readers == {"csrc/common/env_settings.h", "csrc/common/simt/simt_runtime.cpp"}, readers
    names = {m for p in sources for m in re.findall(r'"(HEADWISE_[A-Z0-9_]+)"', p.read_text())}
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Run-time settings"):readme.index("## Running on a GPU machine")]
    listed = set(re.findall(r"^\| `(HEADWISE_[A-Z0-9_]+)` \|", table, flags=re.M))
    assert names == listed, (names - listed, listed - names)
