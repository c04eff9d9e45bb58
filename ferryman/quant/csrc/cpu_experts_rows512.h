/* AVX-512 row decoders of packed formats for few tokens (below TILES_FROM): the weights are decoded
 * in registers as they multiply, never stored; each weight is the exact fp32 value the tile decoder
 * (cpu_experts_packed.h) would write. Invariant: callers pass nt as a literal (the switch of each
 * rows_* below), so the token loops unroll into registers. */

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
        const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
        _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
            const float *xs = xp + t * K + b * 32;
            a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs), a0[t]);
            a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs + 16), a1[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

/* k0, k1: multiples of 32 (run_rows' chunks are of SPAN = 128, the last one ends at K) */
T512 static void rows_q8_0_avx512(const uint8_t *w, const uint8_t *s, int64_t K, int64_t n0, int64_t n1, int64_t k0,
                                  int64_t k1, const float *xp, int nt, float *y, int64_t ys) {
    (void)s;
    const int64_t rb = K / 32 * 34;
    float out[TILE];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * rb;
        switch (nt) {
        case 1: q8_0_512_row_nt(row, k0, k1, xp, K, 1, out); break;
        case 2: q8_0_512_row_nt(row, k0, k1, xp, K, 2, out); break;
        case 3: q8_0_512_row_nt(row, k0, k1, xp, K, 3, out); break;
        case 4: q8_0_512_row_nt(row, k0, k1, xp, K, 4, out); break;
        case 5: q8_0_512_row_nt(row, k0, k1, xp, K, 5, out); break;
        case 6: q8_0_512_row_nt(row, k0, k1, xp, K, 6, out); break;
        case 7: q8_0_512_row_nt(row, k0, k1, xp, K, 7, out); break;
        default: q8_0_512_row_nt(row, k0, k1, xp, K, 8, out); break;
        }
        for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];
    }
}

/* Q4_K rows with AVX-512, few tokens (below TILES_FROM): per 64 values (one 32-byte run of nibbles,
 * sub-blocks 2c and 2c + 1), a table of each sub-block's 16 weights (d x sc x q - dmin x m for q =
 * 0..15, one rounding as the reference's) is looked up by the nibbles themselves: vpermps reads the
 * low 4 bits of each lane, so the low nibbles need no mask and the high ones one shift. Two
 * accumulator sets take alternate vectors. Invariant: callers pass nt as a literal (q4k512_row). */
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
        _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(d),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u)))));
        _mm256_storeu_ps(ms, _mm256_mul_ps(_mm256_set1_ps(dmin),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2))))));
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
T512 static void rows_q4_k_avx512(const uint8_t *w, const uint8_t *s, int64_t K, int64_t n0, int64_t n1, int64_t k0,
                                  int64_t k1, const float *xp, int nt, float *y, int64_t ys) {
    (void)s;
    const int64_t rb = K / QK_K * 144;
    float out[TILE];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * rb;
        switch (nt) {
        case 1: q4k512_row_nt(row, k0, k1, xp, K, 1, out); break;
        case 2: q4k512_row_nt(row, k0, k1, xp, K, 2, out); break;
        case 3: q4k512_row_nt(row, k0, k1, xp, K, 3, out); break;
        case 4: q4k512_row_nt(row, k0, k1, xp, K, 4, out); break;
        case 5: q4k512_row_nt(row, k0, k1, xp, K, 5, out); break;
        case 6: q4k512_row_nt(row, k0, k1, xp, K, 6, out); break;
        case 7: q4k512_row_nt(row, k0, k1, xp, K, 7, out); break;
        default: q4k512_row_nt(row, k0, k1, xp, K, 8, out); break;
        }
        for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];
    }
}
#else
#define rows_q8_0_avx512 NULL
#define rows_q4_k_avx512 NULL
#endif
