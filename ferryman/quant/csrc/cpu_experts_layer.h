/* The entries of cpu_experts.c: one layer's experts in one OpenMP region, and one product. */

#define ROW_BLOCK 16 /* rows per pass: they stay in L2 while each tile of tokens goes over them */
#define L1_X_BYTES 24576 /* the activations' share of L1: a tile's chunk of K holds at most this */

/* A decoded tile (18 KiB of fp32 with its tail) stays in L1 while each group of tokens goes over
 * it; of 2-16 rows x 256-3072 columns, 4 x 1024 was fastest at 4-32 tokens on one core of the dev VM. */
#define TILE_ROWS 4        /* rows of a decoded tile (one register block of dots_*) */
#define TILE_K 1024        /* K per decoded tile (a multiple of SPAN; the last one takes what is left) */

/* How one format multiplies on one ISA: the row decoder, and the tile decoder and dots kernel for
 * tiles_from tokens and more (decode NULL: the row decoder for any token count). */
typedef struct {
    rows_fn rows;
    decode_fn decode;
    dots_fn dots;
    int tiles_from;
} kernel_t;

static kernel_t kernel_of(const format_t *f, int isa) {
    if (f->rows[isa] == NULL) { /* a format with tile decoders only: tiles from one token, on any ISA */
        kernel_t k = {NULL, f->decode[isa], DOTS[isa] ? DOTS[isa] : dots_portable, 1};
        return k;
    }
    kernel_t k = {f->rows[isa], DOTS[isa] ? f->decode[isa] : NULL, DOTS[isa], TILES_FROM[isa]};
    return k;
}

/* one matrix: weights, scales and zeros (NULL where the format has none), inputs per scale group
 * (0: one group per row) */
typedef struct {
    const uint8_t *w, *s, *z;
    int64_t group;
} mat_t;

/* rows [n0, n1) for several tokens: each tile of TILE_ROWS rows x TILE_K is decoded once, into this
 * thread's stack, then multiplied by all T tokens; y accumulates the tiles' sums. */
static void run_tiles(const kernel_t *kn, const mat_t *m, int64_t K, int64_t n0, int64_t n1, const float *xp,
                      int64_t T, float *y, int64_t ys) {
    float wb[TILE_ROWS * (TILE_K + SPAN)] __attribute__((aligned(64)));
    const int64_t whole = K / SPAN * SPAN; /* the last tile of a row takes the columns after this */
    for (int64_t nb = n0; nb < n1; nb += TILE_ROWS) {
        int64_t ne = nb + TILE_ROWS < n1 ? nb + TILE_ROWS : n1;
        for (int64_t k0 = 0; k0 < K;) {
            int64_t k1 = k0 + TILE_K >= whole ? K : k0 + TILE_K;
            kn->decode(m->w, m->s, m->z, m->group, K, nb, ne, k0, k1, wb, TILE_K + SPAN);
            kn->dots(wb, TILE_K + SPAN, ne - nb, xp + k0, K, T, k1 - k0, y + nb, ys);
            k0 = k1;
        }
    }
}

/* rows [n0, n1) of one matrix for T prepared tokens (xp: [T, K]) into y ([T, ys]), which this zeroes
 * first. run_tiles where the ISA has a dots kernel and T reaches its tiles_from. Else per block of
 * rows, per tile of tokens, per chunk of K (the tile's chunk of x fits L1; a whole row when it fits:
 * each chunk ends in a horizontal sum per row and token). */
