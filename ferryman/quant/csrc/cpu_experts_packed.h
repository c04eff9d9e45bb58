/* Packed formats of cpu_experts.c and their tile decoders (some also have AVX-512 row decoders for
 * few tokens, cpu_experts_rows512.h): each tile of rows x TILE_K is decoded once into fp32, then a
 * dots kernel multiplies it (the ISA's, or dots_portable). Each decoded weight is, bit for bit, what the
 * torch reference dequantiser returns:
 *   GGUF (quant/gguf_blocks.py dequant_rows; ggml's block layouts), a row = K / block values' blocks:
 *     5 q8_0  34 bytes / 32 values: fp16 d, 32 int8 q                      w = d x q
 *     6 q4_k 144 bytes / 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (8 sub-blocks of
 *             32), 128 bytes of nibbles (per 64 values: 32 low nibbles, then the same bytes' high)
 *                                                                         w = (d x sc) x q - dmin x m
 *     7 q6_k 210 bytes / 256: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, fp16 d
 *                                                                         w = (d x sc) x (q - 32)
 *   int (quant/intq.py dequant_int): W = int32 words [N, K / (32 / bits)], input k at bits
 *     (k % P) * bits of word k // P (little-endian: int4 byte k/2, low nibble first; int8 byte k);
 *     s = fp32 scales [N, G], z = uint8 zeros [N, G] or NULL (2^(bits-1)); group: inputs per group
 *     (0: one group per row)
 *     8 int4, 9 int8                                                      w = (q - zero) x scale
 *   fp8 (quant/fp8.py dequant_fp8): W = float8 e4m3fn [N, K]; s = fp32 scales of square blocks
 *     [ceil(N / group), ceil(K / group)] (the last ones may be partial), or [N] for group 0
 *     10 fp8                                                              w = fp32(q) x scale
 *   nvfp4 (quant/nvfp4.py dequant_nvfp4): W = e2m1 codes [N, K/2] (element 2j low nibble), s = e4m3
 *     scales [N, K/16], z = fp32 global scales, one per `group` rows (w13: gate, up; w2: one)
 *     11 nvfp4 (modelopt)                                                 w = code x (fp32(s) x g)
 *     12 nvfp4-ct (compressed-tensors)                                    w = code x (fp32(s) / g)
 * Every product of a fp16 scale and small integers above is exact in fp32, and each w has at most
 * one rounding (the last operation), so no order of operations, fused or not, changes a bit.
 * The decoders are written once (static inline) and compiled per ISA (target attributes), so the
 * compiler vectorises each for the ISA it runs on. */

#define QK_K 256

/* fp16 at p (little-endian) as fp32, exact */
static inline float f16_at(const uint8_t *p) { return half_float((uint16_t)(p[0] | p[1] << 8)); }

static inline __attribute__((always_inline)) void q8_0_rows(const uint8_t *w, int64_t K, int64_t n0, int64_t n1,
                                                            int64_t k0, int64_t k1, float *wb, int64_t ld) {
    const int64_t rb = K / 32 * 34;
    for (int64_t n = n0; n < n1; n++) {
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t b = k0 / 32; b < k1 / 32; b++) {
            const uint8_t *blk = w + n * rb + b * 34;
            const float d = f16_at(blk);
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < 32; j++) out[b * 32 + j] = d * (float)q[j];
        }
    }
}

/* Q4_K's 6-bit scale and min of sub-block j (quant/gguf_blocks.py k_scale_min) */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline __attribute__((always_inline)) void q4_k_rows(const uint8_t *w, int64_t K, int64_t n0, int64_t n1,
                                                            int64_t k0, int64_t k1, float *wb, int64_t ld) {
    const int64_t rb = K / QK_K * 144;
    for (int64_t n = n0; n < n1; n++) {
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t b = k0 / QK_K; b < k1 / QK_K; b++) {
            const uint8_t *blk = w + n * rb + b * 144, *qs = blk + 16;
            const float d = f16_at(blk), dmin = f16_at(blk + 2);
            float *o = out + b * QK_K;
            for (int c = 0; c < 4; c++) { /* 64 values: sub-blocks 2c (low nibbles), 2c + 1 (high) */
                int sc0, mn0, sc1, mn1;
                k_scale_min(blk + 4, 2 * c, &sc0, &mn0);
                k_scale_min(blk + 4, 2 * c + 1, &sc1, &mn1);
                const float d0 = d * (float)sc0, m0 = dmin * (float)mn0, d1 = d * (float)sc1, m1 = dmin * (float)mn1;
                for (int l = 0; l < 32; l++) {
                    o[c * 64 + l] = d0 * (float)(qs[c * 32 + l] & 0xF) - m0;
                    o[c * 64 + 32 + l] = d1 * (float)(qs[c * 32 + l] >> 4) - m1;
                }
            }
        }
    }
}

