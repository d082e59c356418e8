"""Lane-by-lane tests of the GPU primitives of csrc/common/mma_primitives.cuh (mma.sync,
ldmatrix, cp.async), cluster.cuh and warp_octets.cuh (kernels in
csrc/common/simt/primitive_selftest.cuh). Each lane's registers are built here from the
PTX ISA's fragment maps (written out below, independently of the emulator's code) and
each lane's results are checked against the same maps. The tests run on the emulator
("sim") and, on a machine with a GPU, on the hardware ("cuda"), where they check the maps
against real tensor cores. The faulty uses must fail with an error naming the instruction
(emulator only)."""

import re
import time

import pytest
import torch

import headwise  # noqa: F401  (loads headwise._sim, which registers headwise_simtest)

from test_simt_emulator import FAST_S, check_emulator_still_works, first_line

ops = torch.ops.headwise_simtest
BF16, F16, TF32, BF16_K8 = 0, 1, 2, 3
POISON = -1  # 0xFFFFFFFF: a shared word a cp.async has not written yet (emulator)


@pytest.fixture(params=["sim", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return "cpu" if request.param == "sim" else "cuda"


# ---------------------------------------------------------------------------
# PTX ISA fragment maps (groupID g = lane >> 2, threadID_in_group t = lane % 4)
# ---------------------------------------------------------------------------
def mma_a_position(kind, lane, i):
    """(row, col) of element i of lane's A fragment. m16n8k16 .bf16/.f16: elements
    a0..a7, two per register (a0 in the low half of reg 0); m16n8k8 .tf32: a0..a3, one per
    register; m16n8k8 .bf16: a0..a3, two per register."""
    g, t = lane >> 2, lane % 4
    if kind == TF32:
        return (g + 8 * (i % 2), t + 4 * (i // 2))
    if kind == BF16_K8:
        return (g + 8 * (i // 2), 2 * t + (i & 1))
    row = g if (i < 2 or 4 <= i < 6) else g + 8
    col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def mma_b_position(kind, lane, i):
    """(row k, col n) of element i of lane's B fragment (b0..b3 for 16-bit types at k = 16,
    b0, b1 for tf32 and for bf16 at k = 8)."""
    g, t = lane >> 2, lane % 4
    if kind == TF32:
        return (t + 4 * i, g)
    if kind == BF16_K8:
        return (2 * t + i, g)
    return (2 * t + (i & 1) + (8 if i >= 2 else 0), g)


def mma_c_position(lane, i):
    """(row, col) of accumulator element c_i / d_i of lane (fp32, four per lane)."""
    g, t = lane >> 2, lane % 4
    return (g + 8 * (i // 2), 2 * t + (i % 2))


def bits16(x, dtype):
    return x.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF


def pack_pairs(halves):
    """[32, 2n] 16-bit patterns -> [32, n] int32 registers, even element in the low half."""
    words = halves[:, 0::2] | (halves[:, 1::2] << 16)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def mma_registers(kind, a, b, c):
    """Per-lane registers of A [16, K], B [K, 8] and C [16, 8] by the maps above (bf16 at
    k = 8 fills registers 0, 1 of A and 0 of B; the rest are zero)."""
    n_a, n_b = (4, 2) if kind in (TF32, BF16_K8) else (8, 4)
    a_el = torch.stack([torch.stack([a[mma_a_position(kind, l, i)] for i in range(n_a)]) for l in range(32)])
    b_el = torch.stack([torch.stack([b[mma_b_position(kind, l, i)] for i in range(n_b)]) for l in range(32)])
    c_regs = torch.stack([torch.stack([c[mma_c_position(l, i)] for i in range(4)]) for l in range(32)])
    if kind == TF32:
        return a_el.view(torch.int32), b_el.view(torch.int32), c_regs
    dtype = torch.float16 if kind == F16 else torch.bfloat16
    a_regs, b_regs = pack_pairs(bits16(a_el, dtype)), pack_pairs(bits16(b_el, dtype))
    if kind == BF16_K8:
        a_regs = torch.cat([a_regs, torch.zeros(32, 2, dtype=torch.int32)], dim=1)
        b_regs = torch.cat([b_regs, torch.zeros(32, 1, dtype=torch.int32)], dim=1)
    return a_regs, b_regs, c_regs


def small_ints(*shape, seed, lo=-6, hi=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, shape, generator=g).to(torch.float32)


@pytest.mark.parametrize("kind", [BF16, F16, TF32, BF16_K8], ids=["bf16", "f16", "tf32", "bf16-k8"])
def test_mma_lanes_follow_the_ptx_fragment_maps(device, kind):
    k = 8 if kind in (TF32, BF16_K8) else 16
    for seed in range(3):
        # Small integers: every product and sum is exact in fp32 on any hardware, so each
        # lane's four results must equal D at the map's positions exactly.
        a, b, c = small_ints(16, k, seed=seed), small_ints(k, 8, seed=seed + 10), small_ints(16, 8, seed=seed + 20)
        a_regs, b_regs, c_regs = mma_registers(kind, a, b, c)
        d = ops.mma_lanes(a_regs.to(device), b_regs.to(device), c_regs.to(device), kind).cpu()
        expected = a @ b + c
        for lane in range(32):
            for i in range(4):
                assert d[lane, i].item() == expected[mma_c_position(lane, i)].item(), (lane, i)


@pytest.mark.parametrize("kind", [BF16, F16, TF32, BF16_K8], ids=["bf16", "f16", "tf32", "bf16-k8"])
def test_mma_lanes_single_element_probes(device, kind):
    """A one-hot A and B: exactly one lane's one register is nonzero in D, so a swapped
    register or lane shows up as the wrong lane, not just a wrong sum."""
    k = 8 if kind in (TF32, BF16_K8) else 16
    for row, kk, col in [(0, 0, 0), (9, k - 1, 5), (15, 3, 7), (4, k // 2 + 1, 2)]:
        a = torch.zeros(16, k)
        b = torch.zeros(k, 8)
        a[row, kk] = 3.0
        b[kk, col] = 5.0
        a_regs, b_regs, c_regs = mma_registers(kind, a, b, torch.zeros(16, 8))
        d = ops.mma_lanes(a_regs.to(device), b_regs.to(device), c_regs.to(device), kind).cpu()
        hits = [(lane, i) for lane in range(32) for i in range(4) if d[lane, i] != 0]
        want = [(lane, i) for lane in range(32) for i in range(4) if mma_c_position(lane, i) == (row, col)]
        assert hits == want and d[want[0]].item() == 15.0


def test_mma_tf32_operands_are_truncated_not_rounded():
    """Emulator's documented choice (hardware ignores the low 13 mantissa bits of a tf32
    operand): 1 + 2^-10 + 2^-11 + 2^-12 reads as 1 + 2^-10 (rounding would give 1 + 2^-9)."""
    x = 1.0 + 2**-10 + 2**-11 + 2**-12
    a = torch.zeros(16, 8)
    b = torch.zeros(8, 8)
    a[0, 0] = x
    b[0, 0] = 1.0
    a_regs, b_regs, c_regs = mma_registers(TF32, a, b, torch.zeros(16, 8))
    d = ops.mma_lanes(a_regs, b_regs, c_regs, TF32)
    assert d[0, 0].item() == 1.0 + 2**-10


def test_mma_bf16_accumulates_in_fp32():
    """bf16 inputs whose products and sums need fp32: 1 + 2^-8 products summed over k."""
    a = torch.full((16, 16), 1.0 + 2**-7)  # exact in bf16
    b = torch.full((16, 8), 1.0 + 2**-7)
    c = torch.full((16, 8), 2**-20)
    a_regs, b_regs, c_regs = mma_registers(BF16, a, b, c)
    d = ops.mma_lanes(a_regs, b_regs, c_regs, BF16)
    expected = c[0, 0].item()
    for _ in range(16):
        expected = torch.tensor(expected + (1.0 + 2**-7) ** 2, dtype=torch.float32).item()
    assert torch.all(d == expected)


# ---------------------------------------------------------------------------
# ldmatrix
# ---------------------------------------------------------------------------
def ldmatrix_model(image, row_offsets, num, trans):
    """Per PTX: lane 8i + r gives the address of row r of matrix i; lane l receives, per
    matrix i, row l // 4 elements 2 (l % 4) and +1 (.trans: the stored matrix's elements
    [2 (l % 4)][l // 4] and [2 (l % 4) + 1][l // 4]), low element in the low half."""
    out = torch.zeros(32, num, dtype=torch.int64)
    for i in range(num):
        m = torch.stack([image[row_offsets[8 * i + r] : row_offsets[8 * i + r] + 8] for r in range(8)])
        m = m.to(torch.int64) & 0xFFFF
        if trans:
            m = m.t()
        for lane in range(32):
            g, t = lane // 4, lane % 4
            out[lane, i] = m[g, 2 * t] | (m[g, 2 * t + 1] << 16)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True], ids=["rows", "trans"])
def test_ldmatrix_lanes_follow_the_ptx_map(device, num, trans):
    g = torch.Generator().manual_seed(num * 2 + trans)
    image = torch.randint(-(2**15), 2**15, (1024,), generator=g, dtype=torch.int32).to(torch.int16)
    for seed in range(3):
        # Rows at scattered 16-byte aligned places (8 elements each), distinct per lane;
        # lanes beyond 8 * num give addresses the instruction must ignore.
        perm = torch.randperm(128, generator=torch.Generator().manual_seed(seed))[:32]
        offsets = (perm * 8).to(torch.int32)
        out = ops.ldmatrix_lanes(image.to(device), offsets.to(device), num, trans).cpu()
        assert torch.equal(out, ldmatrix_model(image, offsets.tolist(), num, trans))


def test_ldmatrix_ignores_addresses_beyond_the_used_lanes():
    image = torch.arange(256, dtype=torch.int16)
    offsets = torch.arange(32, dtype=torch.int32) * 8
    bad = offsets.clone()
    bad[8:] = 3  # misaligned, but .x1 reads only lanes 0..7's addresses
    assert torch.equal(ops.ldmatrix_lanes(image, bad, 1), ops.ldmatrix_lanes(image, offsets, 1))


# ---------------------------------------------------------------------------
# cp.async
# ---------------------------------------------------------------------------
COPY_CASES = [(4, False), (8, False), (16, False), (16, True)]


@pytest.mark.parametrize("copy_bytes, cache_global", COPY_CASES, ids=["ca4", "ca8", "ca16", "cg16"])
def test_cp_async_groups_and_zero_fill(device, copy_bytes, cache_global):
    copies = 70  # more copies than threads: each thread issues one or two per group
    words = copies * copy_bytes // 4
    src = torch.arange(1, words + 1, dtype=torch.int32) * 7919
    g = torch.Generator().manual_seed(copy_bytes)
    src_bytes = torch.randint(0, copy_bytes // 4 + 1, (copies,), generator=g, dtype=torch.int32) * 4
    src_bytes[:3] = torch.tensor([copy_bytes, 0, copy_bytes])
    out = ops.cp_async_roundtrip(src.to(device), copy_bytes, cache_global, src_bytes.to(device)).cpu()
    per_copy = copy_bytes // 4
    word_of_copy = torch.arange(words) // per_copy
    in_src = (torch.arange(words) % per_copy) * 4 < src_bytes[word_of_copy]
    expected = torch.where(in_src, src, torch.zeros_like(src))  # src-size bytes, then zeros
    group0 = word_of_copy < copies // 2
    assert torch.equal(out[1], expected)
    assert torch.equal(out[0][group0], expected[group0])  # wait_group 1 retired group 0
    if device == "cpu":  # the emulator lands copies exactly at the wait: group 1 is poison
        assert torch.all(out[0][~group0] == POISON)


@pytest.mark.parametrize("copy_bytes, cache_global", COPY_CASES, ids=["ca4", "ca8", "ca16", "cg16"])
def test_cp_async_read_without_wait_sees_poison(copy_bytes, cache_global):
    """A kernel that reads its cp.async destination after __syncthreads but without any
    cp.async.wait reads the 0xFF poison (emulator); after wait_all it reads the data."""
    copies = 64
    src = torch.arange(copies * copy_bytes // 4, dtype=torch.int32) + 1
    src_bytes = torch.full((copies,), copy_bytes, dtype=torch.int32)
    out = ops.cp_async_roundtrip(src, copy_bytes, cache_global, src_bytes, skip_wait=True)
    assert torch.all(out[0] == POISON)
    assert torch.equal(out[1], src)


@pytest.mark.parametrize("sync", [1, 2], ids=["syncwarp", "syncthreads"])
def test_cp_async_then_ldmatrix_after_wait_and_sync(device, sync):
    """cp.async rows, wait, __syncwarp or __syncthreads, ldmatrix: the data the other lanes
    copied (without the sync the emulator raises: faulty case 18)."""
    src = torch.randint(-(2**31), 2**31 - 1, (128,), dtype=torch.int32)
    out = ops.cp_async_ldmatrix(src.to(device), sync).cpu()
    image = src.view(torch.int16)  # 32 rows of 8 b16 elements
    assert torch.equal(out, ldmatrix_model(image, [8 * l for l in range(32)], 4, False))


# ---------------------------------------------------------------------------
# Thread block clusters
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("blocks, cluster_x", [(1, 1), (6, 2), (8, 4), (16, 8), (3, 3)])
def test_cluster_rank_barrier_and_distributed_shared_memory(device, blocks, cluster_x):
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread block clusters need sm_90")
    out = ops.cluster_exchange(torch.empty(0, device=device), blocks, cluster_x).cpu()
    i = torch.arange(64)
    for b in range(blocks):
        rank = b % cluster_x
        base = b - rank
        nxt, prev = base + (rank + 1) % cluster_x, base + (rank - 1) % cluster_x
        assert torch.all(out[b, 0] == rank) and torch.all(out[b, 1] == cluster_x), b
        assert torch.equal(out[b, 2], 1000 * nxt + i), b  # read from the next CTA's shared memory
        assert torch.equal(out[b, 3], 1000 * prev + 500 + i), b  # written by the previous CTA


# ---------------------------------------------------------------------------
# Octets moved by coalesced 16-byte accesses (csrc/common/warp_octets.cuh)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("lanes", [-1, 0, 1, 15, 16, 17, 31, 32, 40, 47, 63, 64, 70])
def test_warp_octets_move_each_lanes_eight_floats(device, lanes):
    """hw::warp_load_octets hands thread t floats [8t, 8t + 8) of x (zeros for t >= lanes),
    and hw::warp_store_octets writes them back there (nothing for t >= lanes); two warps,
    each with its own 256-float span and lanes - 32 w owned lanes. On a GPU the store takes
    its lane from %laneid."""
    x = torch.randn(512, generator=torch.Generator().manual_seed(7))
    loaded, stored = (t.cpu() for t in ops.warp_octets(x.to(device), lanes))
    owned = max(0, min(lanes, 64))
    want = x.view(64, 8).clone()
    want[owned:] = 0
    assert torch.equal(loaded, want)
    assert torch.equal(stored[:8 * owned], x[:8 * owned])
    assert torch.isnan(stored[8 * owned:]).all()


def test_warp_octets_rejects_a_misaligned_span(device):
    x = torch.zeros(513, device=device)[1:]  # contiguous, 4 bytes past a 16-byte boundary
    with pytest.raises(RuntimeError, match="x must be 16-byte aligned"):
        ops.warp_octets(x, 32)


# ---------------------------------------------------------------------------
# Faulty uses (emulator): named errors instead of undefined behaviour
# ---------------------------------------------------------------------------
PRIMITIVE_FAULTS = [
    pytest.param(
        14,
        r"headwise sim: kernel 'cp_async_misaligned' block \(0,0,0\) thread \(3,0,0\): cp\.async\.cg\.shared\.global "
        r"of 16 bytes: the shared destination is not aligned to cp-size \(dst 0x[0-9a-f]+, src 0x[0-9a-f]+\)$",
        id="cp-async-misaligned",
    ),
    pytest.param(
        15,
        r"thread \(0,0,0\): cp\.async\.ca\.shared\.global of 8 bytes: the destination is not in the block's dynamic "
        r"shared memory",
        id="cp-async-to-global",
    ),
    pytest.param(
        16,
        r"ldmatrix\.sync\.aligned\.m8n8\.x2\.shared\.b16: row address \(lane 9, row 1 of matrix 1\) is not "
        r"16-byte aligned$",
        id="ldmatrix-misaligned",
    ),
    pytest.param(
        17,
        r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16 reads shared byte offset 0, the destination of thread 0's "
        r"cp\.async that no cp\.async\.wait_group/wait_all has retired \(it reads as poison\)$",
        id="ldmatrix-before-cp-async-wait",
    ),
    pytest.param(
        18,
        r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16 reads shared byte offset 0, written by thread 0's cp\.async, "
        r"which landed at that thread's cp\.async\.wait but no __syncthreads has made it visible",
        id="ldmatrix-without-barrier-after-wait",
    ),
    pytest.param(
        19,
        r"kernel 'mma_misuse' block \(0,0,0\) thread \(32,0,0\): mma\.sync\.aligned\.m16n8k16\S* needs a full warp of 32 threads, "
        r"but warp 1 of this 48-thread block has 16$",
        id="mma-partial-warp",
    ),
    pytest.param(
        20,
        r"kernel 'mma_misuse' block \(0,0,0\): deadlock \(no thread can make progress\): warp 0: "
        r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\(mask=0xffffffff\) reached by 31 of 32 lanes; lane 31 \(thread 31\) exited",
        id="mma-lane-exited",
    ),
    pytest.param(
        21,
        r"divergent warp collective in warp 0 \(mask=0xffffffff\): lanes 0\.\.15 at "
        r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32; "
        r"lanes 16\.\.31 at mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32$",
        id="mma-divergent-shapes",
    ),
    pytest.param(
        22,
        r"ldmatrix\.sync\.aligned\.m8n8\.x1\.shared\.b16: row address \(lane 5, row 5 of matrix 0\) is not inside "
        r"the block's dynamic shared memory",
        id="ldmatrix-global-address",
    ),
    pytest.param(
        23,
        r"headwise sim: kernel 'cluster_barrier_early_exit' cluster of blocks \(0,0,0\)\.\.\(1,0,0\): deadlock "
        r"\(no thread can make progress\): barrier\.cluster reached by 64 of 128 threads of 2 CTAs; "
        r"CTA rank 1 \(block \(1,0,0\)\): threads 0\.\.63 exited without reaching it$",
        id="cluster-barrier-missing-cta",
    ),
    pytest.param(
        24,
        r"kernel 'cluster_bad_rank' block \(0,0,0\) thread \(0,0,0\): mapa \(cluster_map_shared\): rank 2 is not "
        r"in this cluster of 2 CTAs$",
        id="cluster-map-bad-rank",
    ),
    pytest.param(
        25,
        r"kernel 'cluster_grid_mismatch': invalid launch configuration: grid \(3,1,1\), block \(32,1,1\), "
        r"cluster \(2,1,1\), 0 bytes dynamic shared memory: grid is not a multiple of the cluster$",
        id="cluster-grid-mismatch",
    ),
]


@pytest.mark.parametrize("which, message", PRIMITIVE_FAULTS)
def test_faulty_primitive_use_fails_with_a_named_error(which, message):
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            ops.faulty_kernel(which)
        assert time.monotonic() - start < FAST_S
        assert re.search(message, first_line(info)), first_line(info)
        check_emulator_still_works()
