/* MXFP4 weights times fp32 activations on the CPU: y[t, n] = sum_k x[t, k] * W[n, k].
 *
 * W is stored as ferryman/quant/mxfp4.py describes: row n has G = K/32 blocks of 16 bytes (byte j
 * holds element 2j in its low nibble and 2j+1 in its high one) and G e8m0 scale bytes (2^(s-127)).
 * Each weight is dequantised exactly in fp32 (an e2m1 value times a power of two, with s = 255 as
 * 2^127 then x 2, like the torch reference), then multiplied and accumulated in fp32.
 *
 * Built at first use by ferryman/quant/mxfp4_cpu.py with the system C compiler and -march=native;
 * the AVX-512 path runs where the compiler targets it, the portable loop elsewhere. Rows are
 * split between OpenMP threads when the build has OpenMP. No Python API: loaded with ctypes, which
 * releases the GIL for the call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define BLOCK 32
#define BLOCK_BYTES 16
#define TILE 8 /* tokens per pass over the weights (two to four accumulator registers each) */

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(s-127) for s < 255 and 2^127 for s = 255 (the caller doubles once more), from its bits:
 * exponent field s for s >= 1, and the subnormal 2^-127 (bit 22) for s = 0 */
static inline float scale_of(uint8_t s) {
    uint32_t bits = s == 0 ? 0x00400000u : (uint32_t)(s == 255 ? 254 : s) << 23;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

int ferryman_mxfp4_has_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

int ferryman_mxfp4_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* xd: x reordered per block as [even elements (16), odd elements (16)], [T, K] */
static void deinterleave(const float *x, float *xd, int64_t T, int64_t K) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < K / BLOCK; g++)
            for (int j = 0; j < BLOCK_BYTES; j++) {
                xd[t * K + g * BLOCK + j] = x[t * K + g * BLOCK + 2 * j];
                xd[t * K + g * BLOCK + BLOCK_BYTES + j] = x[t * K + g * BLOCK + 2 * j + 1];
            }
}

#ifdef __AVX512F__
/* One group of 32 weights (16 code bytes and a scale) times nt tokens, into accumulators e/o.
 * The scale multiplies the 16-entry table once, so both halves come out of one permute each. */
#define GROUP_FMA(g, e, o)                                                                          \
    do {                                                                                            \
        __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (g) * BLOCK_BYTES))); \
        uint8_t s = scl[g];                                                                         \
        __m512 lut_s = _mm512_mul_ps(lut, _mm512_set1_ps(scale_of(s)));                             \
        if (s == 255) lut_s = _mm512_mul_ps(lut_s, two);                                            \
        __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(codes, low), lut_s);                   \
        __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut_s);                     \
        const float *xg = xb + (g) * BLOCK;                                                         \
        for (int t = 0; t < nt; t++) {                                                              \
            e[t] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xg + t * K), e[t]);                        \
            o[t] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xg + t * K + BLOCK_BYTES), o[t]);           \
        }                                                                                           \
    } while (0)

/* Row n for tokens [t0, t0+nt). Invariant: callers pass nt as a literal (row_avx512 below), so
 * the token loops unroll and every accumulator stays in a register; with nt <= 4 two sets of
 * accumulators take alternate groups, so no FMA waits on the one before it (latency 4). */
static inline __attribute__((always_inline)) void row_avx512_nt(const uint8_t *blk, const uint8_t *scl,
                                                                const float *xd, int64_t K, int64_t t0,
                                                                const int nt, float *y, int64_t N, int64_t n) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m512i low = _mm512_set1_epi32(0xF);
    const __m512 two = _mm512_set1_ps(2.0f);
    __m512 e0[TILE], o0[TILE], e1[TILE], o1[TILE];
    for (int t = 0; t < nt; t++) e0[t] = o0[t] = e1[t] = o1[t] = _mm512_setzero_ps();
    const int64_t G = K / BLOCK;
    const float *xb = xd + t0 * K;
    int64_t g = 0;
    if (nt <= 4)
        for (; g + 1 < G; g += 2) {
            GROUP_FMA(g, e0, o0);
            GROUP_FMA(g + 1, e1, o1);
        }
    for (; g < G; g++) GROUP_FMA(g, e0, o0);
    for (int t = 0; t < nt; t++)
        y[(t0 + t) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e0[t], o0[t]), _mm512_add_ps(e1[t], o1[t])));
}

