/* Routed experts on the CPU, straight from their packed bytes: y[t, n] = sum_k x[t, k] * W[n, k].
 *
 * One format = one row decoder (`rows_*`: a range of rows of W times nt prepared tokens) and one
 * activation preparation (`prep_*`), listed in FORMATS below. Formats:
 *   0 mxfp4  W = blocks [N, K/32, 16] (byte j: element 2j low nibble, 2j+1 high) + e8m0 scales [N, K/32]
 *   1 bf16   W = [N, K] bfloat16
 *   2 f32    W = [N, K] float32
 *   3 f16    W = [N, K] float16
 *   4 bf16x  W = [N, K] bfloat16 times activations that are bf16 values (the caller's activations
 *            were bf16, so rounding them back is exact): AVX512-BF16's dot product where the CPU has it
 *   5-12     GGUF q8_0 / q4_k / q6_k blocks, int4 / int8 words with group scales (and zeros), fp8
 *            e4m3 with square block or row scales, nvfp4 / nvfp4-ct: tile decoders, cpu_experts_packed.h,
 *            and AVX-512 row decoders, cpu_experts_rows512.h (int4's and nvfp4's, in 128-value spans with
 *            activations in MXFP4's span order, and their tile decoders: cpu_experts_spans512.h)
 * Products and sums are fp32; each weight is dequantised exactly (an MXFP4 row whose scales hold 0 or
 * 255 takes the per-group path that multiplies like the torch reference).
 *
 * Several tokens per matrix: each format also has a decoder (`decode_*`: a tile of rows and a chunk of
 * K as exact fp32 weights, in the order of its prepared activations), so a weight is decoded once per
 * tile whatever the token count, and one dot-product kernel per ISA (`dots_*`, shared by all
 * formats: blocks of rows x tokens in registers) applies the tile to every token. Below the ISA's
 * TILES_FROM tokens, or on an ISA without a dots kernel: the row decoders, which decode in registers
 * as they multiply.
 *
 * `ferryman_cpu_experts` computes a whole MoE layer's job (several experts, each on its own tokens)
 * in ONE OpenMP region: the gate/up rows of all its experts are split evenly between the threads,
 * then the activation, then the down rows of all experts, then the weighted sum per output column,
 * with a barrier between phases (four per layer, not four per expert).
 *
 * Instruction sets are chosen at run time from what the CPU reports (CPUID through
 * __builtin_cpu_supports): AVX-512 (F+BW), AVX2+FMA, or the portable loop; each vector function
 * carries its own target attribute, so the library builds without -march flags and runs anywhere.
 * Loaded with ctypes by ferryman/quant/cpu_kernel.py, which builds it at first use.
 *
 * A new format (other GGUF types, ...): a `decode_*` tile decoder per ISA (one
 * portable body compiled per ISA, as cpu_experts_packed.h does), optionally `rows_*` decoders (NULL:
 * tiles for every token count, through dots_portable where the ISA has no dots kernel), a `prep_*`
 * if its activations want another order (`prep_vec`: another from ISA `prep_from` on), `row_bytes`, one entry in FORMATS; then its code in
 * cpu_kernel.py (KERNEL_FORMATS or packed_codes) and its bank names in cpu_layer.py (BANKS or
 * PACKED_BANKS). Weights and scales arrive as two pointers per expert
 * and projection (scales may be NULL), rows of W contiguous; everything else is shared.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#define FM_X86 1
#include <immintrin.h>
#endif

#define BLOCK 32
#define BLOCK_BYTES 16
#define SPAN 128      /* MXFP4 weights of one 64-byte vector load (4 groups) */
#define TILE 8        /* tokens per pass over a row */
/* FN(args..., nt, out) with nt (1..TILE) as a literal, so FN's token loops unroll into registers: the
 * row decoders' `*_nt` functions are only called through this */
#define ROWS_NT(nt, FN, out, ...)                                                                       \
    switch (nt) {                                                                                       \
    case 1: FN(__VA_ARGS__, 1, out); break;                                                             \
    case 2: FN(__VA_ARGS__, 2, out); break;                                                             \
    case 3: FN(__VA_ARGS__, 3, out); break;                                                             \
    case 4: FN(__VA_ARGS__, 4, out); break;                                                             \
    case 5: FN(__VA_ARGS__, 5, out); break;                                                             \
    case 6: FN(__VA_ARGS__, 6, out); break;                                                             \
    case 7: FN(__VA_ARGS__, 7, out); break;                                                             \
    default: FN(__VA_ARGS__, 8, out); break;                                                            \
    }

