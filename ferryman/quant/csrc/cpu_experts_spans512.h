/* int4 and NVFP4 with AVX-512 in 128-value spans: row decoders for few tokens and tile decoders, in
 * the order prep_spans (cpu_experts.c) gives the activations. Both formats' bytes are MXFP4's (byte
 * j: value 2j in the low nibble, 2j + 1 in the high one), so one 64-byte load is a span's 128 codes,
 * dword lane d holding values 8d..8d+7, and shifting the lanes by 4j puts code j of every lane under
 * vpermps's 4 index bits: 8 permutes of a 16-entry table decode the span unscaled; each lane's
 * products are summed, then times the lane's scale (a lane's 8 values share one: int4 groups are
 * multiples of 8, NVFP4's are 16). A weight's contribution is ((code value) x) x scale: exactly the
 * dequantised weight for x = 1. */

#ifdef FM_X86
/* int4: the table of q - 8 (sym) or q (asym: minus the lane's zero after the lookup); lane scales
 * from the groups, however they fall on the span */
typedef struct {
    int64_t gs, g, bound; /* group size; the group of the span's first value and where it ends */
    int shift;            /* groups dividing a span: log2(gs) */
    __m512i idx;          /* and lane d's group within the span's first 128 / gs */
} span_groups_t;

INLINE512 span_groups_t span_groups_at(int64_t gs, int64_t k) {
    span_groups_t sg = {gs, k / gs, (k / gs + 1) * gs, 0, _mm512_setzero_si512()};
    if (SPAN % gs == 0) {
        sg.shift = __builtin_ctzll((unsigned long long)gs);
        sg.idx = _mm512_srli_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120),
                                   sg.shift);
    }
    return sg;
}

/* the scales (and zeros, as floats) of the span at k, per lane; k grows by SPAN from call to call */
INLINE512 void span_scales(span_groups_t *sg, const float *scl, const uint8_t *zr, int64_t k, __m512 *scv,
                           __m512 *zv) {
    if (SPAN % sg->gs == 0) { /* several whole groups per span: 128 / gs of them */
        const int64_t g0 = k >> sg->shift;
        const __mmask16 m = (__mmask16)((1u << (SPAN >> sg->shift)) - 1u);
        *scv = _mm512_permutexvar_ps(sg->idx, _mm512_maskz_loadu_ps(m, scl + g0));
        if (zr) {
            const __m512i z = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, zr + g0));
            *zv = _mm512_permutexvar_ps(sg->idx, _mm512_cvtepi32_ps(z));
        }
        return;
    }
    while (k >= sg->bound) sg->g++, sg->bound += sg->gs;
    if (k + SPAN <= sg->bound) { /* the span lies in one group */
        *scv = _mm512_set1_ps(scl[sg->g]);
        if (zr) *zv = _mm512_set1_ps((float)zr[sg->g]);
        return;
    }
    float sc[16], ze[16]; /* groups of other sizes (96, 192, ...): lane by lane */
    int64_t g = sg->g, bound = sg->bound;
    for (int d = 0; d < 16; d++) {
        while (k + 8 * d >= bound) g++, bound += sg->gs;
        sc[d] = scl[g], ze[d] = zr ? (float)zr[g] : 0.0f;
    }
    *scv = _mm512_loadu_ps(sc);
    if (zr) *zv = _mm512_loadu_ps(ze);
}

/* the span's 8 vectors of weights (q - zero), unscaled, in prep_span's order */
INLINE512 void int4_span_codes(const uint8_t *blk, const __m512 lut, const uint8_t *zr, const __m512 zv, __m512 *wv) {
    span_codes(blk, lut, wv);
    if (zr)
        for (int j = 0; j < 8; j++) wv[j] = _mm512_sub_ps(wv[j], zv);
}

/* the table of q (asym) or q - 8 (sym) for q = 0..15 */
INLINE512 __m512 int4_table(const uint8_t *zr) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return zr ? iota : _mm512_sub_ps(iota, _mm512_set1_ps(8.0f));
}

INLINE512 void int4span512_row_nt(int bits, const uint8_t *row, const float *scl, const uint8_t *zr, int64_t gs,
                                  int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt, float *out) {
    const __m512 lut = int4_table(zr);
    const int64_t whole = K / SPAN * SPAN, ks = k1 < whole ? k1 : whole;
    __m512 acc[TILE], zv = _mm512_setzero_ps(), scv;
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    span_groups_t sg = span_groups_at(gs, k0);
    for (int64_t k = k0; k < ks; k += SPAN) {
        _mm_prefetch((const char *)(row + k / 2 + PREFETCH_AHEAD), _MM_HINT_T0);
        span_scales(&sg, scl, zr, k, &scv, &zv);
        __m512 wv[8];
        int4_span_codes(row + k / 2, lut, zr, zv, wv);
        SPAN_DOTS(wv, scv, xp, K, k, nt, acc);
    }
    float tail[TILE] = {0};
    if (ks < k1) int512_row_nt(bits, row, scl, zr, gs, ks, k1, xp, K, nt, tail); /* the values after the spans */
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(acc[t]) + tail[t];
}

