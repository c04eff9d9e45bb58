/* AVX-512 tile decoders and dots kernel of cpu_experts.c (several tokens per matrix): a tile of rows
 * is decoded once into fp32 (decode_*_avx512), then every token multiplies it (dots_avx512). */

/* MXFP4 rows as fp32 in the prepared order: a span's 8 vectors are the row decoder's, each times its
 * per-lane scales (lanes 4g..4g+3: group g), so the products need no scaling; a row whose chunk
 * holds a scale of 0 or 255 takes the portable decoder (exact there too). */
T512 static void decode_mxfp4_avx512(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,
                                     int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld) {
    const int64_t G = K / BLOCK, spans = K / SPAN, sp1 = k1 / SPAN < spans ? k1 / SPAN : spans;
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m512i rep4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i low = _mm512_set1_epi32(0xF);
    float sc[MAX_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = w + n * G * BLOCK_BYTES, *scl = s + n * G;
        float *out = wb + (n - n0) * ld - k0;
        if (G > MAX_GROUPS || !mx512_scales(scl, k0 / BLOCK, k1 / BLOCK, sc)) {
            decode_mxfp4_portable(w, s, z, group, K, n, n + 1, k0, k1, out + k0, ld);
            continue;
        }
        for (int64_t sp = k0 / SPAN; sp < sp1; sp++) {
            __m512 scv = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(_mm_loadu_ps(sc + sp * 4)));
            __m512 wv[8];
            span_codes(blk + sp * 64, lut, wv);
            span_store(out + sp * SPAN, wv, scv);
        }
        for (int64_t g = k1 == K ? spans * 4 : G; g < G; g++) { /* the groups after the last whole span */
            __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + g * BLOCK_BYTES)));
            __m512 lut_s = _mm512_mul_ps(lut, _mm512_set1_ps(sc[g]));
            _mm512_storeu_ps(out + g * BLOCK, _mm512_permutexvar_ps(_mm512_and_si512(codes, low), lut_s));
            _mm512_storeu_ps(out + g * BLOCK + BLOCK_BYTES, _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut_s));
        }
    }
}

/* dense rows as fp32, 16 at a time (LOAD16 / LOADM: the row decoders' converters) */
#define DECODE512(NAME, TYPE, LOAD16, LOADM)                                                             \
    T512 static void decode_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,   \
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, \
                                   int64_t ld) {                                                        \
        (void)s, (void)z, (void)group;                                                                  \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            const TYPE *row = (const TYPE *)w + n * K;                                                  \
            float *out = wb + (n - n0) * ld - k0;                                                       \
            int64_t k = k0;                                                                             \
            for (; k + 16 <= k1; k += 16) _mm512_storeu_ps(out + k, LOAD16(row + k));                   \
            if (k < k1) {                                                                               \
                __mmask16 m = (__mmask16)((1u << (k1 - k)) - 1);                                        \
                _mm512_mask_storeu_ps(out + k, m, LOADM(m, row + k));                                   \
            }                                                                                           \
        }                                                                                               \
    }

DECODE512(bf16_avx512, uint16_t, bf16_load16, bf16_loadm)
DECODE512(f32_avx512, float, f32_load16, f32_loadm)
DECODE512(f16_avx512, uint16_t, f16_load16, f16_loadm)

/* 16 vectors -> one whose lane i is the sum of a[i]'s lanes (pairs, then quads, then 128-bit lanes) */
INLINE512 __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* per 128 bits: a[2i], a[2i+1], a[2i], a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128 bits: a[4i] .. a[4i+3] */
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes: a[8i..8i+3], a[8i..8i+3], a[8i+4..8i+7], a[8i+4..8i+7] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

#define DOT_ROWS 4   /* rows of a register block */
#define DOT_TOKENS 4 /* tokens of a register block: DOT_ROWS x DOT_TOKENS accumulators, sum16'd */
#define DOT_ACC ((DOT_ROWS * DOT_TOKENS + 15) / 16 * 16)

/* one register block: nr rows of the tile times nt tokens over len. Invariant: nr and nt are
 * literals at every call (dots_avx512's switch), so the loops unroll into registers. */
INLINE512 void dots512_block(const float *wb, int64_t ld, const float *xp, int64_t K, int64_t len, const int nr,
                             const int nt, float *y, int64_t ys) {
    __m512 acc[DOT_ACC];
    for (int i = 0; i < DOT_ACC; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
        __m512 wv[DOT_ROWS];
        for (int r = 0; r < nr; r++) wv[r] = _mm512_loadu_ps(wb + r * ld + k);
        for (int t = 0; t < nt; t++) {
            __m512 xv = _mm512_loadu_ps(xp + t * K + k);
            for (int r = 0; r < nr; r++) acc[t * DOT_ROWS + r] = _mm512_fmadd_ps(wv[r], xv, acc[t * DOT_ROWS + r]);
        }
    }
    if (k < len) {
        __mmask16 m = (__mmask16)((1u << (len - k)) - 1);
        for (int t = 0; t < nt; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, xp + t * K + k);
            for (int r = 0; r < nr; r++) {
                __m512 wv = _mm512_maskz_loadu_ps(m, wb + r * ld + k);
                acc[t * DOT_ROWS + r] = _mm512_fmadd_ps(wv, xv, acc[t * DOT_ROWS + r]);
            }
        }
    }
    float out[DOT_ACC];
    for (int i = 0; i < nt * DOT_ROWS; i += 16) _mm512_storeu_ps(out + i, sum16(acc + i));
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) y[t * ys + r] += out[t * DOT_ROWS + r];
}

#define DOTS_CASE(NR, NT) \
    case (NR) * 8 + (NT): dots512_block(wb + r0 * ld, ld, tx, K, len, NR, NT, ty + r0, ys); break;
#define DOTS_CASES(NR) DOTS_CASE(NR, 1) DOTS_CASE(NR, 2) DOTS_CASE(NR, 3) DOTS_CASE(NR, 4)

/* the tile times each group of DOT_TOKENS tokens (its activations stay in L1 while the tile's rows
 * go by), DOT_ROWS rows at a time */
T512 static void dots_avx512(const float *wb, int64_t ld, int64_t nr_all, const float *xp, int64_t K, int64_t nt_all,
                             int64_t len, float *y, int64_t ys) {
    for (int64_t t0 = 0; t0 < nt_all; t0 += DOT_TOKENS) {
        int nt = (int)(nt_all - t0 < DOT_TOKENS ? nt_all - t0 : DOT_TOKENS);
        const float *tx = xp + t0 * K;
        float *ty = y + t0 * ys;
        for (int64_t r0 = 0; r0 < nr_all; r0 += DOT_ROWS) {
            int nr = (int)(nr_all - r0 < DOT_ROWS ? nr_all - r0 : DOT_ROWS);
            switch (nr * 8 + nt) {
                DOTS_CASES(1) DOTS_CASES(2) DOTS_CASES(3) DOTS_CASES(4)
            }
        }
    }
}
