/* AVX2 (with F16C) decoders of the float-coded packed formats, fp8 e4m3 and nvfp4: tile decoders and
 * row decoders for few tokens, as the AVX-512 ones (cpu_experts_packed.h, cpu_experts_rows512.h) with
 * 8-lane vectors. Every weight is the exact fp32 value of the portable decoder (a NaN fp8 code aside:
 * +-480 times its scale here). */

#ifdef FM_X86
/* fp8: 16 codes' magnitudes shifted into fp16 bits of the value x 2^-8, the sign moved from bit 14 to
 * bit 15, widened by vcvtph2ps (fp8_512_row_nt explains the bits) */
INLINE256 void fp8x16_256(const uint8_t *codes, __m256 *w0, __m256 *w1) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes)), 7);
    h = _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));
    *w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

T256 static void decode_fp8_avx2(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                                 int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld) {
    (void)z;
    int64_t gs;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * K;
        const float *sr = fp8_scales_of(s, group, K, n, &gs);
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t k = k0; k < k1;) {
            const int64_t g = k / gs, end = (g + 1) * gs < k1 ? (g + 1) * gs : k1;
            const float sc = sr[g];
            const __m256 scv = _mm256_set1_ps(sc * 256.0f);
            for (; k + 16 <= end; k += 16) {
                __m256 w0, w1;
                fp8x16_256(row + k, &w0, &w1);
                _mm256_storeu_ps(out + k, _mm256_mul_ps(w0, scv));
                _mm256_storeu_ps(out + k + 8, _mm256_mul_ps(w1, scv));
            }
            for (; k < end; k++) out[k] = E4M3[row[k]] * sc;
        }
    }
}

/* one fp8 row times nt tokens: each scale group's products summed apart, then times its scale x 2^8 */
INLINE256 void fp8_256_row_nt(const uint8_t *row, const float *sr, int64_t gs, int64_t k0, int64_t k1,
                              const float *xp, int64_t K, const int nt, float *out) {
    __m256 acc[TILE];
    float tail[TILE] = {0};
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1;) {
        const int64_t g = k / gs, end = (g + 1) * gs < k1 ? (g + 1) * gs : k1;
        const float sc = sr[g];
        __m256 a0[TILE], a1[TILE];
        for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm256_setzero_ps();
        for (; k + 16 <= end; k += 16) {
            _mm_prefetch((const char *)(row + k) + PREFETCH_AHEAD, _MM_HINT_T0);
            __m256 w0, w1;
            fp8x16_256(row + k, &w0, &w1);
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + t * K + k), a0[t]);
                a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + t * K + k + 8), a1[t]);
            }
        }
        const __m256 scv = _mm256_set1_ps(sc * 256.0f);
        for (int t = 0; t < nt; t++) acc[t] = _mm256_fmadd_ps(_mm256_add_ps(a0[t], a1[t]), scv, acc[t]);
        for (; k < end; k++) {
            const float wk = E4M3[row[k]] * sc;
            for (int t = 0; t < nt; t++) tail[t] += wk * xp[t * K + k];
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum256(acc[t]) + tail[t];
}

T256 static void rows_fp8_avx2(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                               int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, int nt, float *y,
                               int64_t ys) {
    (void)z;
    int64_t gs;
    float out[TILE];
    for (int64_t n = n0; n < n1; n++) {
        const float *sr = fp8_scales_of(s, group, K, n, &gs);
        ROWS_NT(nt, fp8_256_row_nt, out, w + n * K, sr, gs, k0, k1, xp, K);
        for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];
    }
}

/* nvfp4: a group's 8 bytes as 16 codes in element order (low, high nibble of each byte), magnitudes
 * looked up by vpermps (it reads a lane's low 3 bits), the sign bit (code bit 3) moved to bit 31,
 * times the group's effective scale (one rounding, as nvfp4_rows) */
INLINE256 void nvfp4x16_256(const uint8_t *bytes, float eff, __m256 *w0, __m256 *w1) {
    const __m256 mag = _mm256_loadu_ps(E2M1);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i sign = _mm256_set1_epi32(8);
    const __m128i v = _mm_loadl_epi64((const __m128i *)bytes);
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
    const __m256i c0 = _mm256_cvtepu8_epi32(codes), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8));
    const __m256 v0 = _mm256_or_ps(_mm256_permutevar8x32_ps(mag, c0),
                                   _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c0, sign), 28)));
    const __m256 v1 = _mm256_or_ps(_mm256_permutevar8x32_ps(mag, c1),
                                   _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c1, sign), 28)));
    *w0 = _mm256_mul_ps(v0, _mm256_set1_ps(eff));
    *w1 = _mm256_mul_ps(v1, _mm256_set1_ps(eff));
}

INLINE256 void nvfp4_rows256(int divide, const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,
                             int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * (K / 2), *scl = s + n * (K / 16);
        const float g = ((const float *)z)[group > 0 ? n / group : 0];
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t j = k0 / 16; j < k1 / 16; j++) {
            __m256 w0, w1;
            nvfp4x16_256(row + j * 8, divide ? E4M3[scl[j]] / g : E4M3[scl[j]] * g, &w0, &w1);
            _mm256_storeu_ps(out + j * 16, w0);
            _mm256_storeu_ps(out + j * 16 + 8, w1);
        }
    }
}

INLINE256 void nvfp4_256_row_nt(int divide, const uint8_t *row, const uint8_t *scl, float g, int64_t k0, int64_t k1,
                                const float *xp, int64_t K, const int nt, float *out) {
    __m256 a0[TILE], a1[TILE];
    for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t j = k0 / 16; j < k1 / 16; j++) {
        _mm_prefetch((const char *)(row + j * 8) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m256 w0, w1;
        nvfp4x16_256(row + j * 8, divide ? E4M3[scl[j]] / g : E4M3[scl[j]] * g, &w0, &w1);
        _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
            a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + t * K + j * 16), a0[t]);
            a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + t * K + j * 16 + 8), a1[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum256(_mm256_add_ps(a0[t], a1[t]));
}

#define NVFP4_256(NAME, DIVIDE)                                                                             \
    T256 static void decode_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,      \
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb,     \
                                   int64_t ld) {                                                            \
        nvfp4_rows256(DIVIDE, w, s, z, group, K, n0, n1, k0, k1, wb, ld);                                   \
    }                                                                                                       \
    T256 static void rows_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,        \
                                 int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, \
                                 int nt, float *y, int64_t ys) {                                            \
        float out[TILE];                                                                                    \
        for (int64_t n = n0; n < n1; n++) {                                                                 \
            const float g = ((const float *)z)[group > 0 ? n / group : 0];                                  \
            ROWS_NT(nt, nvfp4_256_row_nt, out, DIVIDE, w + n * (K / 2), s + n * (K / 16), g, k0, k1, xp, K); \
            for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];                                           \
        }                                                                                                   \
    }
NVFP4_256(nvfp4_avx2, 0)
NVFP4_256(nvfp4ct_avx2, 1)
#else
#define decode_fp8_avx2 decode_fp8_portable
#define decode_nvfp4_avx2 decode_nvfp4_portable
#define decode_nvfp4ct_avx2 decode_nvfp4ct_portable
#define rows_fp8_avx2 NULL
#define rows_nvfp4_avx2 NULL
#define rows_nvfp4ct_avx2 NULL
#endif