static void run_rows(const kernel_t *kn, const mat_t *m, int64_t K, int64_t n0, int64_t n1, const float *xp,
                     int64_t T, float *y, int64_t ys) {
    for (int64_t t = 0; t < T; t++) memset(y + t * ys + n0, 0, sizeof(float) * (size_t)(n1 - n0));
    if (kn->decode != NULL && T >= kn->tiles_from) {
        run_tiles(kn, m, K, n0, n1, xp, T, y, ys);
        return;
    }
    rows_fn rows = kn->rows;
    for (int64_t nb = n0; nb < n1; nb += ROW_BLOCK) {
        int64_t ne = nb + ROW_BLOCK < n1 ? nb + ROW_BLOCK : n1;
        for (int64_t t0 = 0; t0 < T; t0 += TILE) {
            int nt = (int)(T - t0 < TILE ? T - t0 : TILE);
            int64_t chunk = L1_X_BYTES / (nt * (int64_t)sizeof(float)) / SPAN * SPAN;
            chunk = chunk >= K ? K : chunk < SPAN ? SPAN : chunk;
            for (int64_t k0 = 0; k0 < K; k0 += chunk) {
                /* the last chunk takes what is left, so MXFP4's groups after the last span go with it */
                int64_t k1 = k0 + 2 * chunk > K ? K : k0 + chunk;
                rows(m->w, m->s, m->z, m->group, K, nb, ne, k0, k1, xp + t0 * K, nt, y + t0 * ys, ys);
                if (k1 == K) break;
            }
        }
    }
}

/* The matrices of one phase: expert e's W (w[e], s[e], z[e]; s, z NULL where the format has none) is
 * [N, K]; its tokens are rows offsets[e]..offsets[e+1] of xp [P, K] and of y [P, N]. */
typedef struct {
    kernel_t kn;
    const uint8_t *const *w, *const *s, *const *z;
    int64_t group;
    int64_t n_experts, N, K;
    const int64_t *offsets;
    const float *xp;
    float *y;
} phase_t;

/* cost of one row of expert e: its bytes are read once (worth ~4 tokens' arithmetic), then one
 * unit per token */
static double row_cost(const phase_t *p, int64_t e) { return 4.0 + (double)(p->offsets[e + 1] - p->offsets[e]); }

/* the global row (e * N + n) at cost position c of the phase (cum: [n_experts + 1] prefix costs) */
static int64_t row_at(const phase_t *p, const double *cum, double c) {
    int64_t e = 0;
    while (e < p->n_experts && cum[e + 1] <= c) e++;
    if (e == p->n_experts) return e * p->N;
    int64_t n = (int64_t)((c - cum[e]) / row_cost(p, e));
    return e * p->N + (n < p->N ? n : p->N);
}

/* Thread tid's share of the phase: an equal share of the cost of all rows of all experts (a
 * contiguous range of global rows, so each thread streams its rows in order). */
static void phase_rows(const phase_t *p, const double *cum, int tid, int nth) {
    int64_t lo = row_at(p, cum, cum[p->n_experts] * tid / nth);
    int64_t hi = tid == nth - 1 ? p->n_experts * p->N : row_at(p, cum, cum[p->n_experts] * (tid + 1) / nth);
    while (lo < hi) {
        int64_t e = lo / p->N, n0 = lo % p->N, n1 = hi - e * p->N < p->N ? hi - e * p->N : p->N;
        int64_t t0 = p->offsets[e], T = p->offsets[e + 1] - t0;
        mat_t m = {p->w[e], p->s ? p->s[e] : NULL, p->z ? p->z[e] : NULL, p->group};
        if (T > 0) run_rows(&p->kn, &m, p->K, n0, n1, p->xp + t0 * p->K, T, p->y + t0 * p->N, p->N);
        lo = e * p->N + n1;
    }
}

static void prefix_costs(const phase_t *p, double *cum) {
    cum[0] = 0.0;
    for (int64_t e = 0; e < p->n_experts; e++) cum[e + 1] = cum[e] + row_cost(p, e) * (double)p->N;
}

static inline float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

/* h[i] = act(gu + b13) for i in [i0, i1): kind 0 silu (gate = first I, up = last I); kind 1
 * swiglu_oai (gate = even, up = odd, clamped by limit) */
static void activate(const float *g, const float *b13, int64_t I, int64_t i0, int64_t i1, int kind, float alpha,
                     float limit, float *h) {
    for (int64_t i = i0; i < i1; i++) {
        if (kind == 0) {
            float a = g[i] + (b13 ? b13[i] : 0.0f), b = g[I + i] + (b13 ? b13[I + i] : 0.0f);
            h[i] = a * sigmoidf(a) * b;
        } else {
            float a = g[2 * i] + (b13 ? b13[2 * i] : 0.0f), b = g[2 * i + 1] + (b13 ? b13[2 * i + 1] : 0.0f);
            a = a < limit ? a : limit;
            b = b < -limit ? -limit : (b > limit ? limit : b);
            h[i] = (b + 1.0f) * (a * sigmoidf(a * alpha));
        }
    }
}

