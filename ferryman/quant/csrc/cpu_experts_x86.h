/* x86 row decoders of cpu_experts.c: AVX-512 (F+BW) and AVX2+FMA, each function compiled for its
 * own target (attributes), called only where the CPU reports the instruction set (cpu_has). */

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define T256 __attribute__((target("avx2,fma,f16c")))
#define TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define INLINE512 static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,fma")))
#define INLINE256 static inline __attribute__((always_inline, target("avx2,fma,f16c")))

static int cpu_has(int isa) {
    __builtin_cpu_init();
    if (isa == ISA_AVX512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                  __builtin_cpu_supports("avx512vl");
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == ISA_AVX512BF16) return cpu_has(ISA_AVX512) && __builtin_cpu_supports("avx512bf16");
    return 1;
}

/* ---- AVX-512 ---------------------------------------------------------------------------------- */
/* acc[t] += (per lane: the span's 8 products of wv with token t's prepared values) x scv, t < nt */
#define SPAN_DOTS(wv, scv, xp, K, k, nt, acc)                                                              \
    _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {                                                  \
        const float *xs = xp + t * K + k;                                                                   \
        __m512 a = _mm512_mul_ps(wv[0], _mm512_loadu_ps(xs));                                               \
        __m512 b = _mm512_mul_ps(wv[1], _mm512_loadu_ps(xs + 16));                                          \
        a = _mm512_fmadd_ps(wv[2], _mm512_loadu_ps(xs + 32), a);                                            \
        b = _mm512_fmadd_ps(wv[3], _mm512_loadu_ps(xs + 48), b);                                            \
        a = _mm512_fmadd_ps(wv[4], _mm512_loadu_ps(xs + 64), a);                                            \
        b = _mm512_fmadd_ps(wv[5], _mm512_loadu_ps(xs + 80), b);                                            \
        a = _mm512_fmadd_ps(wv[6], _mm512_loadu_ps(xs + 96), a);                                            \
        b = _mm512_fmadd_ps(wv[7], _mm512_loadu_ps(xs + 112), b);                                           \
        acc[t] = _mm512_fmadd_ps(_mm512_add_ps(a, b), scv, acc[t]);                                         \
    }

/* a span's 8 vectors of codes looked up in lut, in prep_mxfp4's span order (cpu_experts.c, prep_span) */
INLINE512 void span_codes(const uint8_t *blk, const __m512 lut, __m512 *wv) {
    const __m512i v = _mm512_loadu_si512((const void *)blk);
    wv[0] = _mm512_permutexvar_ps(v, lut);
    wv[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
    wv[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), lut);
    wv[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), lut);
    wv[4] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 16), lut);
    wv[5] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 20), lut);
    wv[6] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 24), lut);
    wv[7] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 28), lut);
}

/* a decoded span into a tile row: o[16j + d] = wv[j][d] x scv[d], one rounding each */
INLINE512 void span_store(float *o, const __m512 *wv, const __m512 scv) {
    for (int j = 0; j < 8; j++) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(wv[j], scv));
}

/* One MXFP4 row (no extreme scales; sc: its scales as floats) times nt tokens -> out[nt].
 * A span (64 bytes, 4 groups) is one load; dword lane d holds bytes 4d..4d+3, and vpermps reads the
 * low 4 bits of each lane, so shifting the lanes by 4j puts nibble j of every lane under the table:
 * 8 permutes decode 128 weights, no byte widening. Per token the span's 8 products are summed
 * unscaled, then multiplied by the per-lane scales (lanes 4g..4g+3: group g). Invariant: callers
 * pass nt as a literal (ROWS_NT in mx512_row below), so the token loops unroll into registers. */
INLINE512 void mx512_row_nt(const uint8_t *blk, const float *sc, const float *xp, int64_t K, int64_t G,
                            int64_t k0, int64_t k1, const int nt, float *out) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m512i rep4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[TILE];
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    const int64_t spans = K / SPAN, sp1 = k1 / SPAN < spans ? k1 / SPAN : spans;
    for (int64_t sp = k0 / SPAN; sp < sp1; sp++) {
        _mm_prefetch((const char *)(blk + sp * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
        __m512 scv = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(_mm_loadu_ps(sc + sp * 4)));
        __m512 wv[8];
        span_codes(blk + sp * 64, lut, wv);
        SPAN_DOTS(wv, scv, xp, K, sp * SPAN, nt, acc);
    }
    const __m512i low = _mm512_set1_epi32(0xF);
    for (int64_t g = k1 == K ? spans * 4 : G; g < G; g++) { /* the groups after the last whole span */
        __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + g * BLOCK_BYTES)));
        __m512 lut_s = _mm512_mul_ps(lut, _mm512_set1_ps(sc[g]));
        __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(codes, low), lut_s);
        __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut_s);
        for (int t = 0; t < nt; t++) {
            const float *xg = xp + t * K + g * BLOCK;
            acc[t] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xg), acc[t]);
            acc[t] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xg + BLOCK_BYTES), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

