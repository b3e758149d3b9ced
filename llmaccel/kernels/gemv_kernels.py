"""The Triton kernels of llmaccel::gemv and llmaccel::gemv_int4 (kernels/gemv.py: the ops, their
configs and references): the fused GEMV over bf16/fp16 weights and over int4 codes, each with
its RMSNorm prologue, SiLU-mul and residual epilogues, programmatic dependent launch and
persistent programs."""
try:
    import triton
    import triton.language as tl
except ImportError:  # the ops' references (kernels/gemv.py) work without triton
    triton = None

if triton is not None:
    from triton.language.extra import cuda as _tl_cuda

    from llmaccel.kernels.int_codes import int4_tile, x8

    @triton.jit
    def _gemv_persist(wp, up, xp, W, BIAS, R, O, N_OUT, K, s_w, s_r, s_o, eps, m, pid, rk, n_ok,
                      HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                      GLU: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        """_gemv_kernel's PERSIST form: row tiles pid, pid + P, ...; x read once, each next tile
        loaded while the current one is reduced."""
        P = tl.num_programs(0)
        k_ok = rk < K
        w = tl.load(wp, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wu = w
        if GLU:
            wu = tl.load(up, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()
        x = tl.load(xp, mask=k_ok, other=0.0).to(tl.float32)
        r = 1.0
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
        for t in range(pid, tl.cdiv(N_OUT, BLOCK_N), P):
            rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N_OUT
            rn2 = rn + P * BLOCK_N
            m2 = (rn2 < N_OUT)[:, None] & k_ok[None, :]
            w2 = tl.load(W + rn2[:, None].to(tl.int64) * s_w + rk[None, :], mask=m2, other=0.0)
            y = tl.sum(w.to(tl.float32) * x[None, :], 1) * r
            u = y
            if GLU:
                wu2 = tl.load(W + (rn2 + N_OUT)[:, None].to(tl.int64) * s_w + rk[None, :],
                              mask=m2, other=0.0)
                u = tl.sum(wu.to(tl.float32) * x[None, :], 1) * r
                wu = wu2
            _gemv_out(y, u, rn, n_ok, m, BIAS, R, O, N_OUT, s_r, s_o, HAS_BIAS, HAS_RES, GLU)
            w = w2

    @triton.jit
    def _gemv_one_chunk(wp, up, xp, K, rk, n_ok, NORM: tl.constexpr, GLU: tl.constexpr,
                        PDL: tl.constexpr):
        """The whole of K in one tile: (rows' sums, the up rows' (GLU; else the same), x's sum of
        squares (NORM; else 0))."""
        k_ok = rk < K
        wm = n_ok[:, None] & k_ok[None, :]
        w = tl.load(wp, mask=wm, other=0.0)
        if GLU:
            wu = tl.load(up, mask=wm, other=0.0)
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()  # x (and the residual) come from the kernels before
        x = tl.load(xp, mask=k_ok, other=0.0).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
        u = y
        if GLU:
            u = tl.sum(wu.to(tl.float32) * x[None, :], 1)
        ss = 0.0
        if NORM:
            ss = tl.sum(x * x, 0)
        return y, u, ss

    @triton.jit
    def _gemv_chunks(wp, up, xp, K, rk, n_ok, NORM: tl.constexpr, GLU: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """_gemv_one_chunk's values over K in BLOCK_K chunks."""
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = acc
        if GLU:
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + rk < K
            wm = n_ok[:, None] & k_ok[None, :]
            x = tl.load(xp + k0, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(wp + k0, mask=wm, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            if GLU:
                wu = tl.load(up + k0, mask=wm, other=0.0)
                acc_u += wu.to(tl.float32) * x[None, :]
            if NORM:
                acc_ss += x * x
        y = tl.sum(acc, 1)
        u = y
        if GLU:
            u = tl.sum(acc_u, 1)
        return y, u, tl.sum(acc_ss, 0)

    @triton.jit
    def _gemv_kernel(X, W, BIAS, R, O, N_OUT, K, s_x, s_w, s_r, s_o, eps,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                     GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ONE_CHUNK: tl.constexpr, PDL: tl.constexpr, PERSIST: tl.constexpr = False):
        """PERSIST (whole K in one tile only): program p owns row tiles p, p + P, ..., reads x
        once and loads its next tile while it reduces the current one."""
        pid = tl.program_id(0)
        m = tl.program_id(1)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N_OUT
        wp = W + rn[:, None].to(tl.int64) * s_w + rk[None, :]
        up = W + (rn + N_OUT)[:, None].to(tl.int64) * s_w + rk[None, :]  # glu: the up rows
        xp = X + m.to(tl.int64) * s_x + rk
        if PERSIST:
            _gemv_persist(wp, up, xp, W, BIAS, R, O, N_OUT, K, s_w, s_r, s_o, eps, m, pid, rk, n_ok,
                          HAS_BIAS, HAS_RES, NORM, GLU, BLOCK_N, PDL)
        else:
            if ONE_CHUNK:
                y, u, ss = _gemv_one_chunk(wp, up, xp, K, rk, n_ok, NORM, GLU, PDL)
            else:
                y, u, ss = _gemv_chunks(wp, up, xp, K, rk, n_ok, NORM, GLU, BLOCK_N, BLOCK_K, PDL)
            if NORM:
                r = tl.rsqrt(ss / K + eps)
                y = y * r
                u = u * r
            _gemv_out(y, u, rn, n_ok, m, BIAS, R, O, N_OUT, s_r, s_o, HAS_BIAS, HAS_RES, GLU)

    @triton.jit
    def _codes8(w, z):
        """The 8 codes of each int32 word (column 8j + i in nibble i) minus z, as exact fp32:
        the magic exponent of 2^23 is ORed in once per word for nibbles 0-4 and once for 5-7
        (shifted down by 12), so each code costs one AND (the magic bits kept by its mask) and
        one FMA that removes 2^23 * 16^i and z and shifts the code into place."""
        wl = (w & 0xFFFFF) | 0x4B000000
        wh = ((w >> 12) & 0xFFF00) | 0x4B000000
        n0 = tl.fma((wl & 0x4B00000F).to(tl.float32, bitcast=True), 1.0, -8388608.0 - z)
        n1 = tl.fma((wl & 0x4B0000F0).to(tl.float32, bitcast=True), 0.0625, -524288.0 - z)
        n2 = tl.fma((wl & 0x4B000F00).to(tl.float32, bitcast=True), 0.00390625, -32768.0 - z)
        n3 = tl.fma((wl & 0x4B00F000).to(tl.float32, bitcast=True), 0.000244140625, -2048.0 - z)
        n4 = tl.fma((wl & 0x4B0F0000).to(tl.float32, bitcast=True), 0.0000152587890625, -128.0 - z)
        n5 = tl.fma((wh & 0x4B000F00).to(tl.float32, bitcast=True), 0.00390625, -32768.0 - z)
        n6 = tl.fma((wh & 0x4B00F000).to(tl.float32, bitcast=True), 0.000244140625, -2048.0 - z)
        n7 = tl.fma((wh & 0x4B0F0000).to(tl.float32, bitcast=True), 0.0000152587890625, -128.0 - z)
        return n0, n1, n2, n3, n4, n5, n6, n7

    @triton.jit
    def _int4_dot(w, s, z, x0, x1, x2, x3, x4, x5, x6, x7):
        """sum over the tile's groups of s * sum (q - z) x, per row; x_i holds the columns of
        nibble i (column 8j + i of word j), (groups, GS / 8)."""
        n0, n1, n2, n3, n4, n5, n6, n7 = _codes8(w, z[:, :, None])
        t = n0 * x0[None] + n1 * x1[None] + n2 * x2[None] + n3 * x3[None] \
            + n4 * x4[None] + n5 * x5[None] + n6 * x6[None] + n7 * x7[None]
        return tl.sum(tl.sum(s[:, :, None] * t, 2), 1)

    @triton.jit
    def _sumsq8(x0, x1, x2, x3, x4, x5, x6, x7):
        return tl.sum(tl.sum(((x0 * x0 + x1 * x1) + (x2 * x2 + x3 * x3))
                             + ((x4 * x4 + x5 * x5) + (x6 * x6 + x7 * x7)), 1), 0)

    @triton.jit
    def _gemv_out(y, u, rn, n_ok, m, BIAS, R, O, N_OUT, s_r, s_o, HAS_BIAS: tl.constexpr,
                  HAS_RES: tl.constexpr, GLU: tl.constexpr):
        """Bias, SiLU-mul (u: the up rows' sums) and residual on a tile's row sums (norm
        applied), then the store."""
        if HAS_BIAS:
            y += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)
            if GLU:
                u += tl.load(BIAS + N_OUT + rn, mask=n_ok, other=0.0).to(tl.float32)
        if GLU:
            y = y / (1.0 + tl.exp(-y)) * u
        if HAS_RES:
            y += tl.load(R + m.to(tl.int64) * s_r + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(O + m.to(tl.int64) * s_o + rn, y.to(O.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _int4_tiles_then_wait(W, S, Z, rn, n_ok, rg, g_ok, G, ZB, N_OUT, GS: tl.constexpr,
                              GLU: tl.constexpr, PDL: tl.constexpr):
        """A row tile's words, scales and zero points (and its up rows' with GLU; else the same
        again), loaded before the wait for the kernel before (PDL), which writes x and the
        residual."""
        w, s, z = int4_tile(W, S, Z, rn.to(tl.int64), n_ok, rg, g_ok, G, ZB, GS)
        wu, su, zu = w, s, z
        if GLU:
            wu, su, zu = int4_tile(W, S, Z, (rn + N_OUT).to(tl.int64), n_ok, rg, g_ok, G, ZB, GS)
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()
        return w, s, z, wu, su, zu

    @triton.jit
    def _int4_one_chunk(W, S, Z, BIAS, R, O, N_OUT, K, G, ZB, s_r, s_o, eps, pid, P, m, n_tiles, ar,
                     rg, xrow, GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     NORM: tl.constexpr, GLU: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr, PDL: tl.constexpr):
        """_gemv_int4_kernel with all groups in one chunk: the next tile's words loaded while
        this one's are reduced, the first tile's before the wait."""
        g_ok = rg < G
        rn = pid * BLOCK_N + ar
        n_ok = rn < N_OUT
        w, s, z, wu, su, zu = _int4_tiles_then_wait(W, S, Z, rn, n_ok, rg, g_ok, G, ZB, N_OUT, GS,
                                                     GLU, PDL)
        x0, x1, x2, x3, x4, x5, x6, x7 = x8(xrow, rg, g_ok, K, GS)
        r = 1.0
        if NORM:
            r = tl.rsqrt(_sumsq8(x0, x1, x2, x3, x4, x5, x6, x7) / K + eps)
        for t in range(pid, n_tiles, P):
            rn = t * BLOCK_N + ar
            n_ok = rn < N_OUT
            rn2 = rn + P * BLOCK_N  # the next tile of this program (masked past the end)
            ok2 = rn2 < N_OUT
            w2, s2, z2 = int4_tile(W, S, Z, rn2.to(tl.int64), ok2, rg, g_ok, G, ZB, GS)
            y = _int4_dot(w, s, z, x0, x1, x2, x3, x4, x5, x6, x7) * r
            u = y
            if GLU:
                wu2, su2, zu2 = int4_tile(W, S, Z, (rn2 + N_OUT).to(tl.int64), ok2, rg, g_ok, G, ZB, GS)
                u = _int4_dot(wu, su, zu, x0, x1, x2, x3, x4, x5, x6, x7) * r
                wu, su, zu = wu2, su2, zu2
            _gemv_out(y, u, rn, n_ok, m, BIAS, R, O, N_OUT, s_r, s_o, HAS_BIAS, HAS_RES, GLU)
            w, s, z = w2, s2, z2

    @triton.jit
    def _int4_chunks(W, S, Z, BIAS, R, O, N_OUT, K, G, ZB, s_r, s_o, eps, pid, P, m, n_tiles, ar,
                     rg, xrow, GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     NORM: tl.constexpr, GLU: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr, PDL: tl.constexpr):
        """_gemv_int4_kernel over the groups in BLOCK_G chunks."""
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()
        r = 1.0
        if NORM:
            ss = 0.0
            for g0 in range(0, G, BLOCK_G):
                g = g0 + rg
                x0, x1, x2, x3, x4, x5, x6, x7 = x8(xrow, g, g < G, K, GS)
                ss += _sumsq8(x0, x1, x2, x3, x4, x5, x6, x7)
            r = tl.rsqrt(ss / K + eps)
        for t in range(pid, n_tiles, P):
            rn = t * BLOCK_N + ar
            n_ok = rn < N_OUT
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            u = tl.zeros([BLOCK_N], dtype=tl.float32)
            for g0 in range(0, G, BLOCK_G):
                g = g0 + rg
                g_ok = g < G
                x0, x1, x2, x3, x4, x5, x6, x7 = x8(xrow, g, g_ok, K, GS)
                w, s, z = int4_tile(W, S, Z, rn.to(tl.int64), n_ok, g, g_ok, G, ZB, GS)
                y += _int4_dot(w, s, z, x0, x1, x2, x3, x4, x5, x6, x7)
                if GLU:
                    wu, su, zu = int4_tile(W, S, Z, (rn + N_OUT).to(tl.int64), n_ok, g, g_ok, G, ZB, GS)
                    u += _int4_dot(wu, su, zu, x0, x1, x2, x3, x4, x5, x6, x7)
            _gemv_out(y * r, u * r, rn, n_ok, m, BIAS, R, O, N_OUT, s_r, s_o, HAS_BIAS,
                      HAS_RES, GLU)

    @triton.jit
    def _gemv_int4_kernel(X, W, S, Z, BIAS, R, O, N_OUT, K, G, ZB, s_x, s_r, s_o, eps,
                          GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                          NORM: tl.constexpr, GLU: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_G: tl.constexpr, ONE_CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Persistent over row tiles (tile t, t + P, ...): x is read once per program, and with
        all groups in one chunk the next tile's words are loaded while this one's are reduced
        (two tiles in registers); the first tile's are loaded before the wait."""
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        m = tl.program_id(1)
        n_tiles = tl.cdiv(N_OUT, BLOCK_N)
        ar = tl.arange(0, BLOCK_N)
        rg = tl.arange(0, BLOCK_G)
        xrow = X + m.to(tl.int64) * s_x
        if ONE_CHUNK:
            _int4_one_chunk(W, S, Z, BIAS, R, O, N_OUT, K, G, ZB, s_r, s_o, eps, pid, P, m, n_tiles,
                            ar, rg, xrow, GS, HAS_BIAS, HAS_RES, NORM, GLU, BLOCK_N, BLOCK_G, PDL)
        else:
            _int4_chunks(W, S, Z, BIAS, R, O, N_OUT, K, G, ZB, s_r, s_o, eps, pid, P, m, n_tiles,
                         ar, rg, xrow, GS, HAS_BIAS, HAS_RES, NORM, GLU, BLOCK_N, BLOCK_G, PDL)
