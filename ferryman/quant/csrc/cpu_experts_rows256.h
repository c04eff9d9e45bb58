/* AVX2 row decoders of packed formats for few tokens (below TILES_FROM), as cpu_experts_rows512.h's
 * with 8-lane vectors: weights decoded in registers, each the exact fp32 value of the tile decoder;
 * the `*_nt` functions are called through ROWS_NT. */

#ifdef FM_X86
INLINE256 float hsum256(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

/* Q8_0: per block of 32, four 8-byte loads of int8 widened to fp32, times the block's d (exact) */
INLINE256 void q8_0_256_row_nt(const uint8_t *row, int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt,
                               float *out) {
    __m256 a0[TILE], a1[TILE];
    for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t b = k0 / 32; b < k1 / 32; b++) {
        const uint8_t *blk = row + b * 34;
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);
        const __m256 d = _mm256_set1_ps(f16_at(blk));
        for (int q = 0; q < 4; q += 2) {
            const __m256i q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * q)));
            const __m256i q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 10 + 8 * q)));
            const __m256 w0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q0)), w1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q1));
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                const float *xs = xp + t * K + b * 32 + 8 * q;
                a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs), a0[t]);
                a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs + 8), a1[t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum256(_mm256_add_ps(a0[t], a1[t]));
}

/* Q4_K: per 64 values (sub-blocks 2c, 2c + 1), 8 bytes of nibbles at a time widened; each weight
 * q x (d x sc) - dmin x m in one fused rounding, as the exact products' difference rounds once */
INLINE256 void q4k256_row_nt(const uint8_t *row, int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt,
                             float *out) {
    const __m256i m4 = _mm256_set1_epi32(0xF);
    __m256 a0[TILE], a1[TILE];
    for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t b = k0 / QK_K; b * QK_K < k1; b++) {
        const uint8_t *blk = row + b * 144;
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        const int c0 = b * QK_K < k0 ? (int)(k0 - b * QK_K) / 64 : 0;
        const int c1 = (b + 1) * QK_K > k1 ? (int)(k1 - b * QK_K) / 64 : 4;
        for (int c = c0; c < c1; c++) {
            int sc0, mn0, sc1, mn1;
            k_scale_min(blk + 4, 2 * c, &sc0, &mn0);
            k_scale_min(blk + 4, 2 * c + 1, &sc1, &mn1);
            const __m256 ds0 = _mm256_set1_ps(d * (float)sc0), ms0 = _mm256_set1_ps(dmin * (float)mn0);
            const __m256 ds1 = _mm256_set1_ps(d * (float)sc1), ms1 = _mm256_set1_ps(dmin * (float)mn1);
            const uint8_t *qs = blk + 16 + c * 32;
            const int64_t k = b * QK_K + c * 64;
            for (int l = 0; l < 32; l += 8) {
                const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + l)));
                const __m256 lo = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, m4)), ds0, ms0);
                const __m256 hi = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), ds1, ms1);
                _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                    const float *xs = xp + t * K + k + l;
                    a0[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs), a0[t]);
                    a1[t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs + 32), a1[t]);
                }
            }
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum256(_mm256_add_ps(a0[t], a1[t]));
}

/* k0, k1: multiples of 32 */
GGUF_ROWS(q8_0_avx2, T256, q8_0_row_bytes, q8_0_256_row_nt)
/* k0, k1: multiples of 64 */
GGUF_ROWS(q4_k_avx2, T256, q4_k_row_bytes, q4k256_row_nt)

/* int4 / int8 words with group scales (and zeros): per 16 values, int4's 8 bytes as 16 codes in
 * element order (low, high nibble of each byte) or int8's 16 bytes, widened, minus the zero point,
 * times the group's scale (one rounding, as int_rows'); a group's values past its last whole 16
 * through the scalar loop (groups are multiples of 8) */