T512 static void mx512_row(const uint8_t *blk, const uint8_t *scl, const float *sc, const float *xp, int64_t K,
                           int64_t G, int64_t k0, int64_t k1, int nt, float *out) {
    (void)scl; /* no extreme scales here: sc holds every group's */
    ROWS_NT(nt, mx512_row_nt, out, blk, sc, xp, K, G, k0, k1);
}

/* scl[g0:g1] as floats 2^(s-127) into sc[g0:g1]; 0 when a scale is 0 or 255 (the row's chunk then
 * takes the per-group path), else 1 */
INLINE512 int mx512_scales(const uint8_t *scl, int64_t g0, int64_t g1, float *sc) {
    __mmask16 bad = 0;
    for (int64_t g = g0; g < g1; g += 16) {
        __mmask16 m = g1 - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (g1 - g)) - 1);
        __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, scl + g));
        bad |= _mm512_mask_cmpeq_epi32_mask(m, v, _mm512_setzero_si512()) |
               _mm512_mask_cmpeq_epi32_mask(m, v, _mm512_set1_epi32(255));
        _mm512_mask_storeu_ps(sc + g, m, _mm512_castsi512_ps(_mm512_slli_epi32(v, 23)));
    }
    return bad == 0;
}

/* MXFP4 rows through a vector row decoder: SCALES(scl, g0, g1, sc) turns a row's scales into floats
 * (0: the row goes the portable way, as does one of more than MAX_GROUPS groups), ROW(blk, scl, sc,
 * xp, K, G, k0, k1, nt, out) dots it with nt tokens */
#define MXFP4_ROWS(NAME, TARGET, SCALES, ROW)                                                          \
    TARGET static void NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,        \
                            int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, \
                            int nt, float *y, int64_t ys) {                                             \
        const int64_t G = K / BLOCK, g0 = k0 / BLOCK, g1 = k1 / BLOCK;                                  \
        float sc[MAX_GROUPS], out[TILE];                                                                \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            const uint8_t *blk = w + n * G * BLOCK_BYTES, *scl = s + n * G;                             \
            if (G > MAX_GROUPS || !SCALES(scl, g0, g1, sc)) {                                           \
                rows_mxfp4_portable(w, s, z, group, K, n, n + 1, k0, k1, xp, nt, y, ys);                          \
                continue;                                                                               \
            }                                                                                           \
            ROW(blk, scl, sc, xp, K, G, k0, k1, nt, out);                                               \
            for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];                                       \
        }                                                                                               \
    }

MXFP4_ROWS(rows_mxfp4_avx512, T512, mx512_scales, mx512_row)

/* dense rows: `load16` turns 16 weights at a pointer into fp32; with a few tokens two accumulator
 * sets take alternate vectors, so no FMA waits on the one before it */
#define DENSE512(NAME, TYPE, LOAD16, LOADM)                                                              \
    INLINE512 void NAME##_nt(const TYPE *row, const float *xp, int64_t K, int64_t k0, int64_t k1,       \
                             const int nt, float *out) {                                                \
        __m512 a0[TILE], a1[TILE];                                                                      \
        for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm512_setzero_ps();                               \
        int64_t k = k0;                                                                                 \
        for (; k + 32 <= k1; k += 32) {                                                                  \
            _mm_prefetch((const char *)(row + k) + PREFETCH_AHEAD, _MM_HINT_T0);                        \
            __m512 w0 = LOAD16(row + k), w1 = LOAD16(row + k + 16);                                     \
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {                                    \
                a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + t * K + k), a0[t]);                    \
                a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + t * K + k + 16), a1[t]);               \
            }                                                                                           \
        }                                                                                               \
        for (; k < k1; k += 16) {                                                                       \
            __mmask16 m = k1 - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k1 - k)) - 1);         \
            __m512 w0 = LOADM(m, row + k);                                                              \
            for (int t = 0; t < nt; t++)                                                                \
                a0[t] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, xp + t * K + k), a0[t]);           \
        }                                                                                               \
        for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));        \
    }                                                                                                   \
    T512 static void rows_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,   \
                                 int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1,             \
                                 const float *xp, int nt, float *y, int64_t ys) {                       \
        (void)s, (void)z, (void)group;                                                                  \
        float out[TILE];                                                                                \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            const TYPE *row = (const TYPE *)w + n * K;                                                  \
            ROWS_NT(nt, NAME##_nt, out, row, xp, K, k0, k1);                                            \
            for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];                                       \
        }                                                                                               \
    }