/* values 32s + l of 128 (s < 4, l < 16 of one half): (ql nibble) | (qh bits 2s, 2s + 1) << 4, minus 32,
 * times d x the int8 scale of their 16 (sc[2s]) */
static inline __attribute__((always_inline)) void q6_k_16(const uint8_t *lo, const uint8_t *hi, float d,
                                                          const int8_t *sc, float *o) {
    const float s0 = d * (float)sc[0], s1 = d * (float)sc[2], s2 = d * (float)sc[4], s3 = d * (float)sc[6];
    for (int l = 0; l < 16; l++) {
        o[l] = s0 * (float)(((lo[l] & 0xF) | ((hi[l] & 3) << 4)) - 32);
        o[32 + l] = s1 * (float)(((lo[32 + l] & 0xF) | (((hi[l] >> 2) & 3) << 4)) - 32);
        o[64 + l] = s2 * (float)(((lo[l] >> 4) | (((hi[l] >> 4) & 3) << 4)) - 32);
        o[96 + l] = s3 * (float)(((lo[32 + l] >> 4) | ((hi[l] >> 6) << 4)) - 32);
    }
}

static inline __attribute__((always_inline)) void q6_k_rows(const uint8_t *w, int64_t K, int64_t n0, int64_t n1,
                                                            int64_t k0, int64_t k1, float *wb, int64_t ld) {
    const int64_t rb = K / QK_K * 210;
    for (int64_t n = n0; n < n1; n++) {
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t b = k0 / QK_K; b < k1 / QK_K; b++) {
            const uint8_t *blk = w + n * rb + b * 210, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = f16_at(blk + 208);
            float *o = out + b * QK_K;
            for (int h = 0; h < 2; h++) /* 128 values: ql bytes 64h.. (low, then high nibbles), qh 32h.. */
                for (int half = 0; half < 2; half++)
                    q6_k_16(ql + h * 64 + half * 16, qh + h * 32 + half * 16, d, sc + h * 8 + half,
                            o + h * 128 + half * 16);
        }
    }
}

static inline __attribute__((always_inline)) void int_rows(int bits, const uint8_t *w, const uint8_t *s,
                                                           const uint8_t *z, int64_t group, int64_t K, int64_t n0,
                                                           int64_t n1, int64_t k0, int64_t k1, float *wb,
                                                           int64_t ld) {
    const int64_t gs = group > 0 ? group : K, G = K / gs, rb = K * bits / 8;
    const int mid = 1 << (bits - 1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * rb;
        const float *scl = (const float *)s + n * G;
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t k = k0; k < k1;) {
            const int64_t g = k / gs, end = (g + 1) * gs < k1 ? (g + 1) * gs : k1;
            const int zero = z ? z[n * G + g] : mid;
            const float sc = scl[g];
            if (bits == 4) { /* k and end even: groups and K are multiples of 8 */
                const uint8_t *b = row + k / 2;
                float *o = out + k;
                for (int64_t j = 0; j < (end - k) / 2; j++) {
                    o[2 * j] = (float)((b[j] & 0xF) - zero) * sc;
                    o[2 * j + 1] = (float)((b[j] >> 4) - zero) * sc;
                }
                k = end;
            } else {
                for (; k < end; k++) out[k] = (float)(row[k] - zero) * sc;
            }
        }
    }
}

/* the row decoders' scalar tail of an int group: values [k, end) times nt tokens into tail; returns end */
static inline int64_t int_tail(int bits, const uint8_t *row, int zero, float sc, int64_t k, int64_t end,
                               const float *xp, int64_t K, int nt, float *tail) {
    for (; k < end; k++) {
        const int q = bits == 4 ? (row[k / 2] >> (4 * (k & 1))) & 0xF : row[k];
        const float wk = (float)(q - zero) * sc;
        for (int t = 0; t < nt; t++) tail[t] += wk * xp[t * K + k];
    }
    return end;
}

/* float8 e4m3fn as fp32, exactly: no infinities, S.1111.111 is NaN, exponent 0 subnormal (m x 2^-9);
 * all 256 values in a table filled when the library loads */
static float E4M3[256];

__attribute__((constructor)) static void fill_e4m3(void) {
    for (int c = 0; c < 256; c++) {
        const uint32_t e = (c >> 3) & 0xF, m = c & 7;
        float mag = e ? bits_float(((e + 120) << 23) | (m << 20)) : (float)m * 0.001953125f;
        if ((c & 0x7F) == 0x7F) mag = NAN;
        E4M3[c] = c & 0x80 ? -mag : mag;
    }
}