/* Scratch memory of the calling thread, grown on demand and kept: a fresh malloc of a few hundred
 * KiB per call is an mmap, whose first touch page-faults and whose munmap shoots down the TLBs of
 * every OpenMP thread. 64-byte aligned, as are the rows of activations carved from it when K is a
 * multiple of 16: a 64-byte load of a misaligned row reads two cache lines (1.5x slower at 8 tokens). */
static void *scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        cap = buf == NULL ? 0 : bytes;
    }
    return buf;
}

static int threads_of(int threads) {
#ifdef _OPENMP
    return threads > 0 ? threads : omp_get_max_threads();
#else
    (void)threads;
    return 1;
#endif
}

/* Several experts of one layer, each on its own tokens, summed into out [T, H] (fp32, accumulated
 * in ascending pair order):
 *   out[tokens[p]] += weights[p] * (W2_e act(W13_e x[tokens[p]] + b13_e) + b2_e)
 * for p in [offsets[e], offsets[e+1]). w13[e]/w2[e] (+ s13[e]/s2[e] scales, z13[e]/z2[e] zeros; the
 * arrays NULL where the format has none; nvfp4: z = the global scales) are expert e's banks, w13 in format `fmt13`, w2 in `fmt2`,
 * `group` inputs per scale group (int formats; 0: one per row); b13/b2 entries fp32 or NULL.
 * isa_limit: 2 AVX-512, 1 AVX2, 0 portable (at most; the CPU's own set decides). Returns 0, -1 out of
 * memory or bad sizes, -2 a token out of range, -3 an unknown format. One call per layer; its caller
 * holds no Python lock meanwhile. */
int ferryman_cpu_experts(int fmt13, int fmt2, int64_t group, const float *x, int64_t T, int64_t H, int64_t I,
                         int64_t n_experts, const uint8_t *const *w13, const uint8_t *const *s13,
                         const uint8_t *const *z13, const float *const *b13, const uint8_t *const *w2,
                         const uint8_t *const *s2, const uint8_t *const *z2, const float *const *b2,
                         const int64_t *offsets, const int64_t *tokens, const float *weights, int kind,
                         float alpha, float limit, float *out, int threads, int isa_limit) {
    if (fmt13 < 0 || fmt13 >= N_FORMATS || fmt2 < 0 || fmt2 >= N_FORMATS) return -3;
    const format_t *f = &FORMATS[fmt13], *f2 = &FORMATS[fmt2];
    if (H % f->k_multiple || I % f2->k_multiple || T < 0 || n_experts < 0 || group < 0) return -1;
    if (group > 0 && (fmt13 == FMT_INT4 || fmt13 == FMT_INT8) && (H % group || I % group)) return -1; /* whole groups */
    int64_t P = offsets[n_experts];
    for (int64_t p = 0; p < P; p++)
        if (tokens[p] < 0 || tokens[p] >= T) return -2;
    if (P == 0) return 0;
    size_t floats = (size_t)P * (size_t)(H + 2 * I + I + I + H);
    char *mem = scratch(sizeof(float) * floats + sizeof(int64_t) * (size_t)P + sizeof(double) * 2 * (size_t)(n_experts + 1));
    if (mem == NULL) return -1;
    float *xp = (float *)mem, *gu = xp + P * H, *h = gu + P * 2 * I, *hp = h + P * I, *y = hp + P * I;
    int64_t *expert_of = (int64_t *)(y + P * H);
    double *cum13 = (double *)(expert_of + P), *cum2 = cum13 + n_experts + 1;
    for (int64_t e = 0; e < n_experts; e++)
        for (int64_t p = offsets[e]; p < offsets[e + 1]; p++) expert_of[p] = e;
    int isa = pick_isa(isa_limit);
    const prep_fn prep13 = prep_of(f, isa), prep2 = prep_of(f2, isa);
    /* nvfp4: z holds global scales, one per `group` rows: gate's and up's for w13, one for w2 */
    const int nv13 = fmt13 == FMT_NVFP4 || fmt13 == FMT_NVFP4CT, nv2 = fmt2 == FMT_NVFP4 || fmt2 == FMT_NVFP4CT;
    phase_t up = {kernel_of(f, isa), w13, s13, z13, nv13 ? I : group, n_experts, 2 * I, H, offsets, xp, gu};
    phase_t down = {kernel_of(f2, isa), w2, s2, z2, nv2 ? H : group, n_experts, H, I, offsets, hp, y};
    prefix_costs(&up, cum13);
    prefix_costs(&down, cum2);
    const int64_t chunks = (I + SPAN - 1) / SPAN; /* activation items per pair: SPAN-aligned, as prep wants */
    int nth = threads_of(threads);
    (void)nth;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth)