/* rows_NAME (target ATTR): GGUF rows of ROW_BYTES(K) bytes of blocks, each through
 * FN(row, k0, k1, xp, K, nt, out) */
#define GGUF_ROWS(NAME, ATTR, ROW_BYTES, FN)                                                            \
    ATTR static void rows_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,  \
                                 int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1,             \
                                 const float *xp, int nt, float *y, int64_t ys) {                       \
        (void)s, (void)z, (void)group;                                                                  \
        const int64_t rb = ROW_BYTES(K);                                                                \
        float out[TILE];                                                                                \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            ROWS_NT(nt, FN, out, w + n * rb, k0, k1, xp, K);                                            \
            for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];                                       \
        }                                                                                               \
    }

/* rows_NAME (target ATTR): int words of BITS with group scales (and zeros), each row through
 * FN(BITS, row, scales, zeros or NULL, group size, k0, k1, xp, K, nt, out) */
#define INT_ROWS(NAME, ATTR, BITS, FN)                                                                  \
    ATTR static void rows_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,  \
                                 int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1,             \
                                 const float *xp, int nt, float *y, int64_t ys) {                       \
        const int64_t gs = group > 0 ? group : K, G = K / gs, rb = K * BITS / 8;                        \
        float out[TILE];                                                                                \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            const uint8_t *zr = z ? z + n * G : NULL;                                                   \
            const float *scl = (const float *)s + n * G;                                                \
            ROWS_NT(nt, FN, out, BITS, w + n * rb, scl, zr, gs, k0, k1, xp, K);                         \
            for (int t = 0; t < nt; t++) y[t * ys + n] += out[t];                                       \
        }                                                                                               \
    }
/* how far ahead the row decoders prefetch a row's bytes: from DRAM one core keeps several KB in flight
 * (docs/benchmarks.md, "CPU expert kernel": 1 KB ahead left Q8_0 / Q4_K rows waiting on memory) */
#define PREFETCH_AHEAD 8192
#define MAX_GROUPS 4096 /* K <= 131072 for the per-row scale table */

enum { FMT_MXFP4, FMT_BF16, FMT_F32, FMT_F16, FMT_BF16X, FMT_Q8_0, FMT_Q4_K, FMT_Q6_K, FMT_INT4, FMT_INT8, FMT_FP8, FMT_NVFP4,
       FMT_NVFP4CT, N_FORMATS };
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, N_ISAS };

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float bits_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

/* 2^(s-127) for s < 255 and 2^127 for s = 255 (the caller doubles once more) */
static inline float scale_of(uint8_t s) {
    return bits_float(s == 0 ? 0x00400000u : (uint32_t)(s == 255 ? 254 : s) << 23);
}

static inline float half_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0x1F) return bits_float(sign | 0x7F800000u | (m << 13));
    if (e != 0) return bits_float(sign | ((e + 112) << 23) | (m << 13));
    float v = (float)m * 5.9604644775390625e-08f; /* 2^-24 */
    return sign ? -v : v;
}

/* ---- activations prepared per format -------------------------------------------------------- */
/* mxfp4: K/SPAN spans, each as 8 vectors of 16: vector v = 2*k + nib holds, in lane d, element
 * 2*(4d + k) + nib of the span (the order the 64-byte decoder produces); the remaining groups as
 * [16 even, 16 odd] (the per-group decoder's order). Other formats: x as it is. */
static void prep_span(const float *x, float *xp) {
    for (int v = 0; v < 8; v++)
        for (int d = 0; d < 16; d++) xp[v * 16 + d] = x[2 * (4 * d + v / 2) + v % 2];
}

