/* AVX2 tile decoders and dots kernel of cpu_experts.c: the AVX-512 ones' (cpu_experts_tiles512.h)
 * with 8-lane vectors and 16 registers. */

/* MXFP4 rows as fp32 in the prepared order (a span's two 32-byte halves, e2m1x8), each weight
 * times its group's scale; rows with a scale of 0 or 255: the portable decoder */
T256 static void decode_mxfp4_avx2(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld) {
    const int64_t G = K / BLOCK, spans = K / SPAN, sp1 = k1 / SPAN < spans ? k1 / SPAN : spans;
    const __m256 mag = _mm256_loadu_ps(E2M1);
    const __m256i eight = _mm256_set1_epi32(8);
    float sc[MAX_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = w + n * G * BLOCK_BYTES, *scl = s + n * G;
        float *out = wb + (n - n0) * ld - k0;
        if (G > MAX_GROUPS || !mx256_scales(scl, k0 / BLOCK, k1 / BLOCK, sc)) {
            decode_mxfp4_portable(w, s, z, group, K, n, n + 1, k0, k1, out + k0, ld);
            continue;
        }
        for (int64_t sp = k0 / SPAN; sp < sp1; sp++)
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + sp * 64 + h * 32));
                const float *s2 = sc + sp * 4 + h * 2;
                __m256 scv = _mm256_set_m128(_mm_set1_ps(s2[1]), _mm_set1_ps(s2[0]));
                for (int j = 0; j < 8; j++) {
                    _mm256_storeu_ps(out + sp * SPAN + j * 16 + h * 8, _mm256_mul_ps(e2m1x8(v, j, mag, eight), scv));
                }
            }
        for (int64_t g = k1 == K ? spans * 4 : G; g < G; g++) /* the groups after the last whole span */
            for (int j = 0; j < BLOCK_BYTES; j++) {
                uint8_t code = blk[g * BLOCK_BYTES + j];
                out[g * BLOCK + j] = E2M1[code & 0xF] * sc[g];
                out[g * BLOCK + BLOCK_BYTES + j] = E2M1[code >> 4] * sc[g];
            }
    }
}

#define DECODE256(NAME, TYPE, LOAD8, SCALAR)                                                             \
    T256 static void decode_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,   \
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, \
                                   int64_t ld) {                                                        \
        (void)s, (void)z, (void)group;                                                                  \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            const TYPE *row = (const TYPE *)w + n * K;                                                  \
            float *out = wb + (n - n0) * ld - k0;                                                       \
            int64_t k = k0;                                                                             \
            for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(out + k, LOAD8(row + k));                      \
            for (; k < k1; k++) out[k] = SCALAR(row[k]);                                                \
        }                                                                                               \
    }

DECODE256(bf16_avx2, uint16_t, bf16_load8, bf16_scalar)
DECODE256(f32_avx2, float, f32_load8, f32_scalar)
DECODE256(f16_avx2, uint16_t, f16_load8, half_float)

/* 8 vectors -> one whose lane i is the sum of a[i]'s lanes */
INLINE256 __m256 sum8(const __m256 *a) {
    __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3])); /* a0..a3 per half */
    __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7])); /* a4..a7 per half */
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

#define DOT2_ROWS 4   /* rows of a register block */
#define DOT2_TOKENS 2 /* tokens of a register block: 8 accumulators, one sum8 */

/* one register block: nr rows of the tile times nt tokens over len. Invariant: nr and nt are
 * literals at every call (dots_avx2's switch). */
INLINE256 void dots256_block(const float *wb, int64_t ld, const float *xp, int64_t K, int64_t len, const int nr,
                             const int nt, float *y, int64_t ys) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= len; k += 8) {
        __m256 wv[DOT2_ROWS];
        for (int r = 0; r < nr; r++) wv[r] = _mm256_loadu_ps(wb + r * ld + k);
        for (int t = 0; t < nt; t++) {
            __m256 xv = _mm256_loadu_ps(xp + t * K + k);
            for (int r = 0; r < nr; r++) acc[t * DOT2_ROWS + r] = _mm256_fmadd_ps(wv[r], xv, acc[t * DOT2_ROWS + r]);
        }
    }
    float out[8];
    _mm256_storeu_ps(out, sum8(acc));
    for (; k < len; k++)
        for (int t = 0; t < nt; t++)
            for (int r = 0; r < nr; r++) out[t * DOT2_ROWS + r] += wb[r * ld + k] * xp[t * K + k];
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) y[t * ys + r] += out[t * DOT2_ROWS + r];
}

#define DOTS2_CASE(NR, NT) \
    case (NR) * 8 + (NT): dots256_block(wb + r0 * ld, ld, tx, K, len, NR, NT, ty + r0, ys); break;
#define DOTS2_CASES(NR) DOTS2_CASE(NR, 1) DOTS2_CASE(NR, 2)

T256 static void dots_avx2(const float *wb, int64_t ld, int64_t nr_all, const float *xp, int64_t K, int64_t nt_all,
                           int64_t len, float *y, int64_t ys) {
    for (int64_t t0 = 0; t0 < nt_all; t0 += DOT2_TOKENS) {
        int nt = (int)(nt_all - t0 < DOT2_TOKENS ? nt_all - t0 : DOT2_TOKENS);
        const float *tx = xp + t0 * K;
        float *ty = y + t0 * ys;
        for (int64_t r0 = 0; r0 < nr_all; r0 += DOT2_ROWS) {
            int nr = (int)(nr_all - r0 < DOT2_ROWS ? nr_all - r0 : DOT2_ROWS);
            switch (nr * 8 + nt) {
                DOTS2_CASES(1) DOTS2_CASES(2) DOTS2_CASES(3) DOTS2_CASES(4)
            }
        }
    }
}