/* row n's fp8 scales: square blocks of `group` (group > 0: [N / group, ceil(K / group)] scales, *gs =
 * group inputs each) or one per row (*gs = K) */
static inline const float *fp8_scales_of(const uint8_t *s, int64_t group, int64_t K, int64_t n, int64_t *gs) {
    *gs = group > 0 ? group : K;
    return (const float *)s + (group > 0 ? n / group * ((K + group - 1) / group) : n);
}

static inline __attribute__((always_inline)) void fp8_rows(const uint8_t *w, const uint8_t *s, int64_t group,
                                                           int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1,
                                                           float *wb, int64_t ld) {
    int64_t gs;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * K;
        const float *sr = fp8_scales_of(s, group, K, n, &gs);
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t k = k0; k < k1;) {
            const int64_t g = k / gs, end = (g + 1) * gs < k1 ? (g + 1) * gs : k1;
            const float sc = sr[g];
            for (; k < end; k++) out[k] = E4M3[row[k]] * sc;
        }
    }
}

static inline __attribute__((always_inline)) void nvfp4_rows(int divide, const uint8_t *w, const uint8_t *s,
                                                             const uint8_t *z, int64_t group, int64_t K, int64_t n0,
                                                             int64_t n1, int64_t k0, int64_t k1, float *wb,
                                                             int64_t ld) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * (K / 2), *scl = s + n * (K / 16);
        const float g = ((const float *)z)[group > 0 ? n / group : 0];
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t j = k0 / 16; j < k1 / 16; j++) {
            const float eff = divide ? E4M3[scl[j]] / g : E4M3[scl[j]] * g;
            for (int b = 0; b < 8; b++) {
                const uint8_t c = row[j * 8 + b];
                out[j * 16 + 2 * b] = E2M1[c & 0xF] * eff;
                out[j * 16 + 2 * b + 1] = E2M1[c >> 4] * eff;
            }
        }
    }
}

#define GGUF_DECODER(NAME, ATTR, BODY)                                                                    \
    ATTR static void decode_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,  \
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, \
                                   int64_t ld) {                                                        \
        (void)s, (void)z, (void)group;                                                                  \
        BODY(w, K, n0, n1, k0, k1, wb, ld);                                                             \
    }
#define INT_DECODER(NAME, ATTR, BITS)                                                                     \
    ATTR static void decode_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,  \
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, \
                                   int64_t ld) {                                                        \
        int_rows(BITS, w, s, z, group, K, n0, n1, k0, k1, wb, ld);                                      \
    }
#define FP8_DECODER(NAME, ATTR)                                                                           \
    ATTR static void decode_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,  \
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, \
                                   int64_t ld) {                                                        \
        (void)z;                                                                                        \
        fp8_rows(w, s, group, K, n0, n1, k0, k1, wb, ld);                                               \
    }
#define NVFP4_DECODER(NAME, ATTR, DIVIDE)                                                                 \
    ATTR static void decode_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,  \
                                   int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, \
                                   int64_t ld) {                                                        \
        nvfp4_rows(DIVIDE, w, s, z, group, K, n0, n1, k0, k1, wb, ld);                                  \
    }