#endif
    {
#ifdef _OPENMP
        int tid = omp_get_thread_num(), n = omp_get_num_threads();
#else
        int tid = 0, n = 1;
#endif
        for (int64_t p = tid; p < P; p += n) prep13(x + tokens[p] * H, xp + p * H, H);
#ifdef _OPENMP
#pragma omp barrier
#endif
        phase_rows(&up, cum13, tid, n);
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int64_t item = tid; item < P * chunks; item += n) {
            int64_t p = item / chunks, i0 = (item % chunks) * SPAN, i1 = i0 + SPAN < I ? i0 + SPAN : I;
            activate(gu + p * 2 * I, b13[expert_of[p]], I, i0, i1, kind, alpha, limit, h + p * I);
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int64_t p = tid; p < P; p += n) prep2(h + p * I, hp + p * I, I);
#ifdef _OPENMP
#pragma omp barrier
#endif
        phase_rows(&down, cum2, tid, n);
#ifdef _OPENMP
#pragma omp barrier
#endif
        int64_t c0 = H * tid / n, c1 = H * (tid + 1) / n; /* this thread's output columns */
        for (int64_t p = 0; p < P; p++) {
            const float *yp = y + p * H, *bias = b2[expert_of[p]];
            float *o = out + tokens[p] * H, wp = weights[p];
            for (int64_t c = c0; c < c1; c++) o[c] += wp * (yp[c] + (bias ? bias[c] : 0.0f));
        }
    }
    return 0;
}

/* y [T, N] = x [T, K] @ W^T for one matrix W of format fmt (w, s, z, group as in ferryman_cpu_experts).
 * Returns 0, -1 bad sizes or out of memory, -3 an unknown format. */
int ferryman_cpu_matmul(int fmt, int64_t group, const float *x, int64_t T, int64_t K, const uint8_t *w,
                        const uint8_t *s, const uint8_t *z, int64_t N, float *y, int threads, int isa_limit) {
    if (fmt < 0 || fmt >= N_FORMATS) return -3;
    const format_t *f = &FORMATS[fmt];
    if (K % f->k_multiple || T < 0 || N < 0 || group < 0) return -1;
    if (group > 0 && (fmt == FMT_INT4 || fmt == FMT_INT8) && K % group) return -1; /* whole groups */
    if (T == 0) return 0;
    float *xp = scratch(sizeof(float) * (size_t)(T * K));
    if (xp == NULL) return -1;
    const int isa = pick_isa(isa_limit);
    const prep_fn prep = prep_of(f, isa);
    for (int64_t t = 0; t < T; t++) prep(x + t * K, xp + t * K, K);
    int64_t offsets[2] = {0, T};
    const uint8_t *ws[1] = {w}, *ss[1] = {s}, *zs[1] = {z};
    phase_t ph = {kernel_of(f, isa), ws, ss, zs, group, 1, N, K, offsets, xp, y};
    double cum[2];
    prefix_costs(&ph, cum);
    int nth = threads_of(threads);
    (void)nth;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth)
    phase_rows(&ph, cum, omp_get_thread_num(), omp_get_num_threads());
#else
    phase_rows(&ph, cum, 0, 1);
#endif
    return 0;
}

/* bytes of one row of W in format fmt (-1: unknown format) */
int64_t ferryman_cpu_row_bytes(int fmt, int64_t K) { return fmt < 0 || fmt >= N_FORMATS ? -1 : FORMATS[fmt].row_bytes(K); }
