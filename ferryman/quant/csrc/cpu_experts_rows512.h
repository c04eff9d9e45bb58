/* AVX-512 row decoders of packed formats for few tokens (below TILES_FROM): the weights are decoded
 * in registers as they multiply, never stored; each weight is the exact fp32 value the tile decoder
 * (cpu_experts_packed.h) would write. Invariant: the `*_nt` functions are called through ROWS_NT
 * (cpu_experts.c), nt a literal, so the token loops unroll into registers. */

#ifdef FM_X86
/* Q8_0: per block of 32, two 16-byte loads of int8 widened to fp32, times the block's fp16 d (exact:
 * an 11-bit mantissa times a 7-bit integer), multiplied into two accumulators per token */
INLINE512 void q8_0_512_row_nt(const uint8_t *row, int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt,
                               float *out) {
    __m512 a0[TILE], a1[TILE];
    for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    for (int64_t b = k0 / 32; b < k1 / 32; b++) {
        const uint8_t *blk = row + b * 34;
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);
        const __m512 d = _mm512_set1_ps(f16_at(blk));
        const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
        const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)));
        const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0)), w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1));
        _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
            const float *xs = xp + t * K + b * 32;
            a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs), a0[t]);
            a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs + 16), a1[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

/* k0, k1: multiples of 32 (run_rows' chunks are of SPAN = 128, the last one ends at K) */
GGUF_ROWS(q8_0_avx512, T512, q8_0_row_bytes, q8_0_512_row_nt)

/* Q4_K rows with AVX-512, few tokens (below TILES_FROM): per 64 values (one 32-byte run of nibbles,
 * sub-blocks 2c and 2c + 1), a table of each sub-block's 16 weights (d x sc x q - dmin x m for q =
 * 0..15, one rounding as the reference's) is looked up by the nibbles themselves: vpermps reads the
 * low 4 bits of each lane, so the low nibbles need no mask and the high ones one shift. Two
 * accumulator sets take alternate vectors. Invariant: called through ROWS_NT. */
INLINE512 void q4k512_row_nt(const uint8_t *row, int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt,
                             float *out) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 a0[TILE], a1[TILE];
    for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    for (int64_t b = k0 / QK_K; b * QK_K < k1; b++) { /* a block's scales once, then its 64-value runs */
        const uint8_t *blk = row + b * 144;
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        const int c0 = b * QK_K < k0 ? (int)(k0 - b * QK_K) / 64 : 0;
        const int c1 = (b + 1) * QK_K > k1 ? (int)(k1 - b * QK_K) / 64 : 4;
        /* the 8 six-bit scales, then the 8 mins, as bytes (k_scale_min for all j at once) */
        uint32_t u[4];
        memcpy(u, blk + 4, 12);
        const uint32_t hi_mins = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const uint32_t lo_mins = u[1] & 0x3F3F3F3Fu;
        u[1] = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[0] &= 0x3F3F3F3Fu;
        u[2] = lo_mins, u[3] = hi_mins;
        float ds[8], ms[8]; /* each sub-block's d x sc and dmin x m (exact products) */
        const __m256i sc8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u));
        const __m256i mn8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2)));
        _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sc8)));
        _mm256_storeu_ps(ms, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(mn8)));
        for (int c = c0; c < c1; c++) {
            const __m512 lut0 = _mm512_fmsub_ps(iota, _mm512_set1_ps(ds[2 * c]), _mm512_set1_ps(ms[2 * c]));
            const __m512 lut1 = _mm512_fmsub_ps(iota, _mm512_set1_ps(ds[2 * c + 1]), _mm512_set1_ps(ms[2 * c + 1]));
            const uint8_t *qs = blk + 16 + c * 32;
            const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
            const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
            const __m512 w0 = _mm512_permutexvar_ps(q0, lut0), w1 = _mm512_permutexvar_ps(q1, lut0);
            const __m512 w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), lut1);
            const __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), lut1);
            const int64_t k = b * QK_K + c * 64;
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                const float *xs = xp + t * K + k;
                a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs), a0[t]);
                a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs + 16), a1[t]);
                a0[t] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xs + 32), a0[t]);
                a1[t] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xs + 48), a1[t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

/* the row decoder: k0, k1 multiples of 64 (run_rows' chunks are of SPAN = 128) */
GGUF_ROWS(q4_k_avx512, T512, q4_k_row_bytes, q4k512_row_nt)

/* int4 / int8 words with group scales (and zeros): per group, the table of its 16 (int4) weights
 * (q - zero) x scale, one rounding as int_rows'; int4's 16 bytes become 32 codes in element order
 * (low, high nibble of each byte), looked up 16 at a time; int8's codes are widened and scaled.
 * A group's values past its last whole 32 go through the scalar loop (groups are multiples of 8). */
INLINE512 void int512_row_nt(int bits, const uint8_t *row, const float *scl, const uint8_t *zr, int64_t gs,
                             int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt, float *out) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const int mid = 1 << (bits - 1);
    __m512 a0[TILE], a1[TILE];
    float tail[TILE] = {0};
    for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1;) {
        const int64_t g = k / gs, end = (g + 1) * gs < k1 ? (g + 1) * gs : k1;
        const int zero = zr ? zr[g] : mid;
        const float sc = scl[g];
        const __m512 scv = _mm512_set1_ps(sc);
        const __m512i zv = _mm512_set1_epi32(zero);
        const __m512 lut = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iota, zv)), scv);
        for (; k + 32 <= end; k += 32) {
            __m512 w0, w1;
            _mm_prefetch((const char *)(row + k * bits / 8) + PREFETCH_AHEAD, _MM_HINT_T0);
            if (bits == 4) {
                const __m128i v = _mm_loadu_si128((const __m128i *)(row + k / 2));
                const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
                w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut);
                w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), lut);
            } else {
                const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k)));
                const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16)));
                w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q0, zv)), scv);
                w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q1, zv)), scv);
            }
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                const float *xs = xp + t * K + k;
                a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs), a0[t]);
                a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs + 16), a1[t]);
            }
        }
        k = int_tail(bits, row, zero, sc, k, end, xp, K, nt, tail);
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t])) + tail[t];
}