/* rows [n, n+1) for tokens [t0, t0+nt), 1 <= nt <= TILE: one specialised body per nt */
static void row_avx512(const uint8_t *blk, const uint8_t *scl, const float *xd, int64_t K, int64_t t0, int nt,
                       float *y, int64_t N, int64_t n) {
    switch (nt) {
    case 1: row_avx512_nt(blk, scl, xd, K, t0, 1, y, N, n); break;
    case 2: row_avx512_nt(blk, scl, xd, K, t0, 2, y, N, n); break;
    case 3: row_avx512_nt(blk, scl, xd, K, t0, 3, y, N, n); break;
    case 4: row_avx512_nt(blk, scl, xd, K, t0, 4, y, N, n); break;
    case 5: row_avx512_nt(blk, scl, xd, K, t0, 5, y, N, n); break;
    case 6: row_avx512_nt(blk, scl, xd, K, t0, 6, y, N, n); break;
    case 7: row_avx512_nt(blk, scl, xd, K, t0, 7, y, N, n); break;
    default: row_avx512_nt(blk, scl, xd, K, t0, 8, y, N, n); break;
    }
}
#endif

static void row_portable(const uint8_t *blk, const uint8_t *scl, const float *xd, int64_t K, int64_t t0, int nt,
                         float *y, int64_t N, int64_t n) {
    float acc[TILE][BLOCK_BYTES];
    memset(acc, 0, sizeof(acc));
    const int64_t G = K / BLOCK;
    for (int64_t g = 0; g < G; g++) {
        float even[BLOCK_BYTES], odd[BLOCK_BYTES];
        uint8_t s = scl[g];
        float sc = scale_of(s), extra = s == 255 ? 2.0f : 1.0f;
        for (int j = 0; j < BLOCK_BYTES; j++) {
            uint8_t b = blk[g * BLOCK_BYTES + j];
            even[j] = E2M1[b & 0xF] * sc * extra;
            odd[j] = E2M1[b >> 4] * sc * extra;
        }
        const float *xg = xd + t0 * K + g * BLOCK;
        for (int t = 0; t < nt; t++)
            for (int j = 0; j < BLOCK_BYTES; j++)
                acc[t][j] += even[j] * xg[t * K + j] + odd[j] * xg[t * K + BLOCK_BYTES + j];
    }
    for (int t = 0; t < nt; t++) {
        float sum = 0.0f;
        for (int j = 0; j < BLOCK_BYTES; j++) sum += acc[t][j];
        y[(t0 + t) * N + n] = sum;
    }
}

/* row n of y = x @ W^T for every token, TILE tokens per pass (the body of the OpenMP loops) */
static void rows(const float *xd, int64_t T, int64_t K, const uint8_t *blocks, const uint8_t *scales, int64_t N,
                 float *y, int64_t n, int portable) {
    const int64_t G = K / BLOCK;
    const uint8_t *blk = blocks + n * G * BLOCK_BYTES, *scl = scales + n * G;
    (void)portable;
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        int nt = (int)(T - t0 < TILE ? T - t0 : TILE);
#ifdef __AVX512F__
        if (!portable) {
            row_avx512(blk, scl, xd, K, t0, nt, y, N, n);
            continue;
        }
#endif
        row_portable(blk, scl, xd, K, t0, nt, y, N, n);
    }
}

/* Scratch memory of the calling thread, grown on demand and kept: a fresh malloc of a few hundred
 * KiB per expert is an mmap, whose first touch page-faults and whose munmap shoots down the TLBs of
 * every OpenMP thread. Two regions, so the experts entry and the expert it calls each have their own. */
static float *scratch(int which, size_t floats) {
    static __thread float *buf[2];
    static __thread size_t cap[2];
    if (floats > cap[which]) {
        free(buf[which]);
        buf[which] = (float *)malloc(sizeof(float) * floats);
        cap[which] = buf[which] == NULL ? 0 : floats;
    }
    return buf[which];
}

static float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

/* One expert on T tokens, in one OpenMP region:
 *   gate_up = x @ W13^T + b13        [T, 2I]
 *   h = act(gate_up)                 [T, I]: kind 0 silu (gate = first I, up = last I); kind 1
 *                                     swiglu_oai (gate = even, up = odd, clamped by limit)
 *   y = h @ W2^T + b2                [T, H]
 * x: [T, H] fp32; b13 [2I], b2 [H] fp32 or NULL. Scratch: [T, H + 4I] fp32 (x reordered, gate_up, h, h reordered). */
