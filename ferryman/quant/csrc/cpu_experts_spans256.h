/* int4 with AVX2 in 128-value spans, the order prep_spans (cpu_experts.c) gives the activations, as
 * cpu_experts_spans512.h reads it: a span is two 32-byte halves, dword lane d of half h holding values
 * 64h + 8d .. 64h + 8d + 7, whose activations sit at 16j + 8h + d of the span for code j. Shifting the
 * lanes by 4j and masking gives code j of every lane; converted, minus 8 (sym) or the lane's zero
 * (asym), it is exact; each lane's products are summed, then times the lane's group scale. */

#ifdef FM_X86
typedef struct {
    int64_t gs, g, bound; /* group size; the group of the half's first value and where it ends */
    int shift, n;         /* groups dividing a half: log2(gs), and 64 / gs of them per half */
    __m256i idx, mask;    /* lane d's group within the half's first n, and the first n lanes */
} half_groups_t;

INLINE256 half_groups_t half_groups_at(int64_t gs, int64_t k) {
    half_groups_t hg = {gs, k / gs, (k / gs + 1) * gs, 0, 0, _mm256_setzero_si256(), _mm256_setzero_si256()};
    if (64 % gs == 0) {
        hg.shift = __builtin_ctzll((unsigned long long)gs), hg.n = (int)(64 / gs);
        hg.idx = _mm256_srlv_epi32(_mm256_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56), _mm256_set1_epi32(hg.shift));
        hg.mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(hg.n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    return hg;
}

/* n (1, 2, 4 or 8) zero points from z as 8 int32 lanes (the first n of them) */
INLINE256 __m256i zeros_n(const uint8_t *z, int n) {
    uint64_t b = 0;
    switch (n) {
    case 1: b = z[0]; break;
    case 2: { uint16_t v; memcpy(&v, z, 2); b = v; break; }
    case 4: { uint32_t v; memcpy(&v, z, 4); b = v; break; }
    default: memcpy(&b, z, 8); break;
    }
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)b));
}

/* the scales (and zeros, as floats) of the half at k, per lane; k grows by 64 from call to call */
INLINE256 void half_scales(half_groups_t *hg, const float *scl, const uint8_t *zr, int64_t k, __m256 *scv,
                           __m256 *zv) {
    if (hg->n) { /* several whole groups per half */
        const int64_t g0 = k >> hg->shift;
        *scv = _mm256_permutevar8x32_ps(_mm256_maskload_ps(scl + g0, hg->mask), hg->idx);
        if (zr) *zv = _mm256_permutevar8x32_ps(_mm256_cvtepi32_ps(zeros_n(zr + g0, hg->n)), hg->idx);
        return;
    }
    while (k >= hg->bound) hg->g++, hg->bound += hg->gs;
    if (k + 64 <= hg->bound) { /* the half lies in one group */
        *scv = _mm256_set1_ps(scl[hg->g]);
        if (zr) *zv = _mm256_set1_ps((float)zr[hg->g]);
        return;
    }
    float sc[8], ze[8];
    int64_t g = hg->g, bound = hg->bound; /* groups of other sizes: lane by lane */
    for (int d = 0; d < 8; d++) {
        while (k + 8 * d >= bound) g++, bound += hg->gs;
        sc[d] = scl[g], ze[d] = zr ? (float)zr[g] : 0.0f;
    }
    *scv = _mm256_loadu_ps(sc);
    if (zr) *zv = _mm256_loadu_ps(ze);
}

/* a half's 8 vectors of weights (q - zero), unscaled */
INLINE256 void int4_half_codes(const uint8_t *half, const __m256 zv, __m256 *wv) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)half), m4 = _mm256_set1_epi32(0xF);
    wv[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, m4));
    wv[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), m4));
    wv[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), m4));
    wv[3] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 12), m4));
    wv[4] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), m4));
    wv[5] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 20), m4));
    wv[6] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 24), m4));
    wv[7] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
    for (int j = 0; j < 8; j++) wv[j] = _mm256_sub_ps(wv[j], zv);
}

INLINE256 void int4span256_row_nt(int bits, const uint8_t *row, const float *scl, const uint8_t *zr, int64_t gs,
                                  int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt, float *out) {
    const int64_t whole = K / SPAN * SPAN, ks = k1 < whole ? k1 : whole;
    __m256 acc[TILE], zv = _mm256_set1_ps(8.0f), scv; /* sym: the zero is 8 */
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    half_groups_t hg = half_groups_at(gs, k0);
    for (int64_t k = k0; k < ks; k += SPAN) {
        _mm_prefetch((const char *)(row + k / 2 + PREFETCH_AHEAD), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            half_scales(&hg, scl, zr, k + 64 * h, &scv, &zv);
            __m256 wv[8];
            int4_half_codes(row + k / 2 + 32 * h, zv, wv);
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                const float *xs = xp + t * K + k + 8 * h;
                __m256 a = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xs));
                __m256 b = _mm256_mul_ps(wv[1], _mm256_loadu_ps(xs + 16));
                a = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xs + 32), a);
                b = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xs + 48), b);
                a = _mm256_fmadd_ps(wv[4], _mm256_loadu_ps(xs + 64), a);
                b = _mm256_fmadd_ps(wv[5], _mm256_loadu_ps(xs + 80), b);
                a = _mm256_fmadd_ps(wv[6], _mm256_loadu_ps(xs + 96), a);
                b = _mm256_fmadd_ps(wv[7], _mm256_loadu_ps(xs + 112), b);
                acc[t] = _mm256_fmadd_ps(_mm256_add_ps(a, b), scv, acc[t]);
            }
        }
    }
    float tail[TILE] = {0};
    if (ks < k1) int256_row_nt(bits, row, scl, zr, gs, ks, k1, xp, K, nt, tail); /* the values after the spans */
    for (int t = 0; t < nt; t++) out[t] = hsum256(acc[t]) + tail[t];
}

INT_ROWS(int4span_avx2, T256, 4, int4span256_row_nt)

/* int4 tiles with AVX2 in prep_spans's order: each span's weights (q - zero) x scale (the portable
 * decoder's values, one rounding), the values after the last span in element order */
T256 static void decode_int4span_avx2(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,
                                      int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb,
                                      int64_t ld) {
    const int64_t gs = group > 0 ? group : K, G = K / gs, whole = K / SPAN * SPAN, ks = k1 < whole ? k1 : whole;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * (K / 2), *zr = z ? z + n * G : NULL;
        const float *scl = (const float *)s + n * G;
        float *out = wb + (n - n0) * ld - k0;
        __m256 zv = _mm256_set1_ps(8.0f), scv;
        half_groups_t hg = half_groups_at(gs, k0);
        for (int64_t k = k0; k < ks; k += SPAN)
            for (int h = 0; h < 2; h++) {
                half_scales(&hg, scl, zr, k + 64 * h, &scv, &zv);
                __m256 wv[8];
                int4_half_codes(row + k / 2 + 32 * h, zv, wv);
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + k + 16 * j + 8 * h, _mm256_mul_ps(wv[j], scv));
            }
        if (ks < k1) int_rows(4, w, s, z, group, K, n, n + 1, ks, k1, out + ks, ld);
    }
}
#else
#define rows_int4span_avx2 NULL
#define decode_int4span_avx2 decode_int4_portable
#endif
