"""Flash attention for MHA, GQA and MQA in portable Triton: the forward, dQ (with delta) and dK/dV kernels that
flash.py launches everywhere the Hopper kernels (flash_sm90.py) do not run, the CPU interpreter included.

Math (flash.py has it whole): S = scale * Q K^T, P = softmax(S), Out = P V, lse = logsumexp(S); backward
dV = P^T dO, dP = dO V^T, dS = P * (dP - delta) with delta = rowsum(dO * Out), dQ = scale * dS K, dK = scale * dS^T Q.
Scores are kept in the log2 domain (exp2 with log2(e) folded into qk_scale). Causal masking is bottom-right
aligned: query row i sits at key position S_kv - S_q + i.

Structure (FlashAttention-2, Dao 2023; Triton's fused-attention tutorial):
- forward (`flash_fwd_kernel`): one program per (query block, query head, batch) streams K/V blocks with an online
  softmax. The KV loop is split in two: blocks every query of the program sees entirely run without any mask;
  only the blocks on the causal diagonal or past the end of the sequence run the masked variant, and blocks wholly
  above the diagonal are never visited.
- backward, two launches: dQ first (`flash_bwd_dq_kernel`), one program per query block streaming K/V like the
  forward, which also writes delta for its rows; then dK/dV (`flash_bwd_dkdv_kernel`), where a program owns a KV
  block and loops over every query head of its KV group and every query block, so GQA needs no per-query-head
  partial buffers. A launch with too few KV blocks to fill the GPU shares each group's heads among HEAD_SPLITS
  programs, whose fp32 partials the launcher sums.
- a Q/K head dim that is not a power of two is tiled as two power-of-two column blocks when that pads less
  (SPLIT_DK: MLA's 192 = 128 + 64 instead of 256): two products into the same scores, two dQ/dK accumulators.
- the tiles a loop streams (K/V in the forward and dQ, Q/dO in dK/dV) come through TMA tensor descriptors or
  through plain pointers with masks (USE_TMA); both paths compute the same math.
- programs are numbered in `schedule.ranked` order: heavy causal blocks first, a KV group's programs together.

The same kernels run on CPU tensors under TRITON_INTERPRET=1: loop bounds are computed from program ids and integer
arguments, and `_bound` hands them to the interpreter as the Python ints its `range` needs.
"""

import triton
import triton.language as tl

from attention_kernels.schedule import ranked


@triton.jit
def _bound(x, INTERPRET: tl.constexpr):
    """A loop bound computed from program ids. The triton 3.6 interpreter holds scalars as 1-element arrays, which
    numpy 2 refuses to turn into the Python int `range` needs (TypeError: only 0-dimensional arrays can be
    converted), so there the value is taken out explicitly; compiled, the branch is dropped and x stays as is."""
    if INTERPRET:
        return x.handle.data.item() if isinstance(x, tl.tensor) else x
    else:
        return x