static void prep_mxfp4(const float *x, float *xp, int64_t K) {
    int64_t spans = K / SPAN;
    for (int64_t s = 0; s < spans; s++) prep_span(x + s * SPAN, xp + s * SPAN);
    for (int64_t g = spans * SPAN / BLOCK; g < K / BLOCK; g++)
        for (int j = 0; j < BLOCK_BYTES; j++) {
            xp[g * BLOCK + j] = x[g * BLOCK + 2 * j];
            xp[g * BLOCK + BLOCK_BYTES + j] = x[g * BLOCK + 2 * j + 1];
        }
}

static void prep_plain(const float *x, float *xp, int64_t K) { memcpy(xp, x, sizeof(float) * (size_t)K); }

/* int4 (AVX2 and AVX-512) and nvfp4 (AVX-512): their span decoders (cpu_experts_spans512.h,
 * cpu_experts_spans256.h) read whole spans as MXFP4's, the values after the last one as they are */
static void prep_spans(const float *x, float *xp, int64_t K) {
    int64_t whole = K / SPAN * SPAN;
    for (int64_t s = 0; s < whole; s += SPAN) prep_span(x + s, xp + s);
    memcpy(xp + whole, x + whole, sizeof(float) * (size_t)(K - whole));
}

/* bf16x: x's values (bf16 ones, held in fp32) as bf16, in the first 2K bytes of the token's row */
static void prep_bf16(const float *x, float *xp, int64_t K) {
    uint16_t *out = (uint16_t *)xp;
    for (int64_t k = 0; k < K; k++) {
        uint32_t b;
        memcpy(&b, x + k, 4);
        out[k] = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16); /* round to nearest even (exact on bf16 values) */
    }
}

/* ---- row decoders: y[t * ys + n] += W[n, k0:k1] . xp[t, k0:k1] for n in [n0, n1), t < nt -------
 * k0, k1: multiples of SPAN, or k1 = K (MXFP4's groups after the last whole span go with the last
 * chunk). Chunks keep a tile of tokens' activations in L1 while the rows stream by. */
typedef void (*rows_fn)(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                        int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, int nt, float *y,
                        int64_t ys);

/* whether groups [g0, g1) of an MXFP4 row hold a scale of 0 or 255 (exact only through the
 * per-group path) */
static int extreme_scales(const uint8_t *scl, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
        if (scl[g] == 0 || scl[g] == 255) return 1;
    return 0;
}

static void mxfp4_group_portable(const uint8_t *blk, uint8_t s, const float *xg, int64_t K, int nt, float *acc) {
    float sc = scale_of(s), extra = s == 255 ? 2.0f : 1.0f;
    for (int j = 0; j < BLOCK_BYTES; j++) {
        float even = E2M1[blk[j] & 0xF] * sc * extra, odd = E2M1[blk[j] >> 4] * sc * extra;
        for (int t = 0; t < nt; t++) acc[t] += even * xg[t * K + j] + odd * xg[t * K + BLOCK_BYTES + j];
    }
}

/* the portable loop; also every chunk with extreme scales, where it multiplies as the reference does */
static void rows_mxfp4_portable(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                                int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, int nt, float *y,
                                int64_t ys) {
    const int64_t G = K / BLOCK, spans = K / SPAN, sp1 = k1 / SPAN < spans ? k1 / SPAN : spans;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = w + n * G * BLOCK_BYTES, *scl = s + n * G;
        float acc[TILE] = {0};
        for (int64_t sp = k0 / SPAN; sp < sp1; sp++) /* a span's x is in the 64-byte decoder's order */
            for (int g = 0; g < 4; g++) {
                float sc = scale_of(scl[sp * 4 + g]), extra = scl[sp * 4 + g] == 255 ? 2.0f : 1.0f;
                for (int b = 0; b < BLOCK_BYTES; b++) {
                    int byte = g * BLOCK_BYTES + b, d = byte / 4, k = byte % 4;
                    uint8_t code = blk[sp * 64 + byte];
                    float even = E2M1[code & 0xF] * sc * extra, odd = E2M1[code >> 4] * sc * extra;
                    const float *xs = xp + sp * SPAN;
                    for (int t = 0; t < nt; t++)
                        acc[t] += even * xs[t * K + (2 * k) * 16 + d] + odd * xs[t * K + (2 * k + 1) * 16 + d];
                }
            }
        if (k1 == K)
            for (int64_t g = spans * 4; g < G; g++)
                mxfp4_group_portable(blk + g * BLOCK_BYTES, scl[g], xp + g * BLOCK, K, nt, acc);
        for (int t = 0; t < nt; t++) y[t * ys + n] += acc[t];
    }
}