INLINE512 __m512 bf16_load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
INLINE512 __m512 bf16_loadm(__mmask16 m, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
INLINE512 __m512 f32_load16(const float *p) { return _mm512_loadu_ps(p); }
INLINE512 __m512 f32_loadm(__mmask16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
INLINE512 __m512 f16_load16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE512 __m512 f16_loadm(__mmask16 m, const uint16_t *p) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

DENSE512(bf16_avx512, uint16_t, bf16_load16, bf16_loadm)
DENSE512(f32_avx512, float, f32_load16, f32_loadm)
DENSE512(f16_avx512, uint16_t, f16_load16, f16_loadm)

#include "cpu_experts_tiles512.h"

/* ---- AVX2 ------------------------------------------------------------------------------------- */
/* The MXFP4 span as two 32-byte halves (lanes d = 0..7, then 8..15); vpermps reads 3 bits, so the
 * table holds magnitudes and bit 3 of the nibble becomes the sign bit (decode_mxfp4_avx2's tiles: an
 * AVX2 row decoder of this kind measured 0.90-0.94x the tiles at 1-2 tokens and was removed). */
T256 static inline __m256 e2m1x8(__m256i v, int j, __m256 mag, __m256i eight) {
    /* nibble j of each of v's 8 words as E2M1 values (unscaled): magnitude by vpermps, bit 3 -> sign */
    __m256i nib = _mm256_srlv_epi32(v, _mm256_set1_epi32(4 * j));
    __m256 wv = _mm256_permutevar8x32_ps(mag, nib);
    return _mm256_xor_ps(wv, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(nib, eight), 28)));
}

/* scl[g0:g1] as floats 2^(s-127) into sc[g0:g1]; 0 when a scale is 0 or 255, else 1 */
INLINE256 int mx256_scales(const uint8_t *scl, int64_t g0, int64_t g1, float *sc) {
    if (extreme_scales(scl, g0, g1)) return 0;
    for (int64_t g = g0; g < g1; g++) sc[g] = bits_float((uint32_t)scl[g] << 23);
    return 1;
}


#define DENSE256(NAME, TYPE, LOAD8, SCALAR)                                                              \
    INLINE256 void NAME##_nt(const TYPE *row, const float *xp, int64_t K, int64_t k0, int64_t k1,       \
                             const int nt, float *out) {                                                \
        __m256 a0[TILE], a1[TILE];                                                                      \
        float tail[TILE] = {0};                                                                         \
        for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm256_setzero_ps();                               \
        int64_t k = k0;                                                                                 \
        for (; k + 16 <= k1; k += 16) {                                                                  \
            _mm_prefetch((const char *)(row + k) + PREFETCH_AHEAD, _MM_HINT_T0);                        \
            __m256 w0 = LOAD8(row + k), w1 = LOAD8(row + k + 8);                                        \
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {                                    \
                a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + t * K + k), a0[t]);                    \
                a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + t * K + k + 8), a1[t]);                \
            }                                                                                           \
        }                                                                                               \
        for (; k < k1; k++)                                                                             \
            for (int t = 0; t < nt; t++) tail[t] += SCALAR(row[k]) * xp[t * K + k];                     \
        for (int t = 0; t < nt; t++) {                                                                  \
            float lanes[8];                                                                             \
            _mm256_storeu_ps(lanes, _mm256_add_ps(a0[t], a1[t]));                                       \
            out[t] = tail[t] + lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + \
                     lanes[7];                                                                          \
        }                                                                                               \
    }                                                                                                   \
    T256 static void rows_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,   \
                                 int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1,             \
                                 const float *xp, int nt, float *y, int64_t ys) {                       \
        (void)s, (void)z, (void)group;                                                                  \
        float out[TILE];                                                                                \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            const TYPE *row = (const TYPE *)w + n * K;                                                  \
            ROWS_NT(nt, NAME##_nt, out, row, xp, K, k0, k1);                                            \
            for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];                                       \
        }                                                                                               \
    }

INLINE256 __m256 bf16_load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
INLINE256 __m256 f32_load8(const float *p) { return _mm256_loadu_ps(p); }
INLINE256 __m256 f16_load8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

DENSE256(bf16_avx2, uint16_t, bf16_load8, bf16_scalar)
DENSE256(f32_avx2, float, f32_load8, f32_scalar)
DENSE256(f16_avx2, uint16_t, f16_load8, half_float)

#include "cpu_experts_tiles256.h"

/* ---- AVX512-BF16 (compiled everywhere, run only where CPUID reports it) -------------------------- */
/* bf16 weights times bf16 activations: one vdpbf16ps multiplies 32 pairs and adds them in pairs into
 * 16 fp32 lanes; up to 4 tokens per pass, a row's chunk at a time */
TBF16 static void rows_bf16x_avx512bf16(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                                        int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, int nt,
                                        float *y, int64_t ys) {
    (void)s, (void)z, (void)group;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *row = (const uint16_t *)w + n * K;
        for (int t0 = 0; t0 < nt; t0 += 4) {
            int m = nt - t0 < 4 ? nt - t0 : 4;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t k = k0; k < k1; k += 32) {
                __mmask32 mk = k1 - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (k1 - k)) - 1);
                __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, row + k);
                for (int t = 0; t < m; t++) {
                    const uint16_t *xt = (const uint16_t *)(xp + (t0 + t) * K);
                    acc[t] = _mm512_dpbf16_ps(acc[t], wv, (__m512bh)_mm512_maskz_loadu_epi16(mk, xt + k));
                }
            }
            for (int t = 0; t < m; t++) y[(t0 + t) * ys + n] += _mm512_reduce_add_ps(acc[t]);
        }
    }
}