#define PACKED_DECODERS(SUFFIX, ATTR)                 \
    GGUF_DECODER(q8_0_##SUFFIX, ATTR, q8_0_rows)      \
    GGUF_DECODER(q4_k_##SUFFIX, ATTR, q4_k_rows)      \
    GGUF_DECODER(q6_k_##SUFFIX, ATTR, q6_k_rows)      \
    INT_DECODER(int4_##SUFFIX, ATTR, 4)               \
    INT_DECODER(int8_##SUFFIX, ATTR, 8)               \


PACKED_DECODERS(portable, )
FP8_DECODER(fp8_portable, )
NVFP4_DECODER(nvfp4_portable, , 0)
NVFP4_DECODER(nvfp4ct_portable, , 1)
#ifdef FM_X86
PACKED_DECODERS(avx2, T256)
PACKED_DECODERS(avx512, T512)

/* nvfp4 with AVX-512: a group's 8 bytes as 16 codes in element order (low, high nibble of each byte),
 * looked up in the 16 e2m1 values held in one register, times the group's effective scale */
INLINE512 void nvfp4_rows512(int divide, const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,
                             int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * (K / 2), *scl = s + n * (K / 16);
        const float g = ((const float *)z)[group > 0 ? n / group : 0];
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t j = k0 / 16; j < k1 / 16; j++) {
            const float eff = divide ? E4M3[scl[j]] / g : E4M3[scl[j]] * g;
            __m128i v = _mm_loadl_epi64((const __m128i *)(row + j * 8));
            __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
            __m512 vals = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), lut);
            _mm512_storeu_ps(out + j * 16, _mm512_mul_ps(vals, _mm512_set1_ps(eff)));
        }
    }
}

T512 static void decode_nvfp4_avx512(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                                     int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld) {
    nvfp4_rows512(0, w, s, z, group, K, n0, n1, k0, k1, wb, ld);
}

T512 static void decode_nvfp4ct_avx512(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,
                                       int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb,
                                       int64_t ld) {
    nvfp4_rows512(1, w, s, z, group, K, n0, n1, k0, k1, wb, ld);
}

/* fp8 with AVX-512: 32 codes at a time through fp16, as fp8_512_row_nt (cpu_experts_rows512.h)
 * reads them: the magnitude's bits shifted into an fp16 of the value x 2^-8, the sign moved to bit
 * 15, widened by vcvtph2ps and multiplied by the scale x 2^8: the table's value times the scale,
 * one rounding (a NaN code reads as +-480 times it); a group's values past its last whole 32 take
 * the table */
T512 static void decode_fp8_avx512(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                                   int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld) {
    (void)z;
    const __m512i bit14 = _mm512_set1_epi16(0x4000);
    int64_t gs;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * K;
        const float *sr = fp8_scales_of(s, group, K, n, &gs);
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t k = k0; k < k1;) {
            const int64_t g = k / gs, end = (g + 1) * gs < k1 ? (g + 1) * gs : k1;
            const float sc = sr[g];
            const __m512 scv = _mm512_set1_ps(sc * 256.0f);
            for (; k + 32 <= end; k += 32) {
                __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + k))), 7);
                h = _mm512_add_epi16(h, _mm512_and_si512(h, bit14));
                _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), scv));
                _mm512_storeu_ps(out + k + 16, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), scv));
            }
            for (; k < end; k++) out[k] = E4M3[row[k]] * sc;
        }
    }
}
#else
#define decode_q8_0_avx2 decode_q8_0_portable
#define decode_q4_k_avx2 decode_q4_k_portable
#define decode_q6_k_avx2 decode_q6_k_portable
#define decode_int4_avx2 decode_int4_portable
#define decode_int8_avx2 decode_int8_portable
#define decode_q8_0_avx512 decode_q8_0_portable
#define decode_q4_k_avx512 decode_q4_k_portable
#define decode_q6_k_avx512 decode_q6_k_portable
#define decode_int4_avx512 decode_int4_portable
#define decode_int8_avx512 decode_int8_portable
#define decode_nvfp4_avx512 decode_nvfp4_portable
#define decode_nvfp4ct_avx512 decode_nvfp4ct_portable
#define decode_fp8_avx512 decode_fp8_portable
#endif

/* the portable dots kernel (formats without row decoders on the portable ISA):
 * y[t * ys + r] += wb[r, 0:len] . xp[t * K + 0:len] */
static void dots_portable(const float *wb, int64_t ld, int64_t nr, const float *xp, int64_t K, int64_t nt,
                          int64_t len, float *y, int64_t ys) {
    for (int64_t t = 0; t < nt; t++)
        for (int64_t r = 0; r < nr; r++) {
            const float *a = wb + r * ld, *b = xp + t * K;
            float acc[8] = {0};  /* 8 independent sums: the compiler keeps them in vectors */
            int64_t k = 0;
            for (; k + 8 <= len; k += 8)
                for (int j = 0; j < 8; j++) acc[j] += a[k + j] * b[k + j];
            for (; k < len; k++) acc[0] += a[k] * b[k];
            y[t * ys + r] += ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        }
}

static int64_t q8_0_row_bytes(int64_t K) { return K / 32 * 34; }
static int64_t q4_k_row_bytes(int64_t K) { return K / QK_K * 144; }
static int64_t q6_k_row_bytes(int64_t K) { return K / QK_K * 210; }
static int64_t int4_row_bytes(int64_t K) { return K / 2; } /* the words only; scales and zeros apart */
static int64_t int8_row_bytes(int64_t K) { return K; }
static int64_t fp8_row_bytes(int64_t K) { return K; } /* the codes only; scales apart */
static int64_t nvfp4_row_bytes(int64_t K) { return K / 2; }
static int64_t nvfp4ct_row_bytes(int64_t K) { return K / 2; }