#define DENSE_PORTABLE(NAME, TYPE, SCALAR)                                                              \
    static void rows_##NAME(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group,        \
                            int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, \
                            int nt, float *y, int64_t ys) {                                             \
        (void)s, (void)z, (void)group;                                                                  \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            const TYPE *row = (const TYPE *)w + n * K;                                                  \
            float acc[TILE] = {0};                                                                      \
            for (int64_t k = k0; k < k1; k++) {                                                         \
                float v = SCALAR(row[k]);                                                               \
                for (int t = 0; t < nt; t++) acc[t] += v * xp[t * K + k];                               \
            }                                                                                           \
            for (int t = 0; t < nt; t++) y[t * ys + n] += acc[t];                                       \
        }                                                                                               \
    }

static inline float bf16_scalar(uint16_t v) { return bits_float((uint32_t)v << 16); }
static inline float f32_scalar(float v) { return v; }
DENSE_PORTABLE(bf16_portable, uint16_t, bf16_scalar)
DENSE_PORTABLE(f32_portable, float, f32_scalar)
DENSE_PORTABLE(f16_portable, uint16_t, half_float)

static void rows_bf16x_portable(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                                int64_t n0, int64_t n1, int64_t k0, int64_t k1, const float *xp, int nt, float *y,
                                int64_t ys) {
    (void)s, (void)z, (void)group;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *row = (const uint16_t *)w + n * K;
        float acc[TILE] = {0};
        for (int64_t k = k0; k < k1; k++) {
            float v = bf16_scalar(row[k]);
            for (int t = 0; t < nt; t++) acc[t] += v * bf16_scalar(((const uint16_t *)(xp + t * K))[k]);
        }
        for (int t = 0; t < nt; t++) y[t * ys + n] += acc[t];
    }
}

/* ---- tile decoders: rows [n0, n1) x [k0, k1) of W as fp32 into wb[(n - n0) * ld + k - k0], in the
 * order of the prepared activations (k0, k1 as for the row decoders). Each weight is exact: an
 * MXFP4 code times its power-of-two scale (inf where the reference's is). */
typedef void (*decode_fn)(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                          int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld);

/* dot products of a decoded tile with nt prepared tokens: y[t * ys + r] += wb[r, 0:len] . xp[t * K + 0:len]
 * for r < nr, t < nt */
typedef void (*dots_fn)(const float *wb, int64_t ld, int64_t nr, const float *xp, int64_t K, int64_t nt,
                        int64_t len, float *y, int64_t ys);

static inline float mxfp4_value(uint8_t code, uint8_t s) {
    return E2M1[code] * scale_of(s) * (s == 255 ? 2.0f : 1.0f);
}

/* the AVX-512 decoder's way for rows with scales of 0 or 255 */
static void decode_mxfp4_portable(const uint8_t *w, const uint8_t *s, const uint8_t *z, int64_t group, int64_t K,
                                  int64_t n0, int64_t n1, int64_t k0, int64_t k1, float *wb, int64_t ld) {
    (void)z, (void)group;
    const int64_t G = K / BLOCK, spans = K / SPAN, sp1 = k1 / SPAN < spans ? k1 / SPAN : spans;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = w + n * G * BLOCK_BYTES, *scl = s + n * G;
        float *out = wb + (n - n0) * ld - k0;
        for (int64_t sp = k0 / SPAN; sp < sp1; sp++) /* vector v, lane d: byte 4d + v/2, nibble v%2 */
            for (int v = 0; v < 8; v++)
                for (int d = 0; d < 16; d++) {
                    int byte = 4 * d + v / 2;
                    uint8_t code = blk[sp * 64 + byte];
                    out[sp * SPAN + v * 16 + d] = mxfp4_value(v % 2 ? code >> 4 : code & 0xF, scl[sp * 4 + byte / 16]);
                }
        if (k1 == K)
            for (int64_t g = spans * 4; g < G; g++)
                for (int j = 0; j < BLOCK_BYTES; j++) {
                    uint8_t code = blk[g * BLOCK_BYTES + j];
                    out[g * BLOCK + j] = mxfp4_value(code & 0xF, scl[g]);
                    out[g * BLOCK + BLOCK_BYTES + j] = mxfp4_value(code >> 4, scl[g]);
                }
    }
}