@triton.jit
def _load(ptrs, mask_a, mask_b, CHECK_A: tl.constexpr, CHECK_B: tl.constexpr):
    """Load a one-off tile, masking only the axes that can run out of bounds (each mask is pre-broadcast by the
    caller, e.g. rows[:, None] < M and cols[None, :] < D); unmasked loads stay plain vector loads."""
    if CHECK_A and CHECK_B:
        return tl.load(ptrs, mask=mask_a & mask_b, other=0.0)
    elif CHECK_A:
        return tl.load(ptrs, mask=mask_a, other=0.0)
    elif CHECK_B:
        return tl.load(ptrs, mask=mask_b, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _rows_source(
    base, n_rows, stride_r, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr
):
    """The (n_rows, D) matrix at `base` that a loop streams row blocks of: a TMA tensor descriptor on Hopper (the
    copy engine fetches whole tiles asynchronously and zero-fills out-of-bounds rows and columns), else the plain
    base pointer. The launcher picks TMA only when the column stride is 1 and every other stride and the base are
    16-byte aligned."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, D], strides=[stride_r, 1], block_shape=[BLOCK_R, BLOCK_D])
    else:
        return base


@triton.jit
def _load_rows(
    src,
    start,
    n_rows,
    stride_r,
    tile_offs,
    offs_r,
    offs_c,
    D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    CHECK_COLS: tl.constexpr,
    USE_TMA: tl.constexpr,
    COL0: tl.constexpr = 0,
):
    """Rows [start, start + BLOCK_R) of `src` (from _rows_source) as a (BLOCK_R, BLOCK_D) tile of the columns
    from COL0 (offs_c holds them), zero outside the matrix. The pointer path adds a precomputed tile offset
    (offs_r * stride_r + offs_c * stride_c) to the block start and masks only the axes that can run out of bounds."""
    if USE_TMA:
        return src.load([start, COL0])
    else:
        ptrs = src + start * stride_r + tile_offs
        if CHECK_ROWS:
            row_ok = (start + offs_r)[:, None] < n_rows
            if CHECK_COLS:
                return tl.load(ptrs, mask=row_ok & (offs_c[None, :] < D), other=0.0)
            else:
                return tl.load(ptrs, mask=row_ok, other=0.0)
        else:
            if CHECK_COLS:
                return tl.load(ptrs, mask=offs_c[None, :] < D, other=0.0)
            else:
                return tl.load(ptrs)


@triton.jit
def _scores(a, a2, b, b2, SPLIT_DK: tl.constexpr, PRECISION: tl.constexpr):
    """a b^T over the head dim, which comes in one block or, when SPLIT_DK, in two (a, b: the first BLOCK_DK
    columns; a2, b2: the next BLOCK_DK2). Two blocks cover a head dim that is not a power of two with less padding:
    192 = 128 + 64 instead of 256, 72 = 64 + 16 instead of 128."""
    s = tl.dot(a, tl.trans(b), input_precision=PRECISION)
    if SPLIT_DK:
        s = tl.dot(a2, tl.trans(b2), s, input_precision=PRECISION)
    return s


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    q2,
    k_src,
    k2_src,
    v_src,
    k_offs,
    k2_offs,
    v_offs,
    stride_kn,
    stride_vn,
    offs_m,
    offs_n,
    offs_dk,
    offs_dk2,
    offs_dv,
    lo,
    hi,
    N,
    q_shift,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_DK: tl.constexpr,
    EVEN_DK2: tl.constexpr,
    EVEN_DV: tl.constexpr,
    SPLIT_DK: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi). MASKED blocks check the causal diagonal and the sequence end;
    unmasked ones are known (by the caller's loop split) to be wholly visible to every query row."""
    for start_n in range(_bound(lo, INTERPRET), _bound(hi, INTERPRET), BLOCK_N):
        k = _load_rows(
            k_src, start_n, N, stride_kn, k_offs, offs_n, offs_dk, D_QK, MASKED, not EVEN_DK, USE_TMA
        )  # (BLOCK_N, BLOCK_DK)
        k2 = k
        if SPLIT_DK:
            k2 = _load_rows(
                k2_src, start_n, N, stride_kn, k2_offs, offs_n, offs_dk2, D_QK, MASKED, not EVEN_DK2, USE_TMA, BLOCK_DK
            )  # (BLOCK_N, BLOCK_DK2)
        qk = _scores(q, q2, k, k2, SPLIT_DK, PRECISION)
        if MASKED:
            cols = start_n + offs_n
            visible = cols[None, :] < N
            if CAUSAL:
                visible = visible & ((q_shift + offs_m)[:, None] >= cols[None, :])
            qk = tl.where(visible, qk * qk_scale, -float("inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(
            v_src, start_n, N, stride_vn, v_offs, offs_n, offs_dv, D_V, MASKED, not EVEN_DV, USE_TMA
        )  # (BLOCK_N, D_v)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_lb,
    stride_lh,
    stride_lm,
    M,
    N,
    H_Q,
    bucket,
    qk_scale,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DK2: tl.constexpr,
    SPLIT_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # One program per (query block, head, batch) in schedule.ranked order: causal ones heaviest first (the last
    # query blocks see the most keys), so the short ones fill the tail of the grid instead of a long one starting
    # last.
    n_m = tl.cdiv(M, BLOCK_M)
    pid_m, hb = ranked(tl.program_id(0), n_m, tl.num_programs(0) // n_m, bucket)
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    head = hb % H_Q
    batch = (hb // H_Q).to(tl.int64)
    kv_head = head // GROUP_SIZE
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dk2 = BLOCK_DK + tl.arange(0, BLOCK_DK2)
    offs_dv = tl.arange(0, BLOCK_DV)
    EVEN_DK: tl.constexpr = D_QK == BLOCK_DK or SPLIT_DK
    EVEN_DK2: tl.constexpr = D_QK == BLOCK_DK + BLOCK_DK2
    EVEN_DV: tl.constexpr = D_V == BLOCK_DV

    q_base = Q + batch * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch * stride_vb + kv_head.to(tl.int64) * stride_vh
    # Q tile (BLOCK_M, D_qk); rows past M load zeros and are never stored.
    q = _load(
        q_base + offs_m[:, None] * stride_qm + offs_dk[None, :] * stride_qd,
        offs_m[:, None] < M,
        offs_dk[None, :] < D_QK,
        True,
        not EVEN_DK,
    )
    q2, k2_src, k2_offs = q, K, offs_dk  # placeholders when the head dim is one block
    if SPLIT_DK:
        q2 = _load(
            q_base + offs_m[:, None] * stride_qm + offs_dk2[None, :] * stride_qd,
            offs_m[:, None] < M,
            offs_dk2[None, :] < D_QK,
            True,
            not EVEN_DK2,
        )
        k2_src = _rows_source(k_base, N, stride_kn, D_QK, BLOCK_N, BLOCK_DK2, USE_TMA)
        k2_offs = offs_n[:, None] * stride_kn + offs_dk2[None, :] * stride_kd
    k_src = _rows_source(k_base, N, stride_kn, D_QK, BLOCK_N, BLOCK_DK, USE_TMA)
    v_src = _rows_source(v_base, N, stride_vn, D_V, BLOCK_N, BLOCK_DV, USE_TMA)
    k_offs = offs_n[:, None] * stride_kn + offs_dk[None, :] * stride_kd
    v_offs = offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Keys [0, n_full) are visible to every row of this block and lie inside the sequence: no mask there.
    # Keys [n_full, n_end) need the causal / sequence-end mask; keys past n_end are masked for every row.
    q_shift = N - M  # query row i sits at key position q_shift + i
    if CAUSAL:
        n_end = tl.minimum(N, q_shift + start_m + BLOCK_M)
        n_full = tl.minimum((q_shift + start_m + 1) // BLOCK_N * BLOCK_N, N // BLOCK_N * BLOCK_N)
    else:
        n_end = N
        n_full = N // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        q2,
        k_src,
        k2_src,
        v_src,
        k_offs,
        k2_offs,
        v_offs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_dk,
        offs_dk2,
        offs_dv,
        0,
        n_full,
        N,
        q_shift,
        qk_scale,
        False,
        CAUSAL,
        EVEN_DK,
        EVEN_DK2,
        EVEN_DV,
        SPLIT_DK,
        BLOCK_DK,
        D_QK,
        D_V,
        BLOCK_N,
        PRECISION,
        USE_TMA,
        INTERPRET,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        q2,
        k_src,
        k2_src,
        v_src,
        k_offs,
        k2_offs,
        v_offs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_dk,
        offs_dk2,
        offs_dv,
        n_full,
        n_end,
        N,
        q_shift,
        qk_scale,
        True,
        CAUSAL,
        EVEN_DK,
        EVEN_DK2,
        EVEN_DV,
        SPLIT_DK,
        BLOCK_DK,
        D_QK,
        D_V,
        BLOCK_N,
        PRECISION,
        USE_TMA,
        INTERPRET,
    )

    # Every row sees at least key 0 (bottom-right alignment with S_q <= S_kv), so l_i > 0.
    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # back from log2 to natural log
    o_ptrs = (
        Out
        + batch * stride_ob
        + head.to(tl.int64) * stride_oh
        + offs_m[:, None] * stride_om
        + offs_dv[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_dv[None, :] < D_V))
    l_ptrs = LSE + batch * stride_lb + head.to(tl.int64) * stride_lh + offs_m * stride_lm
    tl.store(l_ptrs, lse, mask=offs_m < M)


@triton.jit
def _bwd_dkdv_inner(
    dk,
    dk2,
    dv,
    k,
    k2,
    v,
    q_src,
    q2_src,
    do_src,
    q_offs,
    q2_offs,
    do_offs,
    lse_base,
    delta_base,
    stride_qm,
    stride_dom,
    stride_lm,
    offs_m,
    offs_n,
    offs_dk,
    offs_dk2,
    offs_dv,
    lo,
    hi,
    M,
    q_shift,
    qk_scale,
    MASKED: tl.constexpr,
    EVEN_DK: tl.constexpr,
    EVEN_DK2: tl.constexpr,
    EVEN_DV: tl.constexpr,
    SPLIT_DK: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi) of one query head, in transposed form
    (keys along rows) so both products land in the (BLOCK_N, D) accumulators. Rows past M load zeros for
    Q, dO, lse and delta, which makes their dS and P dO contributions exactly zero without a mask."""
    for start_m in range(_bound(lo, INTERPRET), _bound(hi, INTERPRET), BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < M
        q = _load_rows(
            q_src, start_m, M, stride_qm, q_offs, offs_m, offs_dk, D_QK, True, not EVEN_DK, USE_TMA
        )  # (BLOCK_M, BLOCK_DK)
        q2 = q
        if SPLIT_DK:
            q2 = _load_rows(
                q2_src, start_m, M, stride_qm, q2_offs, offs_m, offs_dk2, D_QK, True, not EVEN_DK2, USE_TMA, BLOCK_DK
            )  # (BLOCK_M, BLOCK_DK2)
        lse = tl.load(lse_base + rows * stride_lm, mask=row_ok, other=0.0) * 1.4426950408889634
        qk_t = _scores(k, k2, q, q2, SPLIT_DK, PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
        if MASKED:
            p_t = tl.where((q_shift + rows)[None, :] >= offs_n[:, None], p_t, 0.0)
        do = _load_rows(
            do_src, start_m, M, stride_dom, do_offs, offs_m, offs_dv, D_V, True, not EVEN_DV, USE_TMA
        )  # (BLOCK_M, D_v)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)
        if SPLIT_DK:
            dk2 = tl.dot(ds_t, q2, dk2, input_precision=PRECISION)
    return dk, dk2, dv


@triton.jit
def flash_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    M,
    N,
    H_Q,
    bucket,
    scale,
    qk_scale,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DK2: tl.constexpr,
    SPLIT_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
    HEAD_SPLITS: tl.constexpr,
):
    """One program owns a KV block of one KV head and accumulates dK, dV over the GROUP_SIZE query heads that read
    it and over every query block that sees it; written once, no atomics. With HEAD_SPLITS > 1 (a launch with too
    few KV blocks to fill the GPU, e.g. MQA) the group's heads are shared out among HEAD_SPLITS programs, and each
    writes an fp32 partial at head index kv_head * HEAD_SPLITS + part of DK/DV, which the launcher sums."""
    # One program per (KV block, KV head share, batch) in schedule.ranked order: causal ones heaviest first (the
    # first KV blocks are seen by the most queries).
    n_kb = tl.cdiv(N, BLOCK_N)
    pid_n, hb = ranked(tl.program_id(0), n_kb, tl.num_programs(0) // n_kb, bucket)
    shares = H_Q // GROUP_SIZE * HEAD_SPLITS  # (KV head, share of its group) pairs per sequence
    pid_h = hb % shares
    kv_head = pid_h // HEAD_SPLITS
    batch = (hb // shares).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dk2 = BLOCK_DK + tl.arange(0, BLOCK_DK2)
    offs_dv = tl.arange(0, BLOCK_DV)
    EVEN_DK: tl.constexpr = D_QK == BLOCK_DK or SPLIT_DK
    EVEN_DK2: tl.constexpr = D_QK == BLOCK_DK + BLOCK_DK2
    EVEN_DV: tl.constexpr = D_V == BLOCK_DV

    # K, V tiles (BLOCK_N, D); rows past N load zeros: their dK/dV rows are never stored.
    k_base = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn
    k = _load(k_base + offs_dk[None, :] * stride_kd, offs_n[:, None] < N, offs_dk[None, :] < D_QK, True, not EVEN_DK)
    v = _load(
        V
        + batch * stride_vb
        + kv_head.to(tl.int64) * stride_vh
        + offs_n[:, None] * stride_vn
        + offs_dv[None, :] * stride_vd,
        offs_n[:, None] < N,
        offs_dv[None, :] < D_V,
        True,
        not EVEN_DV,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_offs = offs_m[:, None] * stride_qm + offs_dk[None, :] * stride_qd
    k2, dk2, q2_offs = k, dk, q_offs  # placeholders when the head dim is one block
    if SPLIT_DK:
        k2 = _load(
            k_base + offs_dk2[None, :] * stride_kd, offs_n[:, None] < N, offs_dk2[None, :] < D_QK, True, not EVEN_DK2
        )
        dk2 = tl.zeros([BLOCK_N, BLOCK_DK2], tl.float32)
        q2_offs = offs_m[:, None] * stride_qm + offs_dk2[None, :] * stride_qd
    do_offs = offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod

    # Query rows [m_lo, m_mid) straddle the causal diagonal of this key block (masked); rows from m_mid on see
    # every key of it (unmasked); rows before m_lo see none of it and are skipped.
    q_shift = N - M
    if CAUSAL:
        m_lo = tl.maximum(start_n - q_shift, 0) // BLOCK_M * BLOCK_M
        m_mid = tl.minimum(
            tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - q_shift, 0), BLOCK_M) * BLOCK_M, tl.cdiv(M, BLOCK_M) * BLOCK_M
        )
    else:
        m_lo = 0
        m_mid = 0
    if HEAD_SPLITS == 1:
        g_lo, g_hi = 0, GROUP_SIZE
    else:
        HEADS_PER_SPLIT: tl.constexpr = (GROUP_SIZE + HEAD_SPLITS - 1) // HEAD_SPLITS
        g_lo = pid_h % HEAD_SPLITS * HEADS_PER_SPLIT
        g_hi = tl.minimum(g_lo + HEADS_PER_SPLIT, GROUP_SIZE)
    for g in range(_bound(g_lo, INTERPRET), _bound(g_hi, INTERPRET)):
        head = (kv_head * GROUP_SIZE + g).to(tl.int64)
        q_base = Q + batch * stride_qb + head * stride_qh
        q_src = _rows_source(q_base, M, stride_qm, D_QK, BLOCK_M, BLOCK_DK, USE_TMA)
        q2_src = q_src
        if SPLIT_DK:
            q2_src = _rows_source(q_base, M, stride_qm, D_QK, BLOCK_M, BLOCK_DK2, USE_TMA)
        do_src = _rows_source(
            DO + batch * stride_dob + head * stride_doh, M, stride_dom, D_V, BLOCK_M, BLOCK_DV, USE_TMA
        )
        lse_base = LSE + batch * stride_lb + head * stride_lh
        delta_base = DELTA + (batch * H_Q + head) * M
        dk, dk2, dv = _bwd_dkdv_inner(
            dk,
            dk2,
            dv,
            k,
            k2,
            v,
            q_src,
            q2_src,
            do_src,
            q_offs,
            q2_offs,
            do_offs,
            lse_base,
            delta_base,
            stride_qm,
            stride_dom,
            stride_lm,
            offs_m,
            offs_n,
            offs_dk,
            offs_dk2,
            offs_dv,
            m_lo,
            m_mid,
            M,
            q_shift,
            qk_scale,
            True,
            EVEN_DK,
            EVEN_DK2,
            EVEN_DV,
            SPLIT_DK,
            BLOCK_DK,
            D_QK,
            D_V,
            BLOCK_M,
            PRECISION,
            USE_TMA,
            INTERPRET,
        )
        dk, dk2, dv = _bwd_dkdv_inner(
            dk,
            dk2,
            dv,
            k,
            k2,
            v,
            q_src,
            q2_src,
            do_src,
            q_offs,
            q2_offs,
            do_offs,
            lse_base,
            delta_base,
            stride_qm,
            stride_dom,
            stride_lm,
            offs_m,
            offs_n,
            offs_dk,
            offs_dk2,
            offs_dv,
            m_mid,
            M,
            M,
            q_shift,
            qk_scale,
            False,
            EVEN_DK,
            EVEN_DK2,
            EVEN_DV,
            SPLIT_DK,
            BLOCK_DK,
            D_QK,
            D_V,
            BLOCK_M,
            PRECISION,
            USE_TMA,
            INTERPRET,
        )

    mask_n = offs_n[:, None] < N
    dk_ptrs = DK + batch * stride_dkb + pid_h.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn
    tl.store(
        dk_ptrs + offs_dk[None, :] * stride_dkd,
        (dk * scale).to(DK.dtype.element_ty),
        mask=mask_n & (offs_dk[None, :] < D_QK),
    )
    if SPLIT_DK:
        tl.store(
            dk_ptrs + offs_dk2[None, :] * stride_dkd,
            (dk2 * scale).to(DK.dtype.element_ty),
            mask=mask_n & (offs_dk2[None, :] < D_QK),
        )
    tl.store(
        DV
        + batch * stride_dvb
        + pid_h.to(tl.int64) * stride_dvh
        + offs_n[:, None] * stride_dvn
        + offs_dv[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty),
        mask=mask_n & (offs_dv[None, :] < D_V),
    )


@triton.jit
def _bwd_dq_inner(
    dq,
    dq2,
    q,
    q2,
    do,
    lse,
    delta,
    k_src,
    k2_src,
    v_src,
    k_offs,
    k2_offs,
    v_offs,
    stride_kn,
    stride_vn,
    offs_m,
    offs_n,
    offs_dk,
    offs_dk2,
    offs_dv,
    lo,
    hi,
    N,
    q_shift,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_DK: tl.constexpr,
    EVEN_DK2: tl.constexpr,
    EVEN_DV: tl.constexpr,
    SPLIT_DK: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks [lo, hi); the mask split mirrors the forward."""
    for start_n in range(_bound(lo, INTERPRET), _bound(hi, INTERPRET), BLOCK_N):
        k = _load_rows(
            k_src, start_n, N, stride_kn, k_offs, offs_n, offs_dk, D_QK, MASKED, not EVEN_DK, USE_TMA
        )  # (BLOCK_N, BLOCK_DK)
        k2 = k
        if SPLIT_DK:
            k2 = _load_rows(
                k2_src, start_n, N, stride_kn, k2_offs, offs_n, offs_dk2, D_QK, MASKED, not EVEN_DK2, USE_TMA, BLOCK_DK
            )  # (BLOCK_N, BLOCK_DK2)
        v = _load_rows(
            v_src, start_n, N, stride_vn, v_offs, offs_n, offs_dv, D_V, MASKED, not EVEN_DV, USE_TMA
        )  # (BLOCK_N, D_v)
        qk = _scores(q, q2, k, k2, SPLIT_DK, PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            cols = start_n + offs_n
            visible = cols[None, :] < N
            if CAUSAL:
                visible = visible & ((q_shift + offs_m)[:, None] >= cols[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
        if SPLIT_DK:
            dq2 = tl.dot(ds, k2, dq2, input_precision=PRECISION)
    return dq, dq2


@triton.jit
def flash_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    Out,
    DLSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_gb,
    stride_gh,
    stride_gm,
    M,
    N,
    H_Q,
    bucket,
    scale,
    qk_scale,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DK2: tl.constexpr,
    SPLIT_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """dQ of one query block, streaming K/V like the forward. It runs first and also writes the block's delta =
    rowsum(dO * Out) - dlse (fp32, contiguous (B, H_q, M)), which the dK/dV kernel then reads: dO is loaded here
    anyway, and one launch fewer is one host-side launch fewer per backward. The lse gradient folds in because
    d lse / d S = P: it adds P * dlse to dS, the same as subtracting dlse from delta."""
    n_m = tl.cdiv(M, BLOCK_M)
    pid_m, hb = ranked(tl.program_id(0), n_m, tl.num_programs(0) // n_m, bucket)  # as the forward
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    head = hb % H_Q
    batch = (hb // H_Q).to(tl.int64)
    kv_head = head // GROUP_SIZE
    head = head.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dk2 = BLOCK_DK + tl.arange(0, BLOCK_DK2)
    offs_dv = tl.arange(0, BLOCK_DV)
    EVEN_DK: tl.constexpr = D_QK == BLOCK_DK or SPLIT_DK
    EVEN_DK2: tl.constexpr = D_QK == BLOCK_DK + BLOCK_DK2
    EVEN_DV: tl.constexpr = D_V == BLOCK_DV
    row_ok = offs_m < M

    q_rows = Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm
    q = _load(q_rows + offs_dk[None, :] * stride_qd, row_ok[:, None], offs_dk[None, :] < D_QK, True, not EVEN_DK)
    do = _load(
        DO + batch * stride_dob + head * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
        row_ok[:, None],
        offs_dv[None, :] < D_V,
        True,
        not EVEN_DV,
    )
    lse = tl.load(LSE + batch * stride_lb + head * stride_lh + offs_m * stride_lm, mask=row_ok, other=0.0)
    lse = lse * 1.4426950408889634
    o = _load(
        Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
        row_ok[:, None],
        offs_dv[None, :] < D_V,
        True,
        not EVEN_DV,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + batch * stride_gb + head * stride_gh + offs_m * stride_gm, mask=row_ok, other=0.0)
    tl.store(DELTA + (batch * H_Q + head) * M + offs_m, delta, mask=row_ok)
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    k_base = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch * stride_vb + kv_head.to(tl.int64) * stride_vh
    k_src = _rows_source(k_base, N, stride_kn, D_QK, BLOCK_N, BLOCK_DK, USE_TMA)
    v_src = _rows_source(v_base, N, stride_vn, D_V, BLOCK_N, BLOCK_DV, USE_TMA)
    k_offs = offs_n[:, None] * stride_kn + offs_dk[None, :] * stride_kd
    v_offs = offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    q2, dq2, k2_src, k2_offs = q, dq, k_src, k_offs  # placeholders when the head dim is one block
    if SPLIT_DK:
        q2 = _load(
            q_rows + offs_dk2[None, :] * stride_qd, row_ok[:, None], offs_dk2[None, :] < D_QK, True, not EVEN_DK2
        )
        dq2 = tl.zeros([BLOCK_M, BLOCK_DK2], tl.float32)
        k2_src = _rows_source(k_base, N, stride_kn, D_QK, BLOCK_N, BLOCK_DK2, USE_TMA)
        k2_offs = offs_n[:, None] * stride_kn + offs_dk2[None, :] * stride_kd

    q_shift = N - M
    if CAUSAL:
        n_end = tl.minimum(N, q_shift + start_m + BLOCK_M)
        n_full = tl.minimum((q_shift + start_m + 1) // BLOCK_N * BLOCK_N, N // BLOCK_N * BLOCK_N)
    else:
        n_end = N
        n_full = N // BLOCK_N * BLOCK_N
    dq, dq2 = _bwd_dq_inner(
        dq,
        dq2,
        q,
        q2,
        do,
        lse,
        delta,
        k_src,
        k2_src,
        v_src,
        k_offs,
        k2_offs,
        v_offs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_dk,
        offs_dk2,
        offs_dv,
        0,
        n_full,
        N,
        q_shift,
        qk_scale,
        False,
        CAUSAL,
        EVEN_DK,
        EVEN_DK2,
        EVEN_DV,
        SPLIT_DK,
        BLOCK_DK,
        D_QK,
        D_V,
        BLOCK_N,
        PRECISION,
        USE_TMA,
        INTERPRET,
    )
    dq, dq2 = _bwd_dq_inner(
        dq,
        dq2,
        q,
        q2,
        do,
        lse,
        delta,
        k_src,
        k2_src,
        v_src,
        k_offs,
        k2_offs,
        v_offs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_dk,
        offs_dk2,
        offs_dv,
        n_full,
        n_end,
        N,
        q_shift,
        qk_scale,
        True,
        CAUSAL,
        EVEN_DK,
        EVEN_DK2,
        EVEN_DV,
        SPLIT_DK,
        BLOCK_DK,
        D_QK,
        D_V,
        BLOCK_N,
        PRECISION,
        USE_TMA,
        INTERPRET,
    )
    dq_ptrs = DQ + batch * stride_dqb + head * stride_dqh + offs_m[:, None] * stride_dqm
    tl.store(
        dq_ptrs + offs_dk[None, :] * stride_dqd,
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dk[None, :] < D_QK),
    )
    if SPLIT_DK:
        tl.store(
            dq_ptrs + offs_dk2[None, :] * stride_dqd,
            (dq2 * scale).to(DQ.dtype.element_ty),
            mask=row_ok[:, None] & (offs_dk2[None, :] < D_QK),
        )
