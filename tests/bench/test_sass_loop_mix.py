"""headwise.bench.sass: loops and their steady-state iteration found in cuobjdump -sass text."""

from headwise.bench import sass

# A K loop in cuobjdump's format: the head at 0x100, a branch over the copies (taken only
# in the pipeline's last iterations), a conditional branch to a full-slice fast path
# (`BRA P0, target`), a cold block under a branch (a head change: many FMULs), an inner
# scan loop, 4 HMMA and the backward branch.
SASS = """
        Function : _Z6kernelv
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0100*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0110*/                   ISETP.NE.AND P1, PT, R2, R3, PT ;
        /*0120*/               @P1 BRA 0x180 ;
        /*0130*/                   FMUL R10, R10, R4 ;
        /*0140*/                   FMUL R11, R11, R4 ;
        /*0150*/                   FMUL R12, R12, R4 ;
        /*0160*/                   FMUL R13, R13, R4 ;
        /*0170*/                   FMUL R14, R14, R4 ;
        /*0180*/                   DEPBAR.LE SB0, 0x1 ;
        /*0190*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*01a0*/              @!P2 BRA 0x280 ;
        /*01b0*/                   BRA P0, 0x220 ;
        /*01c0*/                   IADD3 R5, R5, 0x1, RZ ;
        /*01d0*/                   SEL R6, R5, RZ, P3 ;
        /*01e0*/                   IADD3 R7, R7, 0x1, RZ ;
        /*01f0*/                   LDGSTS.E.BYPASS.128.ZFILL [R8], desc[UR4][R6.64], P4 ;
        /*0200*/                   LDGSTS.E.BYPASS.128.ZFILL [R8+0x1000], desc[UR4][R6.64], P4 ;
        /*0210*/                   BRA 0x240 ;
        /*0220*/                   LDGSTS.E.BYPASS.128 [R8], desc[UR4][R6.64] ;
        /*0230*/                   LDGSTS.E.BYPASS.128 [R8+0x1000], desc[UR4][R6.64] ;
        /*0240*/                   LDG.E R9, desc[UR4][R6.64] ;
        /*0250*/                   IADD3 R9, R9, 0x1, RZ ;
        /*0260*/                   ISETP.NE.AND P5, PT, R9, R3, PT ;
        /*0270*/               @P5 BRA 0x240 ;
        /*0280*/                   LDGDEPBAR ;
        /*0290*/                   LDSM.16.M88.4 R20, [R8] ;
        /*02a0*/                   HMMA.16816.F32.BF16 R24, R20, R22, R24 ;
        /*02b0*/                   HMMA.16816.F32.BF16 R28, R20, R22, R28 ;
        /*02c0*/                   HMMA.16816.F32.BF16 R32, R20, R22, R32 ;
        /*02d0*/                   HMMA.16816.F32.BF16 R36, R20, R22, R36 ;
        /*02e0*/               @!P6 BRA 0x100 ;
        /*02f0*/                   EXIT ;
"""


def test_loops_and_the_steady_iteration():
    (f,) = sass.parse(SASS)
    assert len(f.instructions) == 34
    spans = sorted((lp.start, lp.end) for lp in f.loops)
    assert spans == [(0x100, 0x2E0), (0x240, 0x270)]  # the K loop and the inner scan
    k_loop = f.hot_loop("hmma")
    assert (k_loop.start, k_loop.end) == (0x100, 0x2E0)
    assert k_loop.instructions == 31 and k_loop.counts["hmma"] == 4 and k_loop.counts["ldgsts"] == 4
    # The steady iteration: the head (3) and its branch over the cold FMULs, the wait and
    # barrier, the branch into the copies, the fast path's two copies (the shorter of the
    # two copy paths), the inner scan once (4), LDGDEPBAR, LDSM, 4 HMMA, the back branch.
    path = sass.hot_path([(a, t) for a, t in f.instructions if 0x100 <= a <= 0x2E0])
    addrs = [a for a, _ in path]
    assert 0x130 not in addrs and 0x1c0 not in addrs  # cold FMULs, the bounded copies
    assert {0x220, 0x230, 0x240, 0x270, 0x2E0} <= set(addrs)
    assert k_loop.path == len(path) == 20
    assert k_loop.path_counts["ldgsts"] == 2 and k_loop.path_counts["hmma"] == 4
    assert k_loop.issue_per_hmma == 5.0
    assert 0 < k_loop.issue_bound_share <= 1.0


def test_branch_forms():
    assert sass._is_branch("@P1 BRA 0x180") == (True, True, 0x180)
    assert sass._is_branch("BRA 0x240") == (True, False, 0x240)
    assert sass._is_branch("BRA P0, 0x220") == (True, True, 0x220)
    assert sass._is_branch("IADD3 R1, R1, 0x1, RZ") == (False, False, None)
    assert sass.classify("LDGSTS.E.BYPASS.128 [R8], desc[UR4][R6.64]") == "ldgsts"
    assert sass.classify("LDGDEPBAR") == "bar"
    assert sass.classify("@P0 LDG.E R9, desc[UR4][R6.64]") == "ldg"
    assert sass.classify("LDSM.16.MT88.4 R20, [R8]") == "ldsm"
    assert sass.classify("LDS R7, [UR11+0xc000]") == "lds"


def test_steady_iteration_takes_the_whole_slice_copies_when_the_bounded_path_has_more():
    # The bounded copy path issues more copies than the whole-slice one (here 3 against 2:
    # a kernel with 4 rows a thread issues the rows in range unbounded and the rest zero
    # filled); the steady iteration is still the whole-slice one, not the path with the
    # most copies.
    text = SASS.replace(
        "        /*0210*/                   BRA 0x240 ;\n",
        "        /*0208*/                   LDGSTS.E.BYPASS.128.ZFILL [R8+0x2000], desc[UR4][R6.64], P4 ;\n"
        "        /*0210*/                   BRA 0x240 ;\n",
    )
    (f,) = sass.parse(text)
    k_loop = f.hot_loop("hmma")
    assert k_loop.counts["ldgsts"] == 5
    assert k_loop.path == 20 and k_loop.path_counts["ldgsts"] == 2


def test_loop_without_hmma_keeps_the_path_through_the_most_shared_stores():
    # A loop without HMMA (an MHAR stage, an epilogue): the steady path goes through the
    # branch that stores to shared memory, not the shorter one around it.
    text = """
        Function : _Z6kernelv
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0100*/                   LDG.E R2, desc[UR4][R6.64] ;
        /*0110*/               @P1 BRA 0x140 ;
        /*0120*/                   STS [R8], R2 ;
        /*0130*/                   STS [R8+0x4], R2 ;
        /*0140*/                   STS [R8+0x8], R2 ;
        /*0150*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0160*/               @!P6 BRA 0x100 ;
        /*0170*/                   EXIT ;
"""
    (f,) = sass.parse(text)
    (loop,) = f.loops
    assert loop.path == 7 and loop.path_counts["sts"] == 3
