"""Small CUDA cases for compute-sanitizer (bench/device_check.sh): every kernel layout of
every op, forward and backward, on shapes small enough for memcheck/racecheck."""

import os

import torch

import headwise

# (N, B, T, d, H) covering vec8 segment / warps / generic and the scalar paths; 16-bit
# sources run the staged kernels where they apply (heads within a warp: the first and
# last two cases, the last with 1030 positions over 1024 blocks and a partial second
# warp) and the others (HEADWISE_MHAR_FWD_STAGED=0, HEADWISE_MHAR_BWD_STAGED=0).
MHAR_CASES = [(3, 2, 5, 96, 3), (5, 1, 7, 123, 3), (4, 1, 3, 2048, 2), (2, 3, 1, 96, 4), (7, 1, 5, 20, 5),
              (9, 1, 3, 1024, 2), (3, 1, 1030, 576, 9)]
# (layout, B, S, D_model, rope): every item width (1, 2, 4) of the QKV epilogue kernels.
QKV_CASES = [
    (headwise.QKVLayout(2, 2, 3, 2), 2, 3, 6, False),
    (headwise.QKVLayout(6, 3, 16, 12, interleave="kv_group"), 1, 37, 37, True),
    (headwise.QKVLayout(3, 3, 96, 80), 1, 5, 37, True),
    (headwise.QKVLayout(2, 1, 256, 131), 1, 3, 37, True),
]

# (B, H, Q, Dv, D) for head_merge; B = 133: the batch-row order of a [B, H] gate (bf16).
MERGE_CASES = [(2, 3, 37, 8, 70), (1, 5, 3, 67, 9), (2, 2, 33, 64, 65), (133, 2, 1, 8, 16)]
# (B, H, T, dh, head_groups, window) for dcmha_attention: one and several query tiles,
# dh not a multiple of 16, head groups, a window.
DCMHA_CASES = [(1, 4, 37, 16, 1, None), (2, 4, 70, 24, 2, None), (1, 3, 65, 64, 1, 17)]


def main():
    torch.manual_seed(0)
    for n, b, t, d, h in MHAR_CASES:
        for dtype, staged in ((torch.float32, "1"), (torch.bfloat16, "1"), (torch.bfloat16, "0")):
            os.environ["HEADWISE_MHAR_FWD_STAGED"] = os.environ["HEADWISE_MHAR_BWD_STAGED"] = staged
            sources = torch.randn(n, b, t, d, device="cuda", dtype=dtype, requires_grad=True)
            query = torch.randn(d, device="cuda", requires_grad=True)
            norm_weight = torch.ones(d, device="cuda", requires_grad=True)
            out = headwise.mhar_route(sources, query, norm_weight, num_heads=h)
            # Delta mode: residual added in the kernel, gated mix, gate gradient.
            residual = torch.randn(b, t, d, device="cuda", dtype=dtype)
            gate = torch.tensor(0.5, device="cuda", requires_grad=True)
            delta = headwise.mhar_route(sources, query, norm_weight, num_heads=h, residual=residual, gate=gate)
            out.float().sum().backward()
            delta.float().sum().backward()
    os.environ.pop("HEADWISE_MHAR_FWD_STAGED")
    os.environ.pop("HEADWISE_MHAR_BWD_STAGED")
    for layout, b, s, dm, rope in QKV_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(b, s, dm, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(layout.num_rows, dm, device="cuda", dtype=dtype, requires_grad=True)
            bias = torch.randn(layout.num_rows, device="cuda", dtype=dtype, requires_grad=True)
            qn = torch.ones(layout.head_dim, device="cuda", requires_grad=True)
            kn = torch.ones(layout.head_dim, device="cuda", requires_grad=True)
            tables = None
            if rope:
                ang = torch.randn(s, layout.head_dim // 2, device="cuda").repeat(1, 2)
                tables = (ang.cos(), ang.sin())
            q, k, v = headwise.qkv_project(x, w, bias, layout=layout, q_norm=qn, k_norm=kn, rope=tables, scale_q=0.5)
            (q.float().sum() + k.float().square().sum() + v.float().sum()).backward()
    # Head merge: odd shapes beyond one tile, both z layouts, gates (closed heads skipped,
    # gate gradient through closed heads), rescale, stats.
    def merge(b, h, q, dv, d, dtype):
        z = torch.randn(b, q, h, dv, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        w = torch.randn(d, h * dv, device="cuda", dtype=dtype, requires_grad=True)
        bias = torch.randn(d, device="cuda", dtype=dtype, requires_grad=True)
        gate = torch.rand(b, h, device="cuda")
        gate[0, 0] = 0
        gate.requires_grad_()
        out, _ = headwise.head_merge(z, w, bias, head_gate=gate, rescale=True, return_stats=True)
        out.float().sum().backward()
        out = headwise.head_merge(torch.randn(b, h, q, dv, device="cuda", dtype=dtype), w, None,
                                  head_gate=(gate.detach() > 0.5).float())

    for case in MERGE_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            merge(*case, dtype)
    # The B = 133 order again as 32-row chunks sorted apart and ranked across (the sort
    # kernel's multi-chunk path and the rank kernel).
    os.environ["HEADWISE_MERGE_ROW_SORT_CHUNK"] = "32"
    merge(*MERGE_CASES[-1], torch.bfloat16)
    del os.environ["HEADWISE_MERGE_ROW_SORT_CHUNK"]

    def dcmha(b, h, t, dh, groups, window, dtype):
        q, k, v = (torch.randn(b, h, t, dh, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        w1 = torch.randn(b, t, 4, 2, h, device="cuda", dtype=dtype, requires_grad=True)
        w2 = (0.1 * torch.randn(b, t, 4, 2, h, device="cuda", dtype=dtype)).requires_grad_()
        g = (0.1 * torch.randn(b, t, 4, h, device="cuda", dtype=dtype)).requires_grad_()
        out = headwise.dcmha_attention(q, k, v, headwise.DCMHAWeights(w1, w2, g), window=window, head_groups=groups)
        out.float().sum().backward()

    for case in DCMHA_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            dcmha(*case, dtype)
    # 64-row query chunks (a 1-byte scratch cap): the tensor-core kernels' chunk loops, and
    # the backward's fp32 dk / dv / key-grad sums over chunks.
    os.environ["HEADWISE_DCMHA_SCRATCH_BYTES"] = "1"
    dcmha(1, 2, 150, 16, 1, 90, torch.bfloat16)
    del os.environ["HEADWISE_DCMHA_SCRATCH_BYTES"]
    torch.cuda.synchronize()
    print("sanitize_cases: ok")


if __name__ == "__main__":
    main()