#ifdef FM_X86
#include "cpu_experts_x86.h"
#else
#define rows_mxfp4_avx512 rows_mxfp4_portable
#define rows_bf16_avx512 rows_bf16_portable
#define rows_f32_avx512 rows_f32_portable
#define rows_f16_avx512 rows_f16_portable
#define rows_bf16_avx2 rows_bf16_portable
#define rows_f32_avx2 rows_f32_portable
#define rows_f16_avx2 rows_f16_portable
#define rows_bf16x_avx512bf16 rows_bf16x_portable
#define decode_mxfp4_avx512 NULL
#define decode_bf16_avx512 NULL
#define decode_f32_avx512 NULL
#define decode_f16_avx512 NULL
#define dots_avx512 NULL
#define decode_mxfp4_avx2 NULL
#define decode_bf16_avx2 NULL
#define decode_f32_avx2 NULL
#define decode_f16_avx2 NULL
#define dots_avx2 NULL
static int cpu_has(int isa) { return isa == ISA_PORTABLE; }
#endif
#include "cpu_experts_packed.h"
#include "cpu_experts_rows512.h"
#include "cpu_experts_spans512.h"
#include "cpu_experts_rows256.h"
#include "cpu_experts_spans256.h"
#include "cpu_experts_fp256.h"

typedef struct {
    int64_t (*row_bytes)(int64_t K); /* bytes of one row of W, scales included */
    void (*prep)(const float *x, float *xp, int64_t K);
    void (*prep_vec)(const float *x, float *xp, int64_t K); /* from ISA prep_from on, where it differs */
    int prep_from;
    int64_t k_multiple;              /* K must be a multiple of this */
    rows_fn rows[N_ISAS];            /* by ISA_*; NULL: tiles only, for every token count */
    decode_fn decode[N_ISAS];        /* by ISA_*: NULL where the ISA has no dots kernel (DOTS) */
} format_t;

/* the dots kernel of each ISA (NULL: its formats take the row decoders for any token count), and the
 * token count from which it takes over from the row decoders (measured on one core of the dev VM,
 * docs/benchmarks.md: the row decoders, prefetching 8 KB ahead, are faster up to 7 tokens in every
 * format that has one, even at 8; on AVX2 all but MXFP4 have one) */
static const dots_fn DOTS[N_ISAS] = {NULL, dots_avx2, dots_avx512, dots_avx512};
static const int TILES_FROM[N_ISAS] = {0, 8, 8, 8};

static int64_t mxfp4_row_bytes(int64_t K) { return K / 2 + K / BLOCK; }
static int64_t two_byte_row(int64_t K) { return 2 * K; }
static int64_t four_byte_row(int64_t K) { return 4 * K; }