/* int4 takes the span decoders (cpu_experts_spans512.h) */
INT_ROWS(int8_avx512, T512, 8, int512_row_nt)

/* fp8 e4m3 with square block or row scales, 32 codes at a time through fp16: a code's low 7 bits
 * shifted left by 7 are the fp16 bits of its magnitude times 2^-8 (exponent field 0eeee, mantissa
 * mmm0000000; subnormals too), its sign (then at bit 14) moves to bit 15 by adding bit 14 to itself;
 * vcvtph2ps widens them exactly. Each scale group's products are summed apart, then times the
 * group's scale x 2^8 (an exact power of two): a lone nonzero input gives the tile decoder's weight
 * bit for bit. A group's values past its last whole 32 take the table. Unlike the table, a NaN
 * code (S.1111.111) reads as +-480 here. */
INLINE512 void fp8_512_row_nt(const uint8_t *row, const float *sr, int64_t gs, int64_t k0, int64_t k1,
                              const float *xp, int64_t K, const int nt, float *out) {
    const __m512i bit14 = _mm512_set1_epi16(0x4000);
    __m512 acc[TILE];
    float tail[TILE] = {0};
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1;) {
        const int64_t g = k / gs, end = (g + 1) * gs < k1 ? (g + 1) * gs : k1;
        const float sc = sr[g];
        __m512 a0[TILE], a1[TILE];
        for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm512_setzero_ps();
        for (; k + 32 <= end; k += 32) {
            _mm_prefetch((const char *)(row + k) + PREFETCH_AHEAD, _MM_HINT_T0);
            const __m256i c = _mm256_loadu_si256((const __m256i *)(row + k));
            const __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(c), 7);
            const __m512i f = _mm512_add_epi16(h, _mm512_and_si512(h, bit14));
            const __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(f));
            const __m512 w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(f, 1));
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + t * K + k), a0[t]);
                a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + t * K + k + 16), a1[t]);
            }
        }
        const __m512 scv = _mm512_set1_ps(sc * 256.0f);
        for (int t = 0; t < nt; t++) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(a0[t], a1[t]), scv, acc[t]);
        for (; k < end; k++) {
            const float wk = E4M3[row[k]] * sc;
            for (int t = 0; t < nt; t++) tail[t] += wk * xp[t * K + k];
        }
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(acc[t]) + tail[t];
}

T512 static void rows_fp8_avx512(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                                 int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, int nt, float *y,
                                 int64_t ys) {
    (void)z;
    int64_t gs;
    float out[TILE];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * K;
        const float *sr = fp8_scales_of(s, group, K, n, &gs);
        ROWS_NT(nt, fp8_512_row_nt, out, row, sr, gs, k0, k1, xp, K);
        for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];
    }
}

/* Q6_K: per 128 values (half a block), the 6-bit codes are put together as bytes, 64 values at a
 * time: the 64 ql bytes' low nibbles are values 0-63 and their high nibbles values 64-127, and the 32
 * qh bytes, repeated in both halves of a register and shifted per 16-bit lane by 0 / 2 (values 0-63)
 * or 4 / 6 (values 64-127), give each value's two high bits (a word shift's spill past a byte is
 * masked away). Each 16 values (one sub-block, one int8 scale) are widened to fp32 and times
 * d x scale (exact: an 11-bit mantissa times 8 bits), one rounding as q6_k_16's. */