INLINE256 void int256_row_nt(int bits, const uint8_t *row, const float *scl, const uint8_t *zr, int64_t gs,
                             int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt, float *out) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const int mid = 1 << (bits - 1);
    __m256 a0[TILE], a1[TILE];
    float tail[TILE] = {0};
    for (int t = 0; t < nt; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1;) {
        const int64_t g = k / gs, end = (g + 1) * gs < k1 ? (g + 1) * gs : k1;
        const int zero = zr ? zr[g] : mid;
        const float sc = scl[g];
        const __m256 scv = _mm256_set1_ps(sc);
        const __m256i zv = _mm256_set1_epi32(zero);
        for (; k + 16 <= end; k += 16) {
            _mm_prefetch((const char *)(row + k * bits / 8) + PREFETCH_AHEAD, _MM_HINT_T0);
            __m128i codes;
            if (bits == 4) {
                const __m128i v = _mm_loadl_epi64((const __m128i *)(row + k / 2));
                codes = _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
            } else {
                codes = _mm_loadu_si128((const __m128i *)(row + k));
            }
            const __m256i q0 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(codes), zv);
            const __m256i q1 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)), zv);
            const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(q0), scv);
            const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(q1), scv);
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                const float *xs = xp + t * K + k;
                a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs), a0[t]);
                a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs + 8), a1[t]);
            }
        }
        k = int_tail(bits, row, zero, sc, k, end, xp, K, nt, tail);
    }
    for (int t = 0; t < nt; t++) out[t] = hsum256(_mm256_add_ps(a0[t], a1[t])) + tail[t];
}

INT_ROWS(int4_avx2, T256, 4, int256_row_nt)
INT_ROWS(int8_avx2, T256, 8, int256_row_nt)

/* Q6_K: per 128 values (half a block), as q6k512_row_nt: the 6-bit codes put together as bytes, 32
 * values per register (the 32 qh bytes shifted per 16-bit lane by 0 / 2 / 4 / 6 give the two high bits
 * of values 0-31 / 32-63 / 64-95 / 96-127; a word shift's spill past a byte is masked away), minus 32,
 * kept in a small buffer; then each 8 are widened to fp32 and times d x their sub-block's scale */
INLINE256 void q6k256_row_nt(const uint8_t *row, int64_t k0, int64_t k1, const float *xp, int64_t K, const int nt,
                             float *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
    int8_t codes[128] __attribute__((aligned(32)));
    __m256 acc[TILE];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t kh = k0; kh < k1; kh += 128) { /* half a block: 128 values */
        const int64_t b = kh / QK_K;
        const int h = (int)(kh / 128) & 1;
        const uint8_t *blk = row + b * 210;
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD + 64 * h, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD + 128 + 40 * h, _MM_HINT_T0);
        float ds[8]; /* d x the half's 8 scales, exact */
        const __m256i s8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192 + h * 8)));
        _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(f16_at(blk + 208)), _mm256_cvtepi32_ps(s8)));
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + h * 64));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + h * 64 + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
        const __m256i lows[4] = {_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4),
                                 _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4)};
        for (int r = 0; r < 4; r++) { /* values 32r..32r+31: their high bits are qh's bits 2r, 2r + 1 */
            const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), m2);
            const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lows[r], _mm256_slli_epi16(hb, 4)), c32);
            _mm256_store_si256((__m256i *)(codes + 32 * r), q);
        }
        const int64_t k = b * QK_K + h * 128;
        for (int j = 0; j < 16; j++) { /* 8 values: sub-block j / 2 */
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * j)));
            const __m256 w = _mm256_mul_ps(_mm256_set1_ps(ds[j / 2]), _mm256_cvtepi32_ps(q));
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++)
                acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp + t * K + k + 8 * j), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum256(acc[t]);
}

/* k0, k1: multiples of 128, half a block */
GGUF_ROWS(q6_k_avx2, T256, q6_k_row_bytes, q6k256_row_nt)
#else
#define rows_q8_0_avx2 NULL
#define rows_q6_k_avx2 NULL
#define rows_int4_avx2 NULL
#define rows_int8_avx2 NULL
#define rows_q4_k_avx2 NULL
#endif