static int ferryman_mxfp4_expert(const float *x, int64_t T, int64_t H, int64_t I, const uint8_t *w13b, const uint8_t *w13s,
                          const float *b13, const uint8_t *w2b, const uint8_t *w2s, const float *b2, int kind,
                          float alpha, float limit, float *y, int threads, int portable) {
    if (H % BLOCK != 0 || I % BLOCK != 0 || T < 0) return -1;
    float *xd = scratch(0, (size_t)(T * (H + 4 * I) > 0 ? T * (H + 4 * I) : 1));
    if (xd == NULL) return -1;
    float *gu = xd + T * H, *h = gu + T * 2 * I, *hd = h + T * I;
    deinterleave(x, xd, T, H);
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t n = 0; n < 2 * I; n++) rows(xd, T, H, w13b, w13s, 2 * I, gu, n, portable);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < T; t++) {
            float *g = gu + t * 2 * I, *o = h + t * I;
            for (int64_t i = 0; i < I; i++) {
                if (kind == 0) {
                    float a = g[i] + (b13 ? b13[i] : 0.0f), b = g[I + i] + (b13 ? b13[I + i] : 0.0f);
                    o[i] = a * sigmoidf(a) * b;
                } else {
                    float a = g[2 * i] + (b13 ? b13[2 * i] : 0.0f), b = g[2 * i + 1] + (b13 ? b13[2 * i + 1] : 0.0f);
                    a = a < limit ? a : limit;
                    b = b < -limit ? -limit : (b > limit ? limit : b);
                    o[i] = (b + 1.0f) * (a * sigmoidf(a * alpha));
                }
            }
            for (int64_t g2 = 0; g2 < I / BLOCK; g2++)
                for (int j = 0; j < BLOCK_BYTES; j++) {
                    hd[t * I + g2 * BLOCK + j] = o[g2 * BLOCK + 2 * j];
                    hd[t * I + g2 * BLOCK + BLOCK_BYTES + j] = o[g2 * BLOCK + 2 * j + 1];
                }
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t n = 0; n < H; n++) rows(hd, T, I, w2b, w2s, H, y, n, portable);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < T; t++)
            if (b2)
                for (int64_t n = 0; n < H; n++) y[t * H + n] += b2[n];
    }
    return 0;
}

/* x: [T, K] fp32; blocks: [N, K/32, 16]; scales: [N, K/32]; y: [T, N] fp32.
 * portable != 0 forces the portable loop (tests compare the two). Returns 0, or -1 if K is not a
 * multiple of 32 or memory ran out. */
int ferryman_mxfp4_matmul(const float *x, int64_t T, int64_t K, const uint8_t *blocks, const uint8_t *scales,
                          int64_t N, float *y, int threads, int portable) {
    if (K % BLOCK != 0 || T < 0 || N < 0) return -1;
    float *xd = scratch(0, (size_t)(T * K > 0 ? T * K : 1));
    if (xd == NULL) return -1;
    deinterleave(x, xd, T, K);
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : omp_get_max_threads())
#endif
    for (int64_t n = 0; n < N; n++) rows(xd, T, K, blocks, scales, N, y, n, portable);
    return 0;
}

/* Several experts of one layer, each on its own tokens, summed into out [T, H] (fp32, accumulated):
 *   out[tokens[p]] += weights[p] * expert_e(x[tokens[p]])   for p in [offsets[e], offsets[e+1])
 * Pointer arrays give each expert's banks (b13/b2 entries may be NULL). One call per layer: the
 * caller's thread holds no Python lock while it runs. */
int ferryman_mxfp4_experts(const float *x, int64_t T, int64_t H, int64_t I, int64_t n_experts,
                           const uint8_t *const *w13b, const uint8_t *const *w13s, const float *const *b13,
                           const uint8_t *const *w2b, const uint8_t *const *w2s, const float *const *b2,
                           const int64_t *offsets, const int64_t *tokens, const float *weights, int kind,
                           float alpha, float limit, float *out, int threads, int portable) {
    int64_t most = 0;
    for (int64_t e = 0; e < n_experts; e++)
        if (offsets[e + 1] - offsets[e] > most) most = offsets[e + 1] - offsets[e];
    float *xs = scratch(1, (size_t)(2 * most * H > 0 ? 2 * most * H : 1));
    if (xs == NULL) return -1;
    float *ys = xs + most * H;
    for (int64_t e = 0; e < n_experts; e++) {
        int64_t n = offsets[e + 1] - offsets[e];
        const int64_t *tok = tokens + offsets[e];
        for (int64_t p = 0; p < n; p++) {
            if (tok[p] < 0 || tok[p] >= T) return -2;
            memcpy(xs + p * H, x + tok[p] * H, sizeof(float) * (size_t)H);
        }
        int rc = ferryman_mxfp4_expert(xs, n, H, I, w13b[e], w13s[e], b13[e], w2b[e], w2s[e], b2[e], kind, alpha,
                                       limit, ys, threads, portable);
        if (rc != 0) return rc;
        for (int64_t p = 0; p < n; p++) {
            float w = weights[offsets[e] + p];
            float *o = out + tok[p] * H;
            const float *y = ys + p * H;
            for (int64_t h = 0; h < H; h++) o[h] += w * y[h];
        }
    }
    return 0;
}