INLINE512 void q6k512_row_nt(const uint8_t *row, int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt,
                             float *out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3), c32 = _mm512_set1_epi8(32);
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    int8_t codes[128] __attribute__((aligned(64)));
    __m512 acc[TILE];
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t kh = k0; kh < k1; kh += 128) { /* half a block: 128 values */
        const int64_t b = kh / QK_K;
        const int h = (int)(kh / 128) & 1;
        const uint8_t *blk = row + b * 210;
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD + 64 * h, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD + 128 + 40 * h, _MM_HINT_T0);
        float ds[8]; /* d x the half's 8 scales, exact */
        const __m256i s8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192 + h * 8)));
        _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(f16_at(blk + 208)), _mm256_cvtepi32_ps(s8)));
        const __m512i ql = _mm512_loadu_si512((const void *)(blk + h * 64));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32)));
        const __m512i hb_lo = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_lo), m2), 4);
        const __m512i hb_hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_hi), m2), 4);
        __m512i q[2]; /* values 0-63, 64-127 as int8 codes - 32 */
        q[0] = _mm512_sub_epi8(_mm512_ternarylogic_epi32(ql, m4, hb_lo, 0xEA), c32); /* (ql & m4) | hb */
        q[1] = _mm512_sub_epi8(_mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), m4, hb_hi, 0xEA), c32);
        const int64_t k = b * QK_K + h * 128;
        _mm512_store_si512((void *)codes, q[0]);
        _mm512_store_si512((void *)(codes + 64), q[1]);
        for (int j = 0; j < 8; j++) {
            const __m128i v16 = _mm_load_si128((const __m128i *)(codes + 16 * j));
            const __m512 w = _mm512_mul_ps(_mm512_set1_ps(ds[j]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v16)));
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++)
                acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp + t * K + k + 16 * j), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

/* k0, k1: multiples of 128, half a block (run_rows' chunks are of SPAN = 128, the last one ends at K) */
GGUF_ROWS(q6_k_avx512, T512, q6_k_row_bytes, q6k512_row_nt)

/* nvfp4 (modelopt: the global scale multiplies; compressed-tensors: it divides): per group of 16,
 * its 8 bytes as 16 codes in element order (low, high nibble of each byte) looked up in the e2m1
 * table, times the group's effective scale computed as nvfp4_rows does (one rounding each) */
INLINE512 void nvfp4_512_row_nt(int divide, const uint8_t *row, const uint8_t *scl, float g, int64_t k0, int64_t k1,
                                const float *xp, int64_t K, const int nt, float *out) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m512 acc[TILE], acc1[TILE]; /* even and odd groups: two FMA chains */
    for (int t = 0; t < nt; t++) acc[t] = acc1[t] = _mm512_setzero_ps();
    int64_t j = k0 / 16;
    for (; j + 2 <= k1 / 16; j += 2) { /* two groups from one 16-byte load */
        _mm_prefetch((const char *)(row + j * 8) + PREFETCH_AHEAD, _MM_HINT_T0);
        const float e0 = divide ? E4M3[scl[j]] / g : E4M3[scl[j]] * g;
        const float e1 = divide ? E4M3[scl[j + 1]] / g : E4M3[scl[j + 1]] * g;
        const __m128i v = _mm_loadu_si128((const __m128i *)(row + j * 8));
        const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        const __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut),
                                        _mm512_set1_ps(e0));
        const __m512 w1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), lut),
                                        _mm512_set1_ps(e1));
        _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
            acc[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp + t * K + j * 16), acc[t]);
            acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + t * K + j * 16 + 16), acc1[t]);
        }
    }
    if (j < k1 / 16) { /* an odd last group */
        const float eff = divide ? E4M3[scl[j]] / g : E4M3[scl[j]] * g;
        const __m128i v = _mm_loadl_epi64((const __m128i *)(row + j * 8));
        const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
        const __m512 w = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), lut), _mm512_set1_ps(eff));
        for (int t = 0; t < nt; t++) acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp + t * K + j * 16), acc[t]);
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc1[t]));
}

#define NVFP4_ROWS512(NAME, DIVIDE, FN)                                                                     \
    T512 static void rows_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,      \
                                 int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, \
                                 int nt, float *y, int64_t ys) {                                            \
        float out[TILE];                                                                                    \
        for (int64_t n = n0; n < n1; n++) {                                                                 \
            const uint8_t *row = w + n * (K / 2), *scl = s + n * (K / 16);                                  \
            const float g = ((const float *)z)[group > 0 ? n / group : 0];                                  \
            ROWS_NT(nt, FN, out, DIVIDE, row, scl, g, k0, k1, xp, K);                                       \
            for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];                                           \
        }                                                                                                   \
    }
NVFP4_ROWS512(nvfp4_avx512, 0, nvfp4_512_row_nt)
NVFP4_ROWS512(nvfp4ct_avx512, 1, nvfp4_512_row_nt)
#else
#define rows_q8_0_avx512 NULL
#define rows_nvfp4_avx512 NULL
#define rows_nvfp4ct_avx512 NULL
#define rows_q6_k_avx512 NULL
#define rows_int8_avx512 NULL
#define rows_fp8_avx512 NULL
#define rows_q4_k_avx512 NULL
#endif