static const format_t FORMATS[N_FORMATS] = {
    [FMT_MXFP4] = {mxfp4_row_bytes, prep_mxfp4, NULL, 0, BLOCK,
                   {rows_mxfp4_portable, NULL, rows_mxfp4_avx512, rows_mxfp4_avx512}, /* AVX2: tiles */
                   {NULL, decode_mxfp4_avx2, decode_mxfp4_avx512, decode_mxfp4_avx512}},
    [FMT_BF16] = {two_byte_row, prep_plain, NULL, 0, 1,
                  {rows_bf16_portable, rows_bf16_avx2, rows_bf16_avx512, rows_bf16_avx512},
                  {NULL, decode_bf16_avx2, decode_bf16_avx512, decode_bf16_avx512}},
    [FMT_F32] = {four_byte_row, prep_plain, NULL, 0, 1,
                 {rows_f32_portable, rows_f32_avx2, rows_f32_avx512, rows_f32_avx512},
                 {NULL, decode_f32_avx2, decode_f32_avx512, decode_f32_avx512}},
    [FMT_F16] = {two_byte_row, prep_plain, NULL, 0, 1,
                 {rows_f16_portable, rows_f16_avx2, rows_f16_avx512, rows_f16_avx512},
                 {NULL, decode_f16_avx2, decode_f16_avx512, decode_f16_avx512}},
    /* bf16x where the CPU lacks AVX512-BF16: callers use FMT_BF16 there (cpu_kernel.py); the
     * portable loop keeps the format exact everywhere */
    [FMT_BF16X] = {two_byte_row, prep_bf16, NULL, 0, 1,
                   {rows_bf16x_portable, rows_bf16x_portable, rows_bf16x_portable, rows_bf16x_avx512bf16},
                   {NULL, NULL, NULL, NULL}},
    /* packed formats: AVX-512 row decoders below TILES_FROM tokens (cpu_experts_rows512.h), tiles else */
    [FMT_Q8_0] = {q8_0_row_bytes, prep_plain, NULL, 0, 32, {NULL, rows_q8_0_avx2, rows_q8_0_avx512, rows_q8_0_avx512},
                  {decode_q8_0_portable, decode_q8_0_avx2, decode_q8_0_avx512, decode_q8_0_avx512}},
    [FMT_Q4_K] = {q4_k_row_bytes, prep_plain, NULL, 0, QK_K, {NULL, rows_q4_k_avx2, rows_q4_k_avx512, rows_q4_k_avx512},
                  {decode_q4_k_portable, decode_q4_k_avx2, decode_q4_k_avx512, decode_q4_k_avx512}},
    [FMT_Q6_K] = {q6_k_row_bytes, prep_plain, NULL, 0, QK_K, {NULL, rows_q6_k_avx2, rows_q6_k_avx512, rows_q6_k_avx512},
                  {decode_q6_k_portable, decode_q6_k_avx2, decode_q6_k_avx512, decode_q6_k_avx512}},
    [FMT_INT4] = {int4_row_bytes, prep_plain, prep_spans, ISA_AVX2, 8,
                  {NULL, rows_int4span_avx2, rows_int4span_avx512, rows_int4span_avx512},
                  {decode_int4_portable, decode_int4span_avx2, decode_int4span_avx512, decode_int4span_avx512}},
    [FMT_INT8] = {int8_row_bytes, prep_plain, NULL, 0, 4, {NULL, rows_int8_avx2, rows_int8_avx512, rows_int8_avx512},
                  {decode_int8_portable, decode_int8_avx2, decode_int8_avx512, decode_int8_avx512}},
    [FMT_FP8] = {fp8_row_bytes, prep_plain, NULL, 0, 1, {NULL, rows_fp8_avx2, rows_fp8_avx512, rows_fp8_avx512},
                 {decode_fp8_portable, decode_fp8_avx2, decode_fp8_avx512, decode_fp8_avx512}},
    [FMT_NVFP4] = {nvfp4_row_bytes, prep_plain, prep_spans, ISA_AVX512, 16,
                   {NULL, rows_nvfp4_avx2, rows_nvfp4span_avx512, rows_nvfp4span_avx512},
                   {decode_nvfp4_portable, decode_nvfp4_avx2, decode_nvfp4span_avx512, decode_nvfp4span_avx512}},
    [FMT_NVFP4CT] = {nvfp4ct_row_bytes, prep_plain, prep_spans, ISA_AVX512, 16,
                     {NULL, rows_nvfp4ct_avx2, rows_nvfp4ctspan_avx512, rows_nvfp4ctspan_avx512},
                     {decode_nvfp4ct_portable, decode_nvfp4ct_avx2, decode_nvfp4ctspan_avx512,
                      decode_nvfp4ctspan_avx512}},
};

/* how format f prepares activations for its kernels on isa */
typedef void (*prep_fn)(const float *x, float *xp, int64_t K);
static prep_fn prep_of(const format_t *f, int isa) { return f->prep_vec && isa >= f->prep_from ? f->prep_vec : f->prep; }

/* the best instruction set at most `limit` that this CPU runs (and this build holds) */
static int pick_isa(int limit) {
    for (int isa = limit; isa > ISA_PORTABLE; isa--)
        if (cpu_has(isa)) return isa;
    return ISA_PORTABLE;
}

int ferryman_cpu_isa(void) { return pick_isa(ISA_AVX512BF16); }

int ferryman_cpu_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#include "cpu_experts_layer.h"