INT_ROWS(int4span_avx512, T512, 4, int4span512_row_nt)

/* int4 tiles with AVX-512 in prep_spans's order: each span's weights (q - zero) x scale (the
 * portable decoder's values, one rounding), the values after the last span in element order */
T512 static void decode_int4span_avx512(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,
                                        int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb,
                                        int64_t ld) {
    const int64_t gs = group > 0 ? group : K, G = K / gs, whole = K / SPAN * SPAN, ks = k1 < whole ? k1 : whole;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * (K / 2), *zr = z ? z + n * G : NULL;
        const float *scl = (const float *)s + n * G;
        const __m512 lut = int4_table(zr);
        float *out = wb + (n - n0) * ld - k0;
        __m512 zv = _mm512_setzero_ps(), scv;
        span_groups_t sg = span_groups_at(gs, k0);
        for (int64_t k = k0; k < ks; k += SPAN) {
            span_scales(&sg, scl, zr, k, &scv, &zv);
            __m512 wv[8];
            int4_span_codes(row + k / 2, lut, zr, zv, wv);
            span_store(out + k, wv, scv);
        }
        if (ks < k1) int_rows(4, w, s, z, group, K, n, n + 1, ks, k1, out + ks, ld);
    }
}

/* NVFP4: the e2m1 table (sign included); a lane's scale is its group's effective scale, the group's
 * e4m3 scale times (modelopt) or over (compressed-tensors) the global one, as nvfp4_rows computes it
 * (one rounding); groups of 16 are lanes 2g and 2g + 1 */
INLINE512 __m512 nvfp4_span_scales(int divide, const uint8_t *scl, float g, int64_t k) {
    const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scl + k / 16)));
    __m256 e = _mm256_i32gather_ps(E4M3, codes, 4);
    e = divide ? _mm256_div_ps(e, _mm256_set1_ps(g)) : _mm256_mul_ps(e, _mm256_set1_ps(g));
    const __m512i half = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_ps(half, _mm512_castps256_ps512(e));
}

INLINE512 void nvfp4span512_row_nt(int divide, const uint8_t *row, const uint8_t *scl, float g, int64_t k0,
                                   int64_t k1, const float *xp, int64_t K, const int nt, float *out) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const int64_t whole = K / SPAN * SPAN, ks = k1 < whole ? k1 : whole;
    __m512 acc[TILE];
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t k = k0; k < ks; k += SPAN) {
        _mm_prefetch((const char *)(row + k / 2 + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m512 scv = nvfp4_span_scales(divide, scl, g, k);
        __m512 wv[8];
        span_codes(row + k / 2, lut, wv);
        SPAN_DOTS(wv, scv, xp, K, k, nt, acc);
    }
    float tail[TILE] = {0};
    if (ks < k1) nvfp4_512_row_nt(divide, row, scl, g, ks, k1, xp, K, nt, tail); /* the values after the spans */
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(acc[t]) + tail[t];
}

#define NVFP4_SPANS512(NAME, DIVIDE)                                                                        \
    NVFP4_ROWS512(NAME, DIVIDE, nvfp4span512_row_nt)                                                        \
    T512 static void decode_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,    \
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb,   \
                                   int64_t ld) {                                                            \
        const int64_t whole = K / SPAN * SPAN, ks = k1 < whole ? k1 : whole;                                \
        const __m512 lut = _mm512_loadu_ps(E2M1);                                                           \
        for (int64_t n = n0; n < n1; n++) {                                                                 \
            const uint8_t *scl = s + n * (K / 16);                                                          \
            const float g = ((const float *)z)[group > 0 ? n / group : 0];                                  \
            float *out = wb + (n - n0) * ld - k0;                                                           \
            for (int64_t k = k0; k < ks; k += SPAN) {                                                       \
                const __m512 scv = nvfp4_span_scales(DIVIDE, scl, g, k);                                    \
                __m512 wv[8];                                                                               \
                span_codes(w + n * (K / 2) + k / 2, lut, wv);                                               \
                span_store(out + k, wv, scv);                                                               \
            }                                                                                               \
            if (ks < k1) nvfp4_rows512(DIVIDE, w, s, z, group, K, n, n + 1, ks, k1, out + ks, ld);          \
        }                                                                                                   \
    }
NVFP4_SPANS512(nvfp4span_avx512, 0)
NVFP4_SPANS512(nvfp4ctspan_avx512, 1)
#else
#define rows_nvfp4span_avx512 NULL
#define rows_nvfp4ctspan_avx512 NULL
#define decode_nvfp4span_avx512 decode_nvfp4_portable
#define decode_nvfp4ctspan_avx512 decode_nvfp4ct_portable
#define rows_int4span_avx512 NULL
#define decode_int4span_avx512 decode_int4_portable
#endif
