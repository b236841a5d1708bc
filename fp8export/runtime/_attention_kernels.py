"""The Triton kernels of ``fp8_attention.py`` (imported only where Triton is installed: Triton
resolves the helpers a kernel calls among its module's globals)."""

import triton
import triton.language as tl


@triton.jit
def _round_e4m3(x):
    # round-to-nearest-even onto the E4M3 grid (|x| <= 448): 3 mantissa bits, exponents
    # from -6 (subnormals below), by exact power-of-two arithmetic
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = tl.exp2((tl.maximum(e, -6) - 3).to(tl.float32))
    t = x / ulp
    f = tl.floor(t)
    rest = t - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (rest > 0.5) | ((rest == 0.5) & odd)
    return (f + tl.where(up, 1.0, 0.0)) * ulp

@triton.jit
def _e4m3(x, EXACT: tl.constexpr):
    y = tl.clamp(x, -448.0, 448.0)
    if EXACT:
        y = _round_e4m3(y)
    return y.to(tl.float8e4nv)

@triton.jit
def _attend(acc, m_i, l_i, q8, row_scale, qi, r_ok, k_base, v_base, mask_ptr, ks, vs, start_n,
            Tk, skt, skd, svt, svd, d, d_ok, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
            KV_FP8: tl.constexpr, P_FP8: tl.constexpr, EXACT: tl.constexpr):
    """One block of BLOCK_N keys into the online softmax (MASKED: a block that the causal or
    window bound or the end of the keys cuts; the padded-key mask applies to every block)."""
    n = start_n + tl.arange(0, BLOCK_N)
    n_ok = n < Tk
    if MASKED:
        k = tl.load(k_base + n[:, None].to(tl.int64) * skt + d[None, :] * skd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        vt = tl.load(v_base + d[:, None] * svd + n[None, :].to(tl.int64) * svt,
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    else:
        k = tl.load(k_base + n[:, None].to(tl.int64) * skt + d[None, :] * skd,
                    mask=d_ok[None, :], other=0.0)
        vt = tl.load(v_base + d[:, None] * svd + n[None, :].to(tl.int64) * svt,
                     mask=d_ok[:, None], other=0.0)
    if not KV_FP8:  # 16-bit keys and values: stored as the FP8 cache would store them
        k = _e4m3(tl.math.div_rn(k.to(tl.float32), ks), EXACT)
        vt = _e4m3(tl.math.div_rn(vt.to(tl.float32), vs), EXACT)
    # promote the FP8 products to fp32 after every 32 (Hopper's FP8 accumulation is narrower)
    s = tl.dot(q8, tl.trans(k), max_num_imprecise_acc=32) * row_scale[:, None]
    if MASKED:
        ok = n_ok[None, :] & r_ok[:, None]
        if CAUSAL:
            ok = ok & (n[None, :] <= qi[:, None])
        if WINDOW > 0:
            ok = ok & (qi[:, None] - n[None, :] < WINDOW)
        if HAS_MASK:
            km = tl.load(mask_ptr + n, mask=n_ok, other=0)
            ok = ok & (km != 0)[None, :]
        s = tl.where(ok, s, float("-inf"))
    elif HAS_MASK:  # a block no causal or window bound cuts: only padded keys to drop
        km = tl.load(mask_ptr + n)
        s = tl.where((km != 0)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = tl.trans(vt)
    if P_FP8:
        acc = tl.dot(_e4m3(p * 256.0, EXACT), v, acc, max_num_imprecise_acc=32)
    elif EXACT:  # the interpreter's bf16 dot is wrong (triton 3.6): the same product in fp32
        acc = tl.dot(p.to(tl.bfloat16).to(tl.float32), v.to(tl.float32), acc,
                     input_precision="ieee")
    else:
        acc = tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16), acc)
    return acc, m_new, l_i


@triton.jit
def fp8_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, mask_ptr, qstart_ptr,
                         q_start, Tq, Tk, G, Hkv, c_log2,
                         sqb, sqh, sqt, skb, skh, skt, skd, svb, svh, svt, svd, sob, sot, soh,
                         smb,
                         D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                         HAS_MASK: tl.constexpr, QSTART_PTR: tl.constexpr,
                         KV_FP8: tl.constexpr, P_FP8: tl.constexpr, EXACT: tl.constexpr):
    # causal: the last query blocks read the most keys; start them first
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    hkv = bh % Hkv
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < G * Tq
    t = r % Tq
    hq = hkv * G + r // Tq
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(q_ptr + b * sqb + hq[:, None].to(tl.int64) * sqh
                + t[:, None].to(tl.int64) * sqt + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(q), axis=1)
    # correctly rounded divisions wherever a quotient is then rounded to E4M3: Triton's `/` is
    # the approximate div.full.f32 (2 ulp), which lands exact E4M3 ties (frequent with bf16
    # inputs) on either side, so the operands would differ from the emulation's
    sq = tl.where(amax > 0.0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)),
                  1.0)
    q8 = _e4m3(tl.math.div_rn(q, sq[:, None]), EXACT)
    ks = tl.load(ks_ptr + hkv)
    vs = tl.load(vs_ptr + hkv)
    row_scale = sq * (ks * c_log2)
    if QSTART_PTR:
        qi = tl.load(qstart_ptr).to(tl.int32) + t
    else:
        qi = q_start + t
    # keys [lo, full) need no mask for any row of the block; [full, hi) are masked
    hi = Tk
    full = (Tk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(tl.where(r_ok, qi, -1)) + 1)
        full = tl.minimum(full, ((tl.min(tl.where(r_ok, qi, 2147483647)) + 1) // BLOCK_N)
                          * BLOCK_N)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(tl.min(tl.where(r_ok, qi, 2147483647)) - WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_base = k_ptr + b * skb + hkv.to(tl.int64) * skh
    v_base = v_ptr + b * svb + hkv.to(tl.int64) * svh
    mask_row = mask_ptr + b * smb
    if WINDOW > 0:
        full = lo
    for start_n in range(lo, full, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q8, row_scale, qi, r_ok, k_base, v_base,
                                mask_row, ks, vs, start_n, Tk, skt, skd, svt, svd, d, d_ok,
                                BLOCK_N, False, CAUSAL, WINDOW, HAS_MASK, KV_FP8, P_FP8, EXACT)
    for start_n in range(tl.maximum(full, lo), hi, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q8, row_scale, qi, r_ok, k_base, v_base,
                                mask_row, ks, vs, start_n, Tk, skt, skd, svt, svd, d, d_ok,
                                BLOCK_N, True, CAUSAL, WINDOW, HAS_MASK, KV_FP8, P_FP8, EXACT)
    if P_FP8:
        vs = vs * 0.00390625  # 1 / P_SCALE, exact
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = tl.where((l_i > 0.0)[:, None], tl.math.div_rn(acc * vs, l_safe[:, None]), 0.0)
    out = out_ptr + b * sob + t[:, None].to(tl.int64) * sot + hq[:, None].to(tl.int64) * soh \
        + d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def kv_write_kernel(k_ptr, v_ptr, ks_ptr, vs_ptr, kc_ptr, vc_ptr, start_ptr, start, Tn, Tmax,
                    Hkv, skb, skh, skt, svb, svh, svt, kcb, kch, kct, vcb, vch, vcd,
                    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                    START_PTR: tl.constexpr, EXACT: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    h = (bh % Hkv).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D_PAD)
    if START_PTR:
        pos = tl.load(start_ptr).to(tl.int32) + t
    else:
        pos = start + t
    ok = ((t < Tn) & (pos < Tmax))[:, None] & (d < D)[None, :]
    ks = tl.load(ks_ptr + h)
    vs = tl.load(vs_ptr + h)
    k = tl.load(k_ptr + b * skb + h * skh + t[:, None].to(tl.int64) * skt + d[None, :],
                mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * svb + h * svh + t[:, None].to(tl.int64) * svt + d[None, :],
                mask=ok, other=0.0).to(tl.float32)
    # correctly rounded, as the torch write divides (see fp8_attention_kernel)
    tl.store(kc_ptr + b * kcb + h * kch + pos[:, None].to(tl.int64) * kct + d[None, :],
             _e4m3(tl.math.div_rn(k, ks), EXACT), mask=ok)
    tl.store(vc_ptr + b * vcb + h * vch + d[None, :].to(tl.int64) * vcd + pos[:, None],
             _e4m3(tl.math.div_rn(v, vs), EXACT), mask=ok)
