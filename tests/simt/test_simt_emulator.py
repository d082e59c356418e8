"""Self-tests of the SIMT emulator (csrc/common/simt): the CUDA kernels of
csrc/common/simt/simt_selftest.cpp, registered as torch.ops.headwise_simtest, checked
against pure-Python models of the CUDA semantics. The faulty kernels must fail fast with
a RuntimeError naming the kernel, the block and what was waited on, and the emulator
must keep working after every failure."""

import faulthandler
import itertools
import random
import re
import time

import pytest
import torch

import headwise  # noqa: F401  (loads headwise._sim, which registers headwise_simtest)

ops = torch.ops.headwise_simtest

FULL = 0xFFFFFFFF
IDX, UP, DOWN, XOR = 0, 1, 2, 3
# A faulty launch must fail within this many seconds (they take milliseconds).
FAST_S = 5.0


@pytest.fixture(autouse=True)
def hang_guard(request):
    """A kernel that hangs would hold the GIL forever: faulthandler's watchdog thread
    still fires, prints every thread's stack and ends the test process."""
    try:
        pytest_timeout = float(request.config.getini("faulthandler_timeout") or 0)
    except ValueError:  # pytest's faulthandler plugin is disabled
        pytest_timeout = 0.0
    if pytest_timeout > 0:
        yield  # pytest's own faulthandler timeout is armed
        return
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------------------
# Pure-Python models of CUDA semantics
# ---------------------------------------------------------------------------
def shfl_model(x, kind, arg, width, mask=FULL):
    """Result of each thread of one block calling the shuffle `kind` (threads whose
    lane is outside `mask` do not call it and keep their value). Per the CUDA
    programming guide: lanes form segments of `width`; __shfl_sync reads lane
    srcLane % width of the segment; up/down read lane -/+ delta, keeping the own
    value when that leaves the segment; xor reads lane ^ laneMask, keeping the own
    value only when that lies in a later segment. Only the low 5 bits of the lane
    argument count (PTX shfl.sync). Reading a lane that does not exist (partial warp)
    or does not take part is undefined on hardware; the emulator returns all-ones
    bytes (-1)."""
    n = len(x)
    out = list(x)
    for t in range(n):
        lane, base = t % 32, t - t % 32
        if not (mask >> lane) & 1:
            continue
        lanes = min(32, n - base)
        seg = lane - lane % width
        if kind == IDX:
            src = seg + arg % width
        elif kind == UP:
            src = lane - (arg & 31)
            src = src if src >= seg else lane
        elif kind == DOWN:
            src = lane + (arg & 31)
            src = src if src < seg + width else lane
        else:
            src = lane ^ (arg & 31)
            src = src if src < seg + width else lane
        out[t] = x[base + src] if src < lanes and (mask >> src) & 1 else -1
    return out


def vote_model(pred, mask):
    """(all, any, ballot) per thread; -1s for lanes outside the mask. Lanes of the mask
    beyond a partial last warp do not exist and do not count."""
    n = len(pred)
    out = []
    for t in range(n):
        lane, base = t % 32, t - t % 32
        if not (mask >> lane) & 1:
            out.append([-1, -1, -1])
            continue
        group = [l for l in range(min(32, n - base)) if (mask >> l) & 1]
        ballot = sum(1 << l for l in group if pred[base + l] != 0)
        full = sum(1 << l for l in group)
        out.append([int(ballot == full), int(ballot != 0), ballot])
    return out


def check_emulator_still_works():
    x = torch.arange(96, dtype=torch.float32).view(3, 32)
    assert torch.equal(ops.block_sum(x, 64), x.sum(1))
    v = torch.arange(32, dtype=torch.int32)
    assert ops.warp_shuffle(v, XOR, 1, 32).tolist() == shfl_model(v.tolist(), XOR, 1, 32)


def int_valued(*shape, lo=-8, hi=8, seed=0):
    """Floats with small integer values: every sum below is exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, shape, generator=g).to(torch.float32)


# ---------------------------------------------------------------------------
# Block-level: __syncthreads, shared memory, built-in index variables
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3, 5, 31, 32, 33, 64, 100, 256, 1000, 1024])
def test_block_sum_shared_memory_tree(threads):
    for rows, n in [(1, 1), (7, threads), (64, 3 * threads + 5), (3, 2500)]:
        x = int_valued(rows, n, seed=threads + n)
        assert torch.equal(ops.block_sum(x, threads, 0), x.sum(1)), (rows, n)


@pytest.mark.parametrize("threads", [32, 64, 96, 256, 1024])
def test_block_sum_warp_shuffles(threads):
    for rows, n in [(1, 1), (5, threads - 3), (64, 2 * threads + 7)]:
        x = int_valued(rows, n, seed=threads * 7 + n)
        assert torch.equal(ops.block_sum(x, threads, 1), x.sum(1)), (rows, n)


def test_block_sum_rejects_bad_arguments():
    x = torch.ones(2, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.block_sum(x, 48, 1)
    with pytest.raises(RuntimeError, match=r"threads must be in \[1, 1024\]"):
        ops.block_sum(x, 0)


@pytest.mark.parametrize("threads", [1, 31, 64, 333, 1024])
def test_syncthreads_count_and_or(threads):
    g = torch.Generator().manual_seed(threads)
    rows = [
        torch.zeros(threads, dtype=torch.int32),
        torch.full((threads,), -3, dtype=torch.int32),  # any nonzero value is true
        torch.zeros(threads, dtype=torch.int32).index_fill_(0, torch.tensor([threads - 1]), 2),
        torch.randint(0, 2, (threads,), generator=g, dtype=torch.int32),
        torch.randint(-1, 2, (threads,), generator=g, dtype=torch.int32),
    ]
    pred = torch.stack(rows * 8)  # 40 blocks: they run in parallel on the OS threads
    out = ops.block_vote(pred)
    count = (pred != 0).sum(1, dtype=torch.int32)
    expected = torch.stack([count, (count == threads).int(), (count > 0).int()], 1)
    assert torch.equal(out, expected.unsqueeze(1).expand(-1, threads, -1))


@pytest.mark.parametrize(
    "grid, block",
    [((1, 1, 1), (1, 1, 1)), ((3, 2, 2), (5, 3, 2)), ((2, 3, 1), (32, 1, 2)), ((1, 1, 2), (8, 8, 16)),
     ((2, 1, 1), (1, 1, 64)), ((1, 2, 1), (1024, 1, 1))],
)
def test_builtin_index_variables(grid, block):
    out = ops.index_map(list(grid), list(block))
    expected = [
        [bx, by, bz, tx, ty, tz, *block, *grid]
        for bz, by, bx in itertools.product(*(range(g) for g in reversed(grid)))
        for tz, ty, tx in itertools.product(*(range(b) for b in reversed(block)))
    ]
    assert out.tolist() == expected


@pytest.mark.parametrize(
    "grid, block, why",
    [
        ((0, 1, 1), (32, 1, 1), "empty grid"),
        ((1, 1, 1), (32, 0, 1), "empty block"),
        ((1, 1, 1), (32, 32, 2), r"2048 threads per block \(max 1024\)"),
        ((1, 1, 1), (1, 1, 65), "block.z exceeds 64"),
        ((1, 65536, 1), (1, 1, 1), "grid.y and grid.z must be at most 65535"),
        ((1, 1, 65536), (1, 1, 1), "grid.y and grid.z must be at most 65535"),
    ],
)
def test_invalid_launch_configuration(grid, block, why):
    g, b = ",".join(map(str, grid)), ",".join(map(str, block))
    pattern = (rf"headwise sim: kernel 'index_map': invalid launch configuration: grid \({g}\), "
               rf"block \({b}\), 0 bytes dynamic shared memory: {why}")
    with pytest.raises(RuntimeError, match=pattern):
        ops.index_map(list(grid), list(block))
    check_emulator_still_works()


@pytest.mark.parametrize("threads", [1, 64, 1024])
@pytest.mark.parametrize("nbytes", [4, 128, 4100, 48 * 1024 + 4, 227 * 1024])
def test_dynamic_shared_memory(threads, nbytes):
    blocks = 3
    out = ops.dynamic_smem_roundtrip(blocks, threads, nbytes)
    nwords = nbytes // 4
    # Before the block writes: the 0xFF poison of every block start (-1 as int32), also
    # in the blocks that follow one that wrote the buffer on the same OS thread.
    assert torch.equal(out[:, 0], torch.full((blocks, nwords), -1, dtype=torch.int32))
    words = torch.arange(nwords, dtype=torch.int32)
    expected = torch.stack([b * 1000003 + words for b in range(blocks)])
    assert torch.equal(out[:, 1], expected)


def test_dynamic_shared_memory_limits():
    with pytest.raises(RuntimeError, match=r"dynamic shared memory exceeds 232448 bytes"):
        ops.dynamic_smem_roundtrip(1, 32, 227 * 1024 + 4)
    with pytest.raises(RuntimeError, match=r"1025 threads per block \(max 1024\)"):
        ops.dynamic_smem_roundtrip(1, 1025, 128)
    check_emulator_still_works()


@pytest.mark.parametrize("threads", [2, 33, 1024])
def test_spin_wait_with_nanosleep_terminates(threads):
    assert ops.spin_wait(threads).tolist() == [1, 2]


# ---------------------------------------------------------------------------
# Atomics across blocks running on several OS threads
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("blocks, threads", [(1, 1), (7, 33), (512, 256)])
def test_atomics_across_blocks(blocks, threads):
    total = blocks * threads
    fsum, ints, gid_sum, owner = ops.atomic_add_blocks(blocks, threads)
    assert fsum.item() == float(total)  # exact below 2**24
    assert ints.tolist() == [total, total - 1, 0]
    assert gid_sum.item() == total * (total - 1) // 2
    assert (owner != -1).all()  # every block ran
    if blocks >= 64 and torch.get_num_threads() >= 2:
        # The torch side installs at::parallel_for as the emulator's block scheduler.
        assert len(set(owner.tolist())) >= 2, (
            "all blocks ran on one OS thread: at::parallel_for is serial in code compiled without -fopenmp"
        )


# ---------------------------------------------------------------------------
# Warp collectives
# ---------------------------------------------------------------------------
WIDTHS = [1, 2, 4, 8, 16, 32]
ARGS = [0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 33, 47, -1, -5]


@pytest.mark.parametrize("nthreads", [32, 48, 64, 1, 100])
@pytest.mark.parametrize("kind", [IDX, UP, DOWN, XOR], ids=["shfl", "up", "down", "xor"])
def test_shuffles_match_cuda_model(kind, nthreads):
    x = (torch.arange(nthreads, dtype=torch.int32) * 10 + 7)
    xs = x.tolist()
    for width, arg in itertools.product(WIDTHS, ARGS):
        if kind in (UP, DOWN) and arg < 0 and arg != -1:
            continue  # delta is unsigned; -1 checks the low-5-bit rule, one case is enough
        got = ops.warp_shuffle(x, kind, arg, width).tolist()
        assert got == shfl_model(xs, kind, arg, width), (width, arg)


@pytest.mark.parametrize("kind", [IDX, UP, DOWN, XOR], ids=["shfl", "up", "down", "xor"])
def test_shuffle_64bit_values(kind):
    x = (torch.arange(64, dtype=torch.int64) << 36) + 0x1234567 * torch.arange(64)
    for width, arg in [(32, 1), (32, 9), (16, 3), (8, 13), (4, 2)]:
        got = ops.warp_shuffle(x, kind, arg, width).tolist()
        assert got == shfl_model(x.tolist(), kind, arg, width), (width, arg)


@pytest.mark.parametrize("mask", [0x0000FFFF, 0xFFFF0000, 0xAAAAAAAA, 0x80000001, 0x00F0F00F, 0x1])
def test_shuffles_with_partial_masks(mask):
    x = torch.arange(64, dtype=torch.int32) + 100
    for kind, width, arg in itertools.product([IDX, UP, DOWN, XOR], [32, 16, 4], [0, 1, 3, 4, 30]):
        got = ops.warp_shuffle(x, kind, arg, width, mask).tolist()
        assert got == shfl_model(x.tolist(), kind, arg, width, mask), (kind, width, arg)


def test_shuffle_random_cases():
    rnd = random.Random(1234)
    for _ in range(200):
        n = rnd.randint(1, 130)
        kind = rnd.randrange(4)
        width = rnd.choice(WIDTHS)
        arg = rnd.randint(-40, 70)
        mask = rnd.choice([FULL, rnd.getrandbits(32) | 1 << rnd.randrange(32)])
        x = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32)
        got = ops.warp_shuffle(x, kind, arg, width, mask).tolist()
        assert got == shfl_model(x.tolist(), kind, arg, width, mask), (n, kind, width, arg, hex(mask))


def warp_sum_tree(x):
    """hw::warp_sum's tree over the 32 rows of x [32, M] (fp32 adds at xor offsets 16, 8,
    4, 2, 1): the sum every lane ends with."""
    lanes = torch.arange(32)
    for offset in (16, 8, 4, 2, 1):
        x = x + x[lanes ^ offset]
    return x[0]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 12, 16, 24, 96])
def test_warp_sum_scatter_holds_warp_sum_bits(m):
    """hw::warp_sum_scatter: after L = min(5, m's factors of 2) halving levels lane l holds
    the sums [first(l), first(l) + m / 2^L) with warp_sum's bits (the same tree), where
    first(l) adds m / 2^(k + 1) for each level k whose offset bit 16 >> k is set in l."""
    gen = torch.Generator().manual_seed(m)
    # Magnitudes over 8 decades, so a different summation order would show in the bits.
    x = torch.randn(32, m, generator=gen) * 10.0 ** torch.randint(-4, 4, (32, m), generator=gen)
    scattered, butterfly = ops.warp_sum_scatter(x)
    assert torch.equal(butterfly, warp_sum_tree(x))
    levels = min(5, (m & -m).bit_length() - 1)
    held = m >> levels
    covered = set()
    for lane in range(32):
        first = sum(m >> (k + 1) for k in range(levels) if lane & (16 >> k))
        row = scattered[lane]
        assert torch.equal(row[first:first + held], butterfly[first:first + held]), lane
        rest = torch.cat([row[:first], row[first + held:]])
        assert torch.isnan(rest).all(), lane
        covered.update(range(first, first + held))
    assert covered == set(range(m))


def test_warp_sum_scatter_rejects_unsupported_counts():
    with pytest.raises(RuntimeError, match="M must be"):
        ops.warp_sum_scatter(torch.zeros(32, 5))


@pytest.mark.parametrize("nthreads", [1, 32, 48, 96, 1024])
@pytest.mark.parametrize("mask", [FULL, 0x0000FFFF, 0x55555555, 0x80000000])
def test_votes_match_cuda_model(nthreads, mask):
    g = torch.Generator().manual_seed(nthreads)
    preds = [
        torch.zeros(nthreads, dtype=torch.int32),
        torch.full((nthreads,), 5, dtype=torch.int32),
        torch.randint(0, 2, (nthreads,), generator=g, dtype=torch.int32),
        (torch.arange(nthreads) % 32 == 31).int(),
        (torch.arange(nthreads) % 32 != 0).int(),
    ]
    for pred in preds:
        got = ops.warp_vote(pred, mask).tolist()
        assert got == vote_model(pred.tolist(), mask)


# ---------------------------------------------------------------------------
# WMMA
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_col_major", [False, True], ids=["b_row", "b_col"])
@pytest.mark.parametrize("m, n, k", [(16, 16, 16), (32, 48, 64), (48, 16, 32), (16, 80, 16)])
def test_wmma_gemm(m, n, k, dtype, b_col_major):
    g = torch.Generator().manual_seed(m * 10000 + n * 100 + k)

    def run(a, b):
        return ops.wmma_gemm(a, b.t().contiguous() if b_col_major else b, b_col_major)

    # Small integers: products and sums are exact, so the result is exact.
    a = torch.randint(-6, 7, (m, k), generator=g).to(dtype)
    b = torch.randint(-6, 7, (k, n), generator=g).to(dtype)
    assert torch.equal(run(a, b), a.float() @ b.float())
    # General values: fp32 accumulation of exact products.
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    expected = a.double() @ b.double()
    got = run(a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * k)


def test_wmma_rejects_bad_shapes():
    a = torch.ones(16, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        ops.wmma_gemm(a, torch.ones(16, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ops.wmma_gemm(a.float(), a.float())


# ---------------------------------------------------------------------------
# Faulty kernels: fail fast, say what went wrong, leave the emulator usable
# ---------------------------------------------------------------------------
FAULTS = [
    pytest.param(
        0,
        r"headwise sim: kernel 'early_return' block \(0,0,0\): deadlock \(no thread can make progress\): "
        r"__syncthreads reached by 32 of 64 threads; threads 32\.\.63 exited without reaching it$",
        id="return-before-syncthreads",
    ),
    pytest.param(
        1,
        r"headwise sim: kernel 'divergent_barrier' block \(0,0,0\): deadlock \(no thread can make progress\): "
        r"__syncthreads reached by 16 of 64 threads; threads 16\.\.63 exited without reaching it$",
        id="syncthreads-in-divergent-branch",
    ),
    pytest.param(
        2,
        r"headwise sim: kernel 'exited_lane_shuffle' block \(0,0,0\): deadlock \(no thread can make progress\): "
        r"warp 0: __shfl_xor_sync\(mask=0xffffffff\) reached by 31 of 32 lanes; "
        r"lane 31 \(thread 31\) exited without reaching it$",
        id="shuffle-after-lane-exit",
    ),
    pytest.param(
        3,
        r"headwise sim: kernel 'mixed_collectives' block \(0,0,0\) thread \(\d+,0,0\): divergent warp collective "
        r"in warp 0 \(mask=0xffffffff\): lanes 0, 2, 4, .*, 30 at __shfl_xor_sync\(width=32, 4-byte value\); "
        r"lanes 1, 3, 5, .*, 31 at __ballot_sync$",
        id="two-different-collectives",
    ),
    pytest.param(4, r"headwise sim: kernel 'trap' block \(3,0,0\) thread \(5,0,0\): __trap\(\) called$", id="trap"),
    pytest.param(
        5,
        r"headwise sim: kernel 'too_many_threads': invalid launch configuration: grid \(1,1,1\), "
        r"block \(2048,1,1\), 0 bytes dynamic shared memory: 2048 threads per block \(max 1024\)$",
        id="2048-threads",
    ),
    pytest.param(6, r"^device index 99 out of range in thread 7$", id="device-exception"),
    pytest.param(
        7,
        r"headwise sim: kernel 'bad_width' block \(0,0,0\) thread \(0,0,0\): "
        r"__shfl_down_sync: width 3 is not a power of two in \[1, 32\]$",
        id="shuffle-width-3",
    ),
    pytest.param(
        8,
        r"headwise sim: kernel 'mask_without_caller' block \(0,0,0\) thread \(16,0,0\): "
        r"__shfl_sync\(mask=0x0000ffff\) called by lane 16, which is not in the mask$",
        id="caller-not-in-mask",
    ),
    pytest.param(
        9,
        r"headwise sim: kernel 'early_return_block2' block \(2,0,0\): deadlock \(no thread can make progress\): "
        r"__syncthreads reached by 32 of 64 threads; threads 32\.\.63 exited without reaching it$",
        id="deadlock-in-block-2-of-4",
    ),
    pytest.param(
        10,
        r"headwise sim: kernel 'crossed_masks' block \(0,0,0\): deadlock \(no thread can make progress\): "
        r"warp 0: __syncwarp\(mask=0xffffffff\) reached by 16 of 32 lanes; lanes 16\.\.31 \(threads 16\.\.31\) "
        r"wait at __ballot_sync\(mask=0xfffffffe\) instead; "
        r"warp 0: __ballot_sync\(mask=0xfffffffe\) reached by 16 of 31 lanes; lanes 1\.\.15 \(threads 1\.\.15\) "
        r"wait at __syncwarp\(mask=0xffffffff\) instead$",
        id="crossed-masks",
    ),
    pytest.param(
        11,
        r"headwise sim: kernel 'barrier_vs_warp' block \(0,0,0\): deadlock \(no thread can make progress\): "
        r"__syncthreads reached by 32 of 64 threads; thread 63 exited without reaching it; "
        r"threads 32\.\.62 wait at warp collectives instead; "
        r"warp 1: __syncwarp\(mask=0xffffffff\) reached by 31 of 32 lanes; "
        r"lane 31 \(thread 63\) exited without reaching it$",
        id="barrier-vs-syncwarp",
    ),
    pytest.param(
        12, r"headwise sim: kernel 'inner': launch from device code is not supported$", id="launch-from-device"
    ),
    pytest.param(13, r"headwise sim: __syncthreads called outside a kernel launch$", id="syncthreads-on-host"),
]


def first_line(exc_info):
    return str(exc_info.value).splitlines()[0]


@pytest.mark.parametrize("which, message", FAULTS)
def test_faulty_kernel_fails_fast_with_a_precise_message(which, message):
    for _ in range(3):  # the abandoned fibers' stacks are recycled correctly
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            ops.faulty_kernel(which)
        elapsed = time.monotonic() - start
        assert elapsed < FAST_S, f"took {elapsed:.1f} s"
        assert re.search(message, first_line(info)), first_line(info)
        check_emulator_still_works()


def test_faults_interleaved_with_normal_launches():
    """Every fault in a row, each followed by launches of every kind of kernel."""
    x = int_valued(64, 300, seed=5)
    a = torch.randint(-3, 4, (32, 32)).to(torch.float16)
    for which in range(len(FAULTS)):
        with pytest.raises(RuntimeError, match="headwise sim|device index"):
            ops.faulty_kernel(which)
        assert torch.equal(ops.block_sum(x, 128, 1), x.sum(1))
        assert ops.dynamic_smem_roundtrip(2, 64, 256)[:, 0].eq(-1).all()
        assert torch.equal(ops.wmma_gemm(a, a), a.float() @ a.float())
        fsum, ints, _, _ = ops.atomic_add_blocks(64, 64)
        assert fsum.item() == 4096.0 and ints[0].item() == 4096
