/* The compiled loops behind mergelab.merge.accelerator.kernels: a C extension, built when the package is
 * installed (setup.py). Read kernels.py's docstring first; every function here mirrors a torch
 * operation sequence named in its comment, operation for operation, so the results are the
 * torch path's bits (tests/test_merge_kernels.py compares them).
 *
 * Why C and these flags: the loops must round exactly as torch does, so the compiler may not
 * contract a*b+c into a fused multiply-add on its own (-ffp-contract=off: torch's fused ones are
 * written as fmaf here) nor reorder sums (no -ffast-math). -fno-math-errno lets fmaf be the CPU
 * instruction, -fno-trapping-math lets the vectoriser evaluate both sides of a select (no result
 * changes: nothing here reads the floating-point exception flags). The hot loops are compiled
 * for three x86-64 levels (AVX-512, AVX2, baseline) and the CPU picks one when the module loads
 * (GCC's target_clones); elsewhere they are compiled once for the target. Two kinds of loop are
 * also written by hand in AVX2 intrinsics, chosen when the module loads where the CPU has them
 * and switchable for the tests: the threshold search's band passes (band_masks) and the
 * two-expert bfloat16 sums and plain elections (two_avx2, vector_loops; GCC's own vectors of
 * these work at bfloat16's sixteen lanes and spill registers to the stack).
 *
 * Layouts (set by kernels.py, checked where cheap):
 *   inputs: addresses (int64) of flat bfloat16 (uint16 bits) or float32 arrays;
 *   params: float32 [n_experts, N_PARAMS]; scalars: float32 [3]; flags: int64 [N_FLAGS].
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define HAVE_MAPPING 1
#endif

/* Bump when the meaning of an argument or constant changes: kernels.py refuses a stale build. */
#define LOOPS_VERSION 12

#define TILE 512       /* positions per tile of the merge loops (their task vectors stay in L1) */
#define GROUPED 1024   /* entries per tile of a histogram pass */
#define HIGH_BUCKETS (1 << 15) /* ops._HIGH_BUCKETS */
#define LOW_BUCKETS (1 << 16)  /* ops._LOW_BUCKETS */
#define DARE_LANES 8   /* SFC64 streams advanced together */
#define RUN_HASH 2654435761LL

enum { P_LOW, P_HIGH, P_DARE_LIMIT, P_DARE_DIVISOR, P_SUM_W, P_VOTE_W, P_FLIP, P_MERGE_W,
       P_DIVISOR_W, N_PARAMS };
enum { F_KIND, F_BAND, F_VOTE_COUNT, F_VOTE_PLAIN, F_ANY_FLIP, F_MERGE_PLAIN, F_DIVIDE_BY,
       F_DIVISOR_PLAIN, F_ALL_POSITIVE, F_SUM_DIVIDE, F_SCALE, N_FLAGS };
enum { S_LAMBDA, S_TOTAL, S_MIN_W, N_SCALARS };
enum { KIND_SUM, KIND_ELECT };
enum { DIVIDE_NONE, DIVIDE_COUNT, DIVIDE_WEIGHT_SUM };
#define FOUND_IN_INPUT 1
#define FOUND_IN_RESULT 2
#define F32_INF_BITS 0x7F800000u

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HOT
#endif
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#define RESTRICT __restrict__
#else
#define INLINE static inline
#define RESTRICT
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_LOOPS 1 /* the hand-vectorised loops below are built */
#endif

/* The hand-vectorised AVX2 loops, where they exist (GCC on x86-64): whether two_loop_for picks
 * two_avx2's loops (the CPU has AVX2 and FMA) and whether the band passes run band_masks_avx2
 * (AVX2). Set when the module loads; vector_loops(on) and band_masks(on) turn them off and back
 * on, for the tests of both ways. */
static int vector_loops = 0, band_masks = 0;

/* ---- scalar pieces, each torch's operation ---------------------------------------------- */

INLINE float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float bf16_to_f32(uint32_t h) { return u2f(h << 16); }

/* Round to nearest even, as torch; NaN becomes 0xFFFF (what torch's vectorised cast gives). */
INLINE uint16_t f32_to_bf16(float v)
{
    uint32_t u = f2u(v);
    uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
    uint32_t nan = 0u - (uint32_t)((u & 0x7FFFFFFFu) > F32_INF_BITS);
    return (uint16_t)((rounded >> 16) | nan);
}

/* torch.hardshrink: +0.0 where -lam <= x <= lam, else x (lam < 0 keeps everything). Written
 * as |x| <= lam, the same test for every x and lam (NaN fails both; -0.0 becomes +0.0). */
INLINE float hardshrink(float x, float lam) { return fabsf(x) <= lam ? 0.0f : x; }

/* torch.sign: +-1, and +0.0 for +-0 (and NaN). */
INLINE float sign_of(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

/* relu keeping -0.0 (torch's x.clamp(min=0) of a -0.0 is -0.0). */
INLINE float relu(float x) { return x < 0.0f ? 0.0f : x; }

/* DARE's float mask entry from 32 random bits (ops.dare_keep_block, operation for operation):
 * 1 + u*2^-23 from the low 23 bits, then clamp((x - limit) * (-2^24), 0, 1). */
INLINE float keep_value(uint32_t half, float limit)
{
    float x = u2f((half & 0x7FFFFFu) | 0x3F800000u);
    float k = (x - limit) * -16777216.0f;
    k = k < 0.0f ? 0.0f : k;
    return k > 1.0f ? 1.0f : k;
}

INLINE uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

/* The largest of three bfloat16 magnitudes' bits, in 16-bit lanes (the NaN/Inf test of the
 * two-expert loops: a vector of them holds twice the lanes of 32-bit ones). */
INLINE uint16_t max3_magnitude16(uint16_t a, uint16_t b, uint16_t c)
{
    uint16_t x = (uint16_t)(a & 0x7FFFu), y = (uint16_t)(b & 0x7FFFu), z = (uint16_t)(c & 0x7FFFu);
    uint16_t m = x > y ? x : y;
    return m > z ? m : z;
}

INLINE uint16_t umax16(uint16_t a, uint16_t b) { return a > b ? a : b; }

/* ---- tiles in either stored dtype ------------------------------------------------------ */

/* Entries [start, start + count) of the array at addr (bfloat16 bits or float32), widened to
 * float32 into dst; returns whether one of them is NaN or Inf (every exponent bit set). */
INLINE int load_tile(int64_t addr, int bf16, int64_t start, int64_t count, float *RESTRICT dst)
{
    uint32_t most = 0;
    if (bf16) {
        const uint16_t *src = (const uint16_t *)(intptr_t)addr + start;
        for (int64_t j = 0; j < count; j++) {
            uint32_t h = src[j];
            most = umax(most, h & 0x7FFFu);
            dst[j] = bf16_to_f32(h);
        }
        return most >= 0x7F80u;
    }
    const uint32_t *src = (const uint32_t *)(intptr_t)addr + start;
    for (int64_t j = 0; j < count; j++) {
        uint32_t u = src[j];
        most = umax(most, u & 0x7FFFFFFFu);
        dst[j] = u2f(u);
    }
    return most >= F32_INF_BITS;
}

/* src[:count] into entries [start, start + count) at addr, rounded to bfloat16 or stored as
 * float32; returns whether a stored entry is NaN or Inf (after rounding: a float32 beyond
 * bfloat16's range rounds to Inf). */
INLINE int emit_tile(int64_t addr, int bf16, int64_t start, int64_t count,
                         const float *RESTRICT src)
{
    uint32_t most = 0;
    if (bf16) {
        uint16_t *dst = (uint16_t *)(intptr_t)addr + start;
        for (int64_t j = 0; j < count; j++) {
            uint16_t h = f32_to_bf16(src[j]);
            most = umax(most, (uint32_t)h & 0x7FFFu);
            dst[j] = h;
        }
        return most >= 0x7F80u;
    }
    float *dst = (float *)(intptr_t)addr + start;
    for (int64_t j = 0; j < count; j++) {
        most = umax(most, f2u(src[j]) & 0x7FFFFFFFu);
        dst[j] = src[j];
    }
    return most >= F32_INF_BITS;
}

/* One step of ops._weighted_rows_sum over a tile: acc = x (* w) for the first row, then
 * acc + x, or fma(x, w, acc) (torch's add_(x, alpha=w)). */
INLINE void add_row(float *RESTRICT acc, const float *RESTRICT x, int64_t n, int first, int plain,
                    float w)
{
    if (first) {
        if (plain)
            for (int64_t j = 0; j < n; j++) acc[j] = x[j];
        else
            for (int64_t j = 0; j < n; j++) acc[j] = x[j] * w;
    } else if (plain) {
        for (int64_t j = 0; j < n; j++) acc[j] = acc[j] + x[j];
    } else {
        for (int64_t j = 0; j < n; j++) acc[j] = fmaf(x[j], w, acc[j]);
    }
}

/* ---- SFC64, NumPy's algorithm, DARE_LANES streams at once ------------------------------- */

#if defined(__GNUC__)
typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef int64_t i64x8 __attribute__((vector_size(64)));
#define SHUFFLE(x, y, ...) __builtin_shuffle(x, y, (i64x8){__VA_ARGS__})

/* o[s][l] (step s, lane l) into o[l][s]: three rounds of shuffles. */
INLINE void transpose8(u64x8 *o)
{
    u64x8 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = SHUFFLE(o[i], o[i + 1], 0, 8, 2, 10, 4, 12, 6, 14);
        t[i + 1] = SHUFFLE(o[i], o[i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = SHUFFLE(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 2] = SHUFFLE(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 1] = SHUFFLE(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = SHUFFLE(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int i = 0; i < 4; i++) {
        o[i] = SHUFFLE(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        o[i + 4] = SHUFFLE(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* steps outputs of each of the DARE_LANES streams whose state is state[4][DARE_LANES] (rows
 * a, b, c, counter; advanced): lane l's p-th output goes to out[l * stride + p]. The lanes are
 * the elements of one vector; eight steps at a time are turned into eight per-lane runs. */
HOT static void sfc64_lanes(uint64_t *RESTRICT state, uint64_t *RESTRICT out, int64_t steps,
                            int64_t stride)
{
    u64x8 a, b, c, k, o[8];
    memcpy(&a, state, 64);
    memcpy(&b, state + DARE_LANES, 64);
    memcpy(&c, state + 2 * DARE_LANES, 64);
    memcpy(&k, state + 3 * DARE_LANES, 64);
    int64_t p = 0;
    for (; p + 8 <= steps; p += 8) {
        for (int step = 0; step < 8; step++) {
            o[step] = a + b + k;
            k += 1;
            a = b ^ (b >> 11);
            b = c + (c << 3);
            c = ((c << 24) | (c >> 40)) + o[step];
        }
        transpose8(o);
        for (int l = 0; l < DARE_LANES; l++) memcpy(out + l * stride + p, &o[l], 64);
    }
    for (; p < steps; p++) {
        u64x8 output = a + b + k;
        k += 1;
        a = b ^ (b >> 11);
        b = c + (c << 3);
        c = ((c << 24) | (c >> 40)) + output;
        for (int l = 0; l < DARE_LANES; l++) out[l * stride + p] = output[l];
    }
    memcpy(state, &a, 64);
    memcpy(state + DARE_LANES, &b, 64);
    memcpy(state + 2 * DARE_LANES, &c, 64);
    memcpy(state + 3 * DARE_LANES, &k, 64);
}
#else
/* steps outputs of each of the DARE_LANES streams whose state is state[4][DARE_LANES] (rows
 * a, b, c, counter; advanced): lane l's p-th output goes to out[l * stride + p]. */
static void sfc64_lanes(uint64_t *RESTRICT state, uint64_t *RESTRICT out, int64_t steps,
                        int64_t stride)
{
    for (int l = 0; l < DARE_LANES; l++) {
        uint64_t a = state[l], b = state[DARE_LANES + l], c = state[2 * DARE_LANES + l];
        uint64_t k = state[3 * DARE_LANES + l];
        for (int64_t p = 0; p < steps; p++) {
            uint64_t output = a + b + k;
            k += 1;
            a = b ^ (b >> 11);
            b = c + (c << 3);
            c = ((c << 24) | (c >> 40)) + output;
            out[l * stride + p] = output;
        }
        state[l] = a, state[DARE_LANES + l] = b, state[2 * DARE_LANES + l] = c;
        state[3 * DARE_LANES + l] = k;
    }
}
#endif

/* ---- the merge loops -------------------------------------------------------------------- */

typedef struct {
    const int64_t *addresses; /* base, then the experts */
    int n;                    /* experts */
    int bf16_in, bf16_out;
    int64_t out;
    const float *params;      /* [n, N_PARAMS] */
    const float *scalars;
    const int64_t *flags;
} Merge;

/* methods._sum_rows_into for a tile: theta_b + lam * sum_i w_i tau_i (/ sum w), into work[1]. */
INLINE float *sum_rows(const Merge *g, float *tau, float *work, int64_t n)
{
    const float *b = work;
    float *acc = work + TILE;
    const int divide = g->flags[F_SUM_DIVIDE] != 0, scale = g->flags[F_SCALE] != 0;
    const float total = g->scalars[S_TOTAL], lam = g->scalars[S_LAMBDA];
    if (g->n == 2) { /* one loop for the common case, the same operations in order */
        const float *t0 = tau, *t1 = tau + TILE;
        const float w0 = g->params[P_SUM_W], w1 = g->params[N_PARAMS + P_SUM_W];
        for (int64_t j = 0; j < n; j++) {
            float v = fmaf(t1[j], w1, t0[j] * w0);
            if (divide) v = v / total;
            if (scale) v = v * lam;
            acc[j] = v + b[j];
        }
        return acc;
    }
    for (int i = 0; i < g->n; i++) /* weighted_sum multiplies the first row too */
        add_row(acc, tau + i * TILE, n, i == 0, 0, g->params[i * N_PARAMS + P_SUM_W]);
    if (divide)
        for (int64_t j = 0; j < n; j++) acc[j] = acc[j] / total;
    if (scale)
        for (int64_t j = 0; j < n; j++) acc[j] = acc[j] * lam;
    for (int64_t j = 0; j < n; j++) acc[j] = acc[j] + b[j];
    return acc;
}

/* The two experts' weights in column col, or 1 and 1 where plain. */
INLINE void two_weights(const Merge *g, int col, int plain, float *w0, float *w1)
{
    *w0 = plain ? 1.0f : g->params[col];
    *w1 = plain ? 1.0f : g->params[N_PARAMS + col];
}

/* elect_merge for two experts, every step of a position in one loop: a "plain" weight is 1,
 * and x * 1, fma(y, 1, x) = x + y and a division by 1 change no bits, so the loop always
 * multiplies and divides, and picks each option's value with a select. */
INLINE float *elect_merge_two(const Merge *g, float *tau, float *work, int64_t n)
{
    const float *b = work, *t0 = tau, *t1 = tau + TILE;
    float *merged = work + 2 * TILE;
    const int64_t *f = g->flags;
    const int count_votes = f[F_VOTE_COUNT] != 0, all_positive = f[F_ALL_POSITIVE] != 0;
    const int by_count = f[F_DIVIDE_BY] == DIVIDE_COUNT, by_weight = f[F_DIVIDE_BY] == DIVIDE_WEIGHT_SUM;
    float vw0, vw1, mw0, mw1, dw0, dw1;
    two_weights(g, P_VOTE_W, f[F_VOTE_PLAIN] != 0, &vw0, &vw1);
    two_weights(g, P_MERGE_W, f[F_MERGE_PLAIN] != 0, &mw0, &mw1);
    two_weights(g, P_DIVISOR_W, f[F_DIVISOR_PLAIN] != 0, &dw0, &dw1);
    const float f0 = g->params[P_FLIP], f1 = g->params[N_PARAMS + P_FLIP];
    const float lam = g->scalars[S_LAMBDA], min_w = g->scalars[S_MIN_W];
    for (int64_t j = 0; j < n; j++) {
        float x0 = t0[j], x1 = t1[j];
        float r0 = count_votes ? sign_of(x0) : x0, r1 = count_votes ? sign_of(x1) : x1;
        float votes = fmaf(r1, vw1, r0 * vw0);
        float elected = votes < 0.0f ? -1.0f : 1.0f;
        float m0 = relu(x0 * elected * f0), m1 = relu(x1 * elected * f1);
        float total = fmaf(m1, mw1, m0 * mw0) * elected;
        float a0 = m0 > 0.0f ? 1.0f : 0.0f, a1 = m1 > 0.0f ? 1.0f : 0.0f;
        float count = a0 + a1;
        float weights = fmaf(a1, dw1, a0 * dw0);
        if (all_positive)
            weights = weights < min_w ? min_w : weights;
        else
            weights = weights == 0.0f ? 1.0f : weights;
        float divisor = by_count ? (count < 1.0f ? 1.0f : count) : 1.0f;
        divisor = by_weight ? weights : divisor;
        merged[j] = fmaf(total / divisor, lam, b[j]);
    }
    return merged;
}

/* theta_b + lam * disjoint_merge(elect_sign(tau)) for a tile, into work[2]: ops.elect_sign and
 * ops.disjoint_merge_, operation for operation. */
INLINE float *elect_merge(const Merge *g, float *tau, float *work, int64_t n)
{
    const float *b = work;
    float *votes = work + TILE, *merged = work + 2 * TILE, *agreeing = work + 3 * TILE;
    float *divisor = work + 4 * TILE, *x = work + 5 * TILE, *agrees = work + 6 * TILE;
    float *elected = votes; /* the votes are only needed for their sign */
    const int64_t *f = g->flags;
    const int count_votes = f[F_VOTE_COUNT] != 0, plain_votes = f[F_VOTE_PLAIN] != 0;
    const int any_flip = f[F_ANY_FLIP] != 0, plain_merge = f[F_MERGE_PLAIN] != 0;
    const int64_t divide_by = f[F_DIVIDE_BY];
    const int plain_divisor = f[F_DIVISOR_PLAIN] != 0;
    for (int i = 0; i < g->n; i++) {
        const float *row = tau + i * TILE;
        if (count_votes) {
            for (int64_t j = 0; j < n; j++) x[j] = sign_of(row[j]);
            add_row(votes, x, n, i == 0, plain_votes, g->params[i * N_PARAMS + P_VOTE_W]);
        } else {
            add_row(votes, row, n, i == 0, plain_votes, g->params[i * N_PARAMS + P_VOTE_W]);
        }
    }
    for (int64_t j = 0; j < n; j++) /* sign(votes) + 0.5, signed again: -1, or +1 for ties */
        elected[j] = votes[j] < 0.0f ? -1.0f : 1.0f;
    for (int i = 0; i < g->n; i++) {
        const float *row = tau + i * TILE;
        const float flip = g->params[i * N_PARAMS + P_FLIP];
        for (int64_t j = 0; j < n; j++) {
            float mag = row[j] * elected[j];
            if (any_flip) mag = mag * flip;
            x[j] = relu(mag);
        }
        add_row(merged, x, n, i == 0, plain_merge, g->params[i * N_PARAMS + P_MERGE_W]);
        if (divide_by != DIVIDE_NONE) {
            for (int64_t j = 0; j < n; j++) agrees[j] = x[j] > 0.0f ? 1.0f : 0.0f;
            if (divide_by == DIVIDE_COUNT)
                add_row(agreeing, agrees, n, i == 0, 1, 1.0f);
            else
                add_row(divisor, agrees, n, i == 0, plain_divisor,
                        g->params[i * N_PARAMS + P_DIVISOR_W]);
        }
    }
    for (int64_t j = 0; j < n; j++) merged[j] = merged[j] * elected[j];
    if (divide_by == DIVIDE_COUNT) {
        for (int64_t j = 0; j < n; j++)
            merged[j] = merged[j] / (agreeing[j] < 1.0f ? 1.0f : agreeing[j]);
    } else if (divide_by == DIVIDE_WEIGHT_SUM) {
        if (f[F_ALL_POSITIVE] != 0) {
            const float min_w = g->scalars[S_MIN_W];
            for (int64_t j = 0; j < n; j++)
                merged[j] = merged[j] / (divisor[j] < min_w ? min_w : divisor[j]);
        } else {
            for (int64_t j = 0; j < n; j++)
                merged[j] = merged[j] / (divisor[j] == 0.0f ? 1.0f : divisor[j]);
        }
    }
    const float lam = g->scalars[S_LAMBDA];
    for (int64_t j = 0; j < n; j++) merged[j] = fmaf(merged[j], lam, b[j]);
    return merged;
}

/* The tile of n positions from t0, any number of experts and either dtype: widen, form tau,
 * trim or band, DARE's drop and rescale (bits[i]: expert i's random bits, NULL: no drop), then
 * the sum or the election, rounded into the output. Adds the NaN/Inf flags to *found. */
HOT static void merge_tile(const Merge *g, int64_t t0, int64_t n, const uint32_t *const *bits,
                           float *tau, float *work, int *found)
{
    float *b = work, *x = work + 7 * TILE;
    const int band = g->flags[F_BAND] != 0;
    int bad = load_tile(g->addresses[0], g->bf16_in, t0, n, b);
    for (int i = 0; i < g->n; i++) {
        const float *p = g->params + i * N_PARAMS;
        bad |= load_tile(g->addresses[1 + i], g->bf16_in, t0, n, x);
        const float low = p[P_LOW], high = p[P_HIGH];
        float *row = tau + i * TILE;
        if (band) { /* breadcrumbs: trim below, then tau - hardshrink(tau, largest) */
            for (int64_t j = 0; j < n; j++) {
                float d = x[j] - b[j];
                row[j] = hardshrink(d, low) - hardshrink(d, high);
            }
        } else {
            for (int64_t j = 0; j < n; j++) row[j] = hardshrink(x[j] - b[j], low);
        }
        const float limit = p[P_DARE_LIMIT];
        if (limit != 0.0f) {
            const uint32_t *r = bits[i];
            for (int64_t j = 0; j < n; j++) row[j] = row[j] * keep_value(r[j], limit);
            const float divisor = p[P_DARE_DIVISOR];
            if (divisor != 0.0f)
                for (int64_t j = 0; j < n; j++) row[j] = row[j] / divisor;
        }
    }
    float *result;
    if (g->flags[F_KIND] == KIND_SUM)
        result = sum_rows(g, tau, work, n);
    else if (g->n == 2)
        result = elect_merge_two(g, tau, work, n);
    else
        result = elect_merge(g, tau, work, n);
    *found |= (bad ? FOUND_IN_INPUT : 0) |
              (emit_tile(g->out, g->bf16_out, t0, n, result) ? FOUND_IN_RESULT : 0);
}

/* ---- two bfloat16 experts, every step in one loop per option set ------------------------ */

typedef struct {
    float low0, low1, high0, high1;   /* trim / band */
    float limit0, limit1, div0, div1; /* DARE: drop limit, rescale divisor (1: none) */
    int drop0, drop1;
    float sw0, sw1, total, lam_sum;   /* the sum: weights, sum w, lam (1 without scaling) */
    float vw0, vw1, mw0, mw1, dw0, dw1, f0, f1, lam, min_w; /* the election (1 where plain) */
} Two;

/* What merge_tile computes for two bfloat16 experts into a bfloat16 output, with the options
 * as compile-time constants (each wrapper below is one set): the same operations in the same
 * order, minus multiplications and divisions by exactly 1. r0, r1: DARE's random bits. */
INLINE int two_loop(const uint16_t *RESTRICT b, const uint16_t *RESTRICT e0,
                    const uint16_t *RESTRICT e1, uint16_t *RESTRICT out, int64_t n,
                    const uint32_t *RESTRICT r0, const uint32_t *RESTRICT r1, const Two *c,
                    const int kind, const int band, const int dare, const int sum_divide,
                    const int count_votes, const int divide_by, const int all_positive,
                    const int flips, const int plain)
{
    const float low0 = c->low0, low1 = c->low1, high0 = c->high0, high1 = c->high1;
    const float limit0 = c->limit0, limit1 = c->limit1, div0 = c->div0, div1 = c->div1;
    const int drop0 = c->drop0, drop1 = c->drop1;
    const float sw0 = c->sw0, sw1 = c->sw1, total = c->total, lam_sum = c->lam_sum;
    const float vw0 = c->vw0, vw1 = c->vw1, mw0 = c->mw0, mw1 = c->mw1;
    const float dw0 = c->dw0, dw1 = c->dw1, f0 = c->f0, f1 = c->f1, lam = c->lam;
    const float min_w = c->min_w;
    uint16_t most_in = 0, most_out = 0;
    for (int64_t j = 0; j < n; j++) {
        uint16_t hb = b[j], h0 = e0[j], h1 = e1[j];
        most_in = umax16(most_in, max3_magnitude16(hb, h0, h1));
        float base = bf16_to_f32(hb);
        float d0 = bf16_to_f32(h0) - base, d1 = bf16_to_f32(h1) - base;
        float x0 = band ? hardshrink(d0, low0) - hardshrink(d0, high0) : hardshrink(d0, low0);
        float x1 = band ? hardshrink(d1, low1) - hardshrink(d1, high1) : hardshrink(d1, low1);
        if (dare) {
            float k0 = (x0 * keep_value(r0[j], limit0)) / div0;
            float k1 = (x1 * keep_value(r1[j], limit1)) / div1;
            x0 = drop0 ? k0 : x0;
            x1 = drop1 ? k1 : x1;
        }
        float result;
        if (kind == KIND_SUM) {
            float v = fmaf(x1, sw1, x0 * sw0);
            if (sum_divide) v = v / total;
            result = v * lam_sum + base;
        } else {
            /* x * elected, elected = +-1, is x with its sign bit flipped where elected is -1:
             * the same bits for every x but NaN, whose sign no result keeps (a NaN is stored
             * as 0xFFFF). Plain weights (all 1): x * 1 = x and fma(y, 1, x) = x + y. */
            int negative;
            if (count_votes && plain) { /* sign(x0) + sign(x1) < 0, counted in integers */
                int32_t v = ((x0 > 0.0f) - (x0 < 0.0f)) + ((x1 > 0.0f) - (x1 < 0.0f));
                negative = v < 0;
            } else {
                float q0 = count_votes ? sign_of(x0) : x0, q1 = count_votes ? sign_of(x1) : x1;
                negative = (plain ? q0 + q1 : fmaf(q1, vw1, q0 * vw0)) < 0.0f;
            }
            const uint32_t flip = negative ? 0x80000000u : 0u;
            float m0 = u2f(f2u(x0) ^ flip), m1 = u2f(f2u(x1) ^ flip);
            if (flips) {
                m0 = m0 * f0;
                m1 = m1 * f1;
            }
            m0 = relu(m0);
            m1 = relu(m1);
            float sum = u2f(f2u(plain ? m0 + m1 : fmaf(m1, mw1, m0 * mw0)) ^ flip);
            float q = sum;
            if (divide_by == DIVIDE_COUNT) {
                /* sum / max(a0 + a1, 1) with a0 + a1 in {0, 1, 2}: sum / 1 = sum, and sum / 2
                 * is sum * 0.5 (the same real number, rounded once either way) */
                q = (m0 > 0.0f) & (m1 > 0.0f) ? sum * 0.5f : sum;
            } else if (divide_by == DIVIDE_WEIGHT_SUM) {
                float a0 = m0 > 0.0f ? 1.0f : 0.0f, a1 = m1 > 0.0f ? 1.0f : 0.0f;
                float w = fmaf(a1, dw1, a0 * dw0);
                if (all_positive)
                    w = w < min_w ? min_w : w;
                else
                    w = w == 0.0f ? 1.0f : w;
                q = sum / w;
            }
            result = fmaf(q, lam, base);
        }
        uint16_t h = f32_to_bf16(result);
        most_out = umax16(most_out, (uint16_t)(h & 0x7FFFu));
        out[j] = h;
    }
    return (most_in >= 0x7F80u ? FOUND_IN_INPUT : 0) | (most_out >= 0x7F80u ? FOUND_IN_RESULT : 0);
}

typedef int (*TwoLoop)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t,
                       const uint32_t *, const uint32_t *, const Two *);

#define TWO(name, kind, band, dare, sum_divide, count_votes, divide_by, all_positive, flips,     \
            plain)                                                                              \
    HOT static int name(const uint16_t *b, const uint16_t *e0, const uint16_t *e1,             \
                        uint16_t *out, int64_t n, const uint32_t *r0, const uint32_t *r1,       \
                        const Two *c)                                                           \
    {                                                                                           \
        return two_loop(b, e0, e1, out, n, r0, r1, c, kind, band, dare, sum_divide,             \
                        count_votes, divide_by, all_positive, flips, plain);                    \
    }
/* the sums: linear parts of DARE-linear and breadcrumbs (trim or band, drop or not, / sum w) */
TWO(sum_trim, KIND_SUM, 0, 0, 0, 0, 0, 0, 0, 0)
TWO(sum_trim_div, KIND_SUM, 0, 0, 1, 0, 0, 0, 0, 0)
TWO(sum_band, KIND_SUM, 1, 0, 0, 0, 0, 0, 0, 0)
TWO(sum_band_div, KIND_SUM, 1, 0, 1, 0, 0, 0, 0, 0)
TWO(sum_dare, KIND_SUM, 0, 1, 0, 0, 0, 0, 0, 0)
TWO(sum_dare_div, KIND_SUM, 0, 1, 1, 0, 0, 0, 0, 0)
/* the elections (TIES, DARE-TIES): sign rule x divisor, without sign flips; with plain weights
 * (all 1; the divisor by Sum w is then the count's, see two_loop_for) */
#define ELECT(suffix, dare)                                                                     \
    TWO(elect_sum_none##suffix, KIND_ELECT, 0, dare, 0, 0, DIVIDE_NONE, 0, 0, 0)                \
    TWO(elect_sum_count##suffix, KIND_ELECT, 0, dare, 0, 0, DIVIDE_COUNT, 0, 0, 0)              \
    TWO(elect_sum_weight##suffix, KIND_ELECT, 0, dare, 0, 0, DIVIDE_WEIGHT_SUM, 1, 0, 0)        \
    TWO(elect_sum_weight_any##suffix, KIND_ELECT, 0, dare, 0, 0, DIVIDE_WEIGHT_SUM, 0, 0, 0)    \
    TWO(elect_votes_none##suffix, KIND_ELECT, 0, dare, 0, 1, DIVIDE_NONE, 0, 0, 0)              \
    TWO(elect_votes_count##suffix, KIND_ELECT, 0, dare, 0, 1, DIVIDE_COUNT, 0, 0, 0)            \
    TWO(elect_votes_weight##suffix, KIND_ELECT, 0, dare, 0, 1, DIVIDE_WEIGHT_SUM, 1, 0, 0)      \
    TWO(elect_votes_weight_any##suffix, KIND_ELECT, 0, dare, 0, 1, DIVIDE_WEIGHT_SUM, 0, 0, 0)  \
    TWO(elect_sum_none_plain##suffix, KIND_ELECT, 0, dare, 0, 0, DIVIDE_NONE, 0, 0, 1)          \
    TWO(elect_sum_count_plain##suffix, KIND_ELECT, 0, dare, 0, 0, DIVIDE_COUNT, 0, 0, 1)        \
    TWO(elect_votes_none_plain##suffix, KIND_ELECT, 0, dare, 0, 1, DIVIDE_NONE, 0, 0, 1)        \
    TWO(elect_votes_count_plain##suffix, KIND_ELECT, 0, dare, 0, 1, DIVIDE_COUNT, 0, 0, 1)
ELECT(, 0)
ELECT(_dare, 1)

#ifdef HAVE_AVX2_LOOPS

/* A bfloat16 tile's eight float32 values (bits << 16) from eight 16-bit lanes. */
__attribute__((target("avx2"))) static inline __m256 widen8(__m128i h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* hardshrink(d, low): +0.0 where |d| <= low (ordered: NaN is kept), else d. */
__attribute__((target("avx2"))) static inline __m256 hardshrink8(__m256 d, __m256 low)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_andnot_ps(_mm256_cmp_ps(_mm256_and_ps(d, magnitude), low, _CMP_LE_OQ), d);
}

/* DARE's x * keep_value(r, limit) / divisor, where the expert drops (drop: all ones), else x. */
__attribute__((target("avx2"))) static inline __m256
drop8(__m256 x, const uint32_t *r, __m256 limit, __m256 divisor, __m256 drop)
{
    __m256i u = _mm256_loadu_si256((const __m256i *)r);
    u = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFF)),
                        _mm256_set1_epi32(0x3F800000));
    __m256 k = _mm256_mul_ps(_mm256_sub_ps(_mm256_castsi256_ps(u), limit),
                             _mm256_set1_ps(-16777216.0f));
    k = _mm256_max_ps(_mm256_setzero_ps(), k); /* k < 0 ? 0 : k (keeps -0.0, as relu) */
    k = _mm256_min_ps(_mm256_set1_ps(1.0f), k); /* k > 1 ? 1 : k */
    return _mm256_blendv_ps(x, _mm256_div_ps(_mm256_mul_ps(x, k), divisor), drop);
}

/* f32_to_bf16 of eight values, each in the low half of a 32-bit lane. */
__attribute__((target("avx2"))) static inline __m256i round8(__m256 v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                     _mm256_set1_epi32((int)F32_INF_BITS));
    return _mm256_or_si256(_mm256_srli_epi32(rounded, 16), _mm256_srli_epi32(nan, 16));
}

/* two_loop's election with plain weights (all 1) for eight positions: the same operations,
 * in vectors. x * 1 and the weights' multiplications are left out, as two_loop leaves them;
 * relu(m) is max(0, m) with 0 first (a -0.0 or a NaN m is returned as it is, as relu does). */
__attribute__((target("avx2,fma"))) static inline __m256
elect8(__m256 base, __m256 x0, __m256 x1, __m256 lam, const int count_votes,
       const int divide_count)
{
    const __m256 zero = _mm256_setzero_ps();
    __m256 negative;
    if (count_votes) { /* sign(x0) + sign(x1) < 0 in integers: a true compare is -1 */
        __m256i s0 = _mm256_sub_epi32(_mm256_castps_si256(_mm256_cmp_ps(x0, zero, _CMP_LT_OQ)),
                                      _mm256_castps_si256(_mm256_cmp_ps(x0, zero, _CMP_GT_OQ)));
        __m256i s1 = _mm256_sub_epi32(_mm256_castps_si256(_mm256_cmp_ps(x1, zero, _CMP_LT_OQ)),
                                      _mm256_castps_si256(_mm256_cmp_ps(x1, zero, _CMP_GT_OQ)));
        negative = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_setzero_si256(), _mm256_add_epi32(s0, s1)));
    } else {
        negative = _mm256_cmp_ps(_mm256_add_ps(x0, x1), zero, _CMP_LT_OQ);
    }
    const __m256 flip = _mm256_and_ps(negative, _mm256_set1_ps(-0.0f));
    __m256 m0 = _mm256_max_ps(zero, _mm256_xor_ps(x0, flip));
    __m256 m1 = _mm256_max_ps(zero, _mm256_xor_ps(x1, flip));
    __m256 q = _mm256_xor_ps(_mm256_add_ps(m0, m1), flip);
    if (divide_count) {
        __m256 both = _mm256_and_ps(_mm256_cmp_ps(m0, zero, _CMP_GT_OQ),
                                    _mm256_cmp_ps(m1, zero, _CMP_GT_OQ));
        q = _mm256_blendv_ps(q, _mm256_mul_ps(q, _mm256_set1_ps(0.5f)), both);
    }
    return _mm256_fmadd_ps(q, lam, base);
}

/* two_loop in vectors, sixteen positions a step, for the sums (trim or band, drop or not, / sum w)
 * and the plain elections (TIES and DARE-TIES with weights all 1, either sign rule, no divisor
 * or the count); the last n % 16 positions run two_loop itself. */
__attribute__((target("avx2,fma"))) static inline int
two_avx2(const uint16_t *RESTRICT b, const uint16_t *RESTRICT e0, const uint16_t *RESTRICT e1,
         uint16_t *RESTRICT out, int64_t n, const uint32_t *RESTRICT r0,
         const uint32_t *RESTRICT r1, const Two *c, const int kind, const int band,
         const int dare, const int sum_divide, const int count_votes, const int divide_count)
{
    const __m256 low0 = _mm256_set1_ps(c->low0), low1 = _mm256_set1_ps(c->low1);
    const __m256 high0 = _mm256_set1_ps(c->high0), high1 = _mm256_set1_ps(c->high1);
    const __m256 limit0 = _mm256_set1_ps(c->limit0), limit1 = _mm256_set1_ps(c->limit1);
    const __m256 div0 = _mm256_set1_ps(c->div0), div1 = _mm256_set1_ps(c->div1);
    const __m256 drop0 = _mm256_castsi256_ps(_mm256_set1_epi32(c->drop0 ? -1 : 0));
    const __m256 drop1 = _mm256_castsi256_ps(_mm256_set1_epi32(c->drop1 ? -1 : 0));
    const __m256 sw0 = _mm256_set1_ps(c->sw0), sw1 = _mm256_set1_ps(c->sw1);
    const __m256 total = _mm256_set1_ps(c->total), lam_sum = _mm256_set1_ps(c->lam_sum);
    const __m256 lam = _mm256_set1_ps(c->lam);
    const __m256i magnitude16 = _mm256_set1_epi16(0x7FFF);
    __m256i most_in = _mm256_setzero_si256(), most_out = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m256i hb = _mm256_loadu_si256((const __m256i *)(b + j));
        __m256i h0 = _mm256_loadu_si256((const __m256i *)(e0 + j));
        __m256i h1 = _mm256_loadu_si256((const __m256i *)(e1 + j));
        __m256i largest = _mm256_max_epu16(_mm256_and_si256(hb, magnitude16),
                                           _mm256_and_si256(h0, magnitude16));
        largest = _mm256_max_epu16(largest, _mm256_and_si256(h1, magnitude16));
        most_in = _mm256_max_epu16(most_in, largest);
        __m256i rounded[2];
        for (int half = 0; half < 2; half++) {
            __m128i lb = half ? _mm256_extracti128_si256(hb, 1) : _mm256_castsi256_si128(hb);
            __m128i l0 = half ? _mm256_extracti128_si256(h0, 1) : _mm256_castsi256_si128(h0);
            __m128i l1 = half ? _mm256_extracti128_si256(h1, 1) : _mm256_castsi256_si128(h1);
            __m256 base = widen8(lb);
            __m256 d0 = _mm256_sub_ps(widen8(l0), base), d1 = _mm256_sub_ps(widen8(l1), base);
            __m256 x0 = hardshrink8(d0, low0), x1 = hardshrink8(d1, low1);
            if (band) {
                x0 = _mm256_sub_ps(x0, hardshrink8(d0, high0));
                x1 = _mm256_sub_ps(x1, hardshrink8(d1, high1));
            }
            if (dare) {
                x0 = drop8(x0, r0 + j + 8 * half, limit0, div0, drop0);
                x1 = drop8(x1, r1 + j + 8 * half, limit1, div1, drop1);
            }
            __m256 result;
            if (kind == KIND_SUM) { /* fma(x1, w1, x0 * w0) (/ sum w), then * lam + base */
                __m256 v = _mm256_fmadd_ps(x1, sw1, _mm256_mul_ps(x0, sw0));
                if (sum_divide) v = _mm256_div_ps(v, total);
                result = _mm256_add_ps(_mm256_mul_ps(v, lam_sum), base);
            } else {
                result = elect8(base, x0, x1, lam, count_votes, divide_count);
            }
            rounded[half] = round8(result);
        }
        /* packus works within 128-bit lanes: the quarters come out 0 2 1 3 */
        __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded[0], rounded[1]),
                                             _MM_SHUFFLE(3, 1, 2, 0));
        most_out = _mm256_max_epu16(most_out, _mm256_and_si256(h, magnitude16));
        _mm256_storeu_si256((__m256i *)(out + j), h);
    }
    uint16_t lanes[2][16], most_i = 0, most_o = 0;
    _mm256_storeu_si256((__m256i *)lanes[0], most_in);
    _mm256_storeu_si256((__m256i *)lanes[1], most_out);
    for (int l = 0; l < 16; l++) {
        most_i = umax16(most_i, lanes[0][l]);
        most_o = umax16(most_o, lanes[1][l]);
    }
    int found = (most_i >= 0x7F80u ? FOUND_IN_INPUT : 0) | (most_o >= 0x7F80u ? FOUND_IN_RESULT : 0);
    if (j < n)
        found |= two_loop(b + j, e0 + j, e1 + j, out + j, n - j, dare ? r0 + j : r0,
                          dare ? r1 + j : r1, c, kind, band, dare, sum_divide, count_votes,
                          divide_count ? DIVIDE_COUNT : DIVIDE_NONE, 0, 0, kind == KIND_ELECT);
    return found;
}

#define TWO_AVX2(name, kind, band, dare, sum_divide, count_votes, divide_count)               \
    __attribute__((target("avx2,fma"))) static int name(                                        \
        const uint16_t *b, const uint16_t *e0, const uint16_t *e1, uint16_t *out, int64_t n,   \
        const uint32_t *r0, const uint32_t *r1, const Two *c)                                  \
    {                                                                                           \
        return two_avx2(b, e0, e1, out, n, r0, r1, c, kind, band, dare, sum_divide,             \
                        count_votes, divide_count);                                             \
    }
TWO_AVX2(sum_trim_avx2, KIND_SUM, 0, 0, 0, 0, 0)
TWO_AVX2(sum_trim_div_avx2, KIND_SUM, 0, 0, 1, 0, 0)
TWO_AVX2(sum_band_avx2, KIND_SUM, 1, 0, 0, 0, 0)
TWO_AVX2(sum_band_div_avx2, KIND_SUM, 1, 0, 1, 0, 0)
TWO_AVX2(sum_dare_avx2, KIND_SUM, 0, 1, 0, 0, 0)
TWO_AVX2(sum_dare_div_avx2, KIND_SUM, 0, 1, 1, 0, 0)
TWO_AVX2(elect_sum_none_plain_avx2, KIND_ELECT, 0, 0, 0, 0, 0)
TWO_AVX2(elect_sum_count_plain_avx2, KIND_ELECT, 0, 0, 0, 0, 1)
TWO_AVX2(elect_votes_none_plain_avx2, KIND_ELECT, 0, 0, 0, 1, 0)
TWO_AVX2(elect_votes_count_plain_avx2, KIND_ELECT, 0, 0, 0, 1, 1)
TWO_AVX2(elect_sum_none_plain_dare_avx2, KIND_ELECT, 0, 1, 0, 0, 0)
TWO_AVX2(elect_sum_count_plain_dare_avx2, KIND_ELECT, 0, 1, 0, 0, 1)
TWO_AVX2(elect_votes_none_plain_dare_avx2, KIND_ELECT, 0, 1, 0, 1, 0)
TWO_AVX2(elect_votes_count_plain_dare_avx2, KIND_ELECT, 0, 1, 0, 1, 1)
#endif

/* The specialised loop for these options (two bfloat16 experts, bfloat16 output), with c
 * filled in, or NULL: then merge_tile runs. */
static TwoLoop two_loop_for(const Merge *g, Two *c)
{
    if (!g->bf16_in || !g->bf16_out || g->n != 2) return NULL;
    const int64_t *f = g->flags;
    const float *p0 = g->params, *p1 = g->params + N_PARAMS;
    const int band = f[F_BAND] != 0;
    const int drop0 = p0[P_DARE_LIMIT] != 0.0f, drop1 = p1[P_DARE_LIMIT] != 0.0f;
    const int dare = drop0 || drop1;
    if (dare && band) return NULL;
    /* rescale only where the expert drops (the loop divides both or neither) */
    if ((!drop0 && p0[P_DARE_DIVISOR] != 0.0f) || (!drop1 && p1[P_DARE_DIVISOR] != 0.0f))
        return NULL;
    memset(c, 0, sizeof *c);
    c->low0 = p0[P_LOW], c->low1 = p1[P_LOW], c->high0 = p0[P_HIGH], c->high1 = p1[P_HIGH];
    c->limit0 = p0[P_DARE_LIMIT], c->limit1 = p1[P_DARE_LIMIT];
    c->div0 = p0[P_DARE_DIVISOR] != 0.0f ? p0[P_DARE_DIVISOR] : 1.0f;
    c->div1 = p1[P_DARE_DIVISOR] != 0.0f ? p1[P_DARE_DIVISOR] : 1.0f;
    c->drop0 = drop0, c->drop1 = drop1;
    if (f[F_KIND] == KIND_SUM) {
        c->sw0 = p0[P_SUM_W], c->sw1 = p1[P_SUM_W], c->total = g->scalars[S_TOTAL];
        c->lam_sum = f[F_SCALE] != 0 ? g->scalars[S_LAMBDA] : 1.0f;
        /* [trim, band, drop][divide by sum w] */
        static const TwoLoop sums[3][2] = {
            {sum_trim, sum_trim_div}, {sum_band, sum_band_div}, {sum_dare, sum_dare_div}};
        const TwoLoop(*table)[2] = sums;
#ifdef HAVE_AVX2_LOOPS
        static const TwoLoop vector_sums[3][2] = {{sum_trim_avx2, sum_trim_div_avx2},
                                                  {sum_band_avx2, sum_band_div_avx2},
                                                  {sum_dare_avx2, sum_dare_div_avx2}};
        if (vector_loops) table = vector_sums;
#endif
        return table[band ? 1 : dare ? 2 : 0][f[F_SUM_DIVIDE] != 0];
    }
    if (band || f[F_ANY_FLIP] != 0) return NULL;
    two_weights(g, P_VOTE_W, f[F_VOTE_PLAIN] != 0, &c->vw0, &c->vw1);
    two_weights(g, P_MERGE_W, f[F_MERGE_PLAIN] != 0, &c->mw0, &c->mw1);
    two_weights(g, P_DIVISOR_W, f[F_DIVISOR_PLAIN] != 0, &c->dw0, &c->dw1);
    c->f0 = p0[P_FLIP], c->f1 = p1[P_FLIP];
    c->lam = g->scalars[S_LAMBDA], c->min_w = g->scalars[S_MIN_W];
    const int votes = f[F_VOTE_COUNT] != 0, positive = f[F_ALL_POSITIVE] != 0;
    int64_t divide_by = f[F_DIVIDE_BY];
    /* Sum w of the agreeing experts with every w = 1 (and min w = 1) is their count, at least 1 */
    if (divide_by == DIVIDE_WEIGHT_SUM && f[F_DIVISOR_PLAIN] != 0 && positive &&
        c->min_w == 1.0f)
        divide_by = DIVIDE_COUNT;
    const int plain = f[F_VOTE_PLAIN] != 0 && f[F_MERGE_PLAIN] != 0;
    /* [drop][sign rule: sum, votes][divisor: none, count] */
    static const TwoLoop plain_table[2][2][2] = {
        {{elect_sum_none_plain, elect_sum_count_plain},
         {elect_votes_none_plain, elect_votes_count_plain}},
        {{elect_sum_none_plain_dare, elect_sum_count_plain_dare},
         {elect_votes_none_plain_dare, elect_votes_count_plain_dare}},
    };
    const TwoLoop(*plains)[2][2] = plain_table;
#ifdef HAVE_AVX2_LOOPS
    static const TwoLoop vector_table[2][2][2] = {
        {{elect_sum_none_plain_avx2, elect_sum_count_plain_avx2},
         {elect_votes_none_plain_avx2, elect_votes_count_plain_avx2}},
        {{elect_sum_none_plain_dare_avx2, elect_sum_count_plain_dare_avx2},
         {elect_votes_none_plain_dare_avx2, elect_votes_count_plain_dare_avx2}},
    };
    if (vector_loops) plains = vector_table;
#endif
    if (plain && divide_by != DIVIDE_WEIGHT_SUM)
        return plains[dare][votes][divide_by == DIVIDE_COUNT];
    static const TwoLoop table[2][2][4] = {
        {{elect_sum_none, elect_sum_count, elect_sum_weight_any, elect_sum_weight},
         {elect_votes_none, elect_votes_count, elect_votes_weight_any, elect_votes_weight}},
        {{elect_sum_none_dare, elect_sum_count_dare, elect_sum_weight_any_dare,
          elect_sum_weight_dare},
         {elect_votes_none_dare, elect_votes_count_dare, elect_votes_weight_any_dare,
          elect_votes_weight_dare}},
    };
    int column;
    switch (divide_by) {
    case DIVIDE_NONE: column = 0; break;
    case DIVIDE_COUNT: column = 1; break;
    case DIVIDE_WEIGHT_SUM: column = positive ? 3 : 2; break;
    default: return NULL;
    }
    return table[dare][votes][column];
}

/* merge_chunk: m positions; with DARE, the chunk is whole blocks of `block` entries (the last
 * may be partial), expert i's random bits in block bk from stream lanes[bk * n + i] (-1: it
 * does not drop) whose state is states[l / DARE_LANES][.][l % DARE_LANES]; every stream
 * advances together, so the blocks are merged a tile of each in turn. */
static int merge_chunk_impl(const Merge *g, int64_t m, const uint64_t *states, int64_t n_groups,
                            const int64_t *lanes, int64_t n_blocks, int64_t block)
{
    int found = 0;
    float *tau = malloc(sizeof(float) * TILE * (size_t)g->n);
    float *work = malloc(sizeof(float) * TILE * 8);
    const uint32_t **bits = malloc(sizeof(uint32_t *) * (size_t)g->n);
    int64_t n_streams = n_groups * DARE_LANES;
    uint64_t *state = NULL, *raw = NULL;
    if (n_blocks > 0) {
        state = malloc(sizeof(uint64_t) * 4 * DARE_LANES * (size_t)(n_groups ? n_groups : 1));
        raw = malloc(sizeof(uint64_t) * (TILE / 2) * (size_t)(n_streams ? n_streams : 1));
    }
    if (!tau || !work || !bits || (n_blocks > 0 && (!state || !raw))) {
        found = -1;
        goto done;
    }
    Two c;
    TwoLoop fast = two_loop_for(g, &c);
    const uint16_t *b16 = (const uint16_t *)(intptr_t)g->addresses[0];
    const uint16_t *e0 = NULL, *e1 = NULL;
    uint16_t *o16 = (uint16_t *)(intptr_t)g->out;
    if (fast) {
        e0 = (const uint16_t *)(intptr_t)g->addresses[1];
        e1 = (const uint16_t *)(intptr_t)g->addresses[2];
    }
    if (n_blocks == 0) {
        for (int i = 0; i < g->n; i++) bits[i] = NULL;
        if (fast) {
            found = fast(b16, e0, e1, o16, m, NULL, NULL, &c);
        } else {
            for (int64_t t0 = 0; t0 < m; t0 += TILE)
                merge_tile(g, t0, m - t0 < TILE ? m - t0 : TILE, bits, tau, work, &found);
        }
        goto done;
    }
    memcpy(state, states, sizeof(uint64_t) * 4 * DARE_LANES * (size_t)n_groups);
    const uint32_t *halves = (const uint32_t *)raw; /* little-endian: low half first */
    int64_t first_block = block < m ? block : m;
    for (int64_t t0 = 0; t0 < first_block; t0 += TILE) {
        /* this tile's random bits of every stream (the first block is the longest) */
        int64_t length0 = m - t0 < TILE ? m - t0 : TILE;
        for (int64_t gi = 0; gi < n_groups; gi++)
            sfc64_lanes((uint64_t *)state + gi * 4 * DARE_LANES, raw + gi * DARE_LANES * (TILE / 2),
                        (length0 + 1) / 2, TILE / 2);
        for (int64_t bk = 0; bk < n_blocks; bk++) {
            int64_t first = bk * block + t0;
            if (first >= m) continue;
            int64_t length = m - first;
            if (length > TILE) length = TILE;
            if ((bk + 1) * block - first < length) length = (bk + 1) * block - first;
            for (int i = 0; i < g->n; i++) {
                int64_t lane = lanes[bk * g->n + i];
                bits[i] = lane >= 0 ? halves + lane * TILE : NULL;
            }
            if (fast) {
                /* an expert that does not drop reads bits it does not use: any row will do */
                const uint32_t *r0 = bits[0] ? bits[0] : halves, *r1 = bits[1] ? bits[1] : halves;
                found |= fast(b16 + first, e0 + first, e1 + first, o16 + first, length, r0, r1, &c);
            } else {
                merge_tile(g, first, length, bits, tau, work, &found);
            }
        }
    }
done:
    free(tau);
    free(work);
    free(bits);
    free(state);
    free(raw);
    return found;
}

/* sum_chunk: methods._combine for m positions: sum_i w_i x_i without a base, else
 * theta_b + lam * sum_i w_i (x_i - theta_b); divided by sum w where flags[F_SUM_DIVIDE]. torch's
 * operations in its order: the first term multiplied, the others added by add_(x, alpha=w)
 * (an FMA), then div_, then torch.add(theta_b, sum, alpha=lam) (an FMA too). */
INLINE int sum_two_loop(const uint16_t *RESTRICT b, const uint16_t *RESTRICT e0,
                        const uint16_t *RESTRICT e1, uint16_t *RESTRICT out, int64_t m, float w0,
                        float w1, float total, float lam, const int has_base, const int divide)
{
    uint32_t most_in = 0, most_out = 0;
    for (int64_t j = 0; j < m; j++) {
        uint32_t h0 = e0[j], h1 = e1[j];
        uint32_t hb = has_base ? b[j] : 0;
        most_in = umax(most_in, umax(hb & 0x7FFFu, umax(h0 & 0x7FFFu, h1 & 0x7FFFu)));
        float base = bf16_to_f32(hb);
        float x0 = bf16_to_f32(h0), x1 = bf16_to_f32(h1);
        if (has_base) {
            x0 = x0 - base;
            x1 = x1 - base;
        }
        float acc = fmaf(x1, w1, x0 * w0);
        if (divide) acc = acc / total;
        if (has_base) acc = fmaf(acc, lam, base);
        uint16_t h = f32_to_bf16(acc);
        most_out = umax(most_out, (uint32_t)h & 0x7FFFu);
        out[j] = h;
    }
    return (most_in >= 0x7F80u ? FOUND_IN_INPUT : 0) | (most_out >= 0x7F80u ? FOUND_IN_RESULT : 0);
}

typedef int (*SumLoop)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t,
                       float, float, float, float);
#define SUM(name, has_base, divide)                                                             \
    HOT static int name(const uint16_t *b, const uint16_t *e0, const uint16_t *e1,             \
                        uint16_t *out, int64_t m, float w0, float w1, float total, float lam)  \
    {                                                                                           \
        return sum_two_loop(b, e0, e1, out, m, w0, w1, total, lam, has_base, divide);           \
    }
SUM(sum_plain, 0, 0)
SUM(sum_plain_div, 0, 1)
SUM(sum_base, 1, 0)
SUM(sum_base_div, 1, 1)

HOT static int sum_chunk_impl(const int64_t *addresses, int n, int has_base, int bf16_in, int64_t m,
                          int64_t out, int bf16_out, const float *weights, const float *scalars,
                          const int64_t *flags)
{
    const int divide = flags[F_SUM_DIVIDE] != 0;
    const float total = scalars[S_TOTAL], lam = scalars[S_LAMBDA];
    if (bf16_in && bf16_out && n == 2) {
        static const SumLoop table[2][2] = {{sum_plain, sum_plain_div}, {sum_base, sum_base_div}};
        const uint16_t *b = has_base ? (const uint16_t *)(intptr_t)addresses[0] : NULL;
        const uint16_t *e0 = (const uint16_t *)(intptr_t)addresses[has_base];
        const uint16_t *e1 = (const uint16_t *)(intptr_t)addresses[has_base + 1];
        return table[has_base][divide](b ? b : e0, e0, e1, (uint16_t *)(intptr_t)out, m,
                                       weights[0], weights[1], total, lam);
    }
    float work[3 * TILE];
    float *b = work, *x = work + TILE, *acc = work + 2 * TILE;
    int found = 0;
    for (int64_t t0 = 0; t0 < m; t0 += TILE) {
        int64_t n_tile = m - t0 < TILE ? m - t0 : TILE;
        int bad = 0;
        if (has_base) bad |= load_tile(addresses[0], bf16_in, t0, n_tile, b);
        for (int i = 0; i < n; i++) {
            bad |= load_tile(addresses[has_base + i], bf16_in, t0, n_tile, x);
            if (has_base)
                for (int64_t j = 0; j < n_tile; j++) x[j] = x[j] - b[j];
            add_row(acc, x, n_tile, i == 0, 0, weights[i]);
        }
        if (divide)
            for (int64_t j = 0; j < n_tile; j++) acc[j] = acc[j] / total;
        if (has_base)
            for (int64_t j = 0; j < n_tile; j++) acc[j] = fmaf(acc[j], lam, b[j]);
        found |= (bad ? FOUND_IN_INPUT : 0) |
                 (emit_tile(out, bf16_out, t0, n_tile, acc) ? FOUND_IN_RESULT : 0);
    }
    return found;
}

/* ---- histogram passes over |tau| (ops.KthLargestAbs) ------------------------------------ */

/* Where the sampled run of period p starts among the m entries (ops._sample_runs). */
INLINE int64_t run_start(int64_t p, int64_t m, int64_t step, int64_t run)
{
    int64_t start = p * run * step;
    if (p < m / (run * step)) /* a complete period: the run ops.run_offsets picks */
        start += ((p * RUN_HASH) >> 16) % step * run;
    return start;
}

/* load_tile without the NaN/Inf check (the histogram passes: the merge checks every input). */
INLINE void widen_tile(int64_t addr, int bf16, int64_t start, int64_t count, float *RESTRICT dst)
{
    if (bf16) {
        const uint16_t *src = (const uint16_t *)(intptr_t)addr + start;
        for (int64_t j = 0; j < count; j++) dst[j] = bf16_to_f32(src[j]);
    } else {
        memcpy(dst, (const float *)(intptr_t)addr + start, sizeof(float) * (size_t)count);
    }
}

/* Sampled entries first .. first + count - 1 of m (all entries for step 1, else runs of run
 * entries, one from every run * step at run_start's offset), widened into dst. */
INLINE void load_sample(int64_t addr, int bf16, int64_t m, int64_t first, int64_t count,
                        int64_t step, int64_t run, float *dst)
{
    if (step == 1) {
        widen_tile(addr, bf16, first, count, dst);
        return;
    }
    for (int64_t r = 0; r < count; r += run) {
        int64_t start = run_start((first + r) / run, m, step, run);
        int64_t n = run;
        if (count - r < n) n = count - r;
        if (m - start < n) n = m - start;
        widen_tile(addr, bf16, start, n, dst + r);
    }
}

/* Start loading the cache lines load_sample will read for the same arguments (step > 1): each
 * run is a line or two at a hashed offset, which the CPU's own prefetchers do not guess. */
INLINE void prefetch_sample(int64_t addr, int bf16, int64_t m, int64_t first, int64_t count,
                            int64_t step, int64_t run)
{
#if defined(__GNUC__)
    const int width = bf16 ? 2 : 4;
    for (int64_t r = 0; r < count; r += run) {
        int64_t start = run_start((first + r) / run, m, step, run);
        int64_t n = run;
        if (count - r < n) n = count - r;
        if (m - start < n) n = m - start;
        if (n <= 0) break;
        const char *lo = (const char *)(intptr_t)addr + width * start;
        const char *hi = lo + width * n - 1;
        for (; lo <= hi; lo += 64) __builtin_prefetch(lo, 0, 3);
        __builtin_prefetch(hi, 0, 3);
    }
#else
    (void)addr, (void)bf16, (void)m, (void)first, (void)count, (void)step, (void)run;
#endif
}

/* |tau| = |expert - base| of a tile, once per expert for all its passes. */
INLINE void magnitudes_tile(const float *RESTRICT expert, const float *RESTRICT base, int64_t n,
                            float *RESTRICT magnitudes)
{
    for (int64_t j = 0; j < n; j++) magnitudes[j] = fabsf(expert[j] - base[j]);
}

/* The magnitudes compared with the band [lowest, highest]: 1 into inside[j] in the band;
 * returns how many entries lie in the band (*n_in) and above it (*n_above; NaN counts as
 * above, as its bits do). */
INLINE void band_tile(const float *RESTRICT magnitudes, int64_t n, float lowest, float highest,
                      uint8_t *RESTRICT inside, int64_t *n_in, int64_t *n_above)
{
    int32_t in_band = 0, above = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = magnitudes[j];
        int keep = (v >= lowest) & (v <= highest);
        in_band += keep;
        above += !(v <= highest);
        inside[j] = (uint8_t)keep;
    }
    *n_in = in_band;
    *n_above = above;
}

INLINE uint32_t tau_bits(const float *expert, const float *base, int64_t j)
{
    return f2u(expert[j] - base[j]) & 0x7FFFFFFFu;
}

/* The bits of |tau| straight from bfloat16 inputs (the same operations as the staged way). */
INLINE uint32_t direct_bits(const uint16_t *base, const uint16_t *expert, int64_t j)
{
    return f2u(bf16_to_f32(expert[j]) - bf16_to_f32(base[j])) & 0x7FFFFFFFu;
}

/* band_tile straight from bfloat16 inputs (no widened copies). */
INLINE void band_direct(const uint16_t *RESTRICT base, const uint16_t *RESTRICT expert, int64_t n,
                        float lowest, float highest, uint8_t *RESTRICT inside, int64_t *n_in,
                        int64_t *n_above)
{
    int32_t in_band = 0, above = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = fabsf(bf16_to_f32(expert[j]) - bf16_to_f32(base[j]));
        int keep = (v >= lowest) & (v <= highest);
        in_band += keep;
        above += !(v <= highest);
        inside[j] = (uint8_t)keep;
    }
    *n_in = in_band;
    *n_above = above;
}

/* band_direct for two bands of the same expert at once (breadcrumbs' two edges). */
INLINE void band_direct2(const uint16_t *RESTRICT base, const uint16_t *RESTRICT expert, int64_t n,
                         float lowest, float highest, float lowest2, float highest2,
                         uint8_t *RESTRICT inside, uint8_t *RESTRICT inside2, int64_t *counts)
{
    int32_t in_band = 0, above = 0, in_band2 = 0, above2 = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = fabsf(bf16_to_f32(expert[j]) - bf16_to_f32(base[j]));
        int keep = (v >= lowest) & (v <= highest), keep2 = (v >= lowest2) & (v <= highest2);
        in_band += keep;
        above += !(v <= highest);
        in_band2 += keep2;
        above2 += !(v <= highest2);
        inside[j] = (uint8_t)keep;
        inside2[j] = (uint8_t)keep2;
    }
    counts[0] = in_band, counts[1] = above, counts[2] = in_band2, counts[3] = above2;
}

#ifdef HAVE_AVX2_LOOPS

/* band_direct (and band_direct2: a second band of the same expert into words2, when
 * `two`) with one bit per entry (bit j % 64 of words[j / 64]) instead of a byte, from AVX2's
 * movemask: the same float32 |tau| and the same comparisons, a quarter of the words to scan.
 * The word arrays hold GROUPED / 64 words, all written; n <= GROUPED. counts: in and above the
 * band, then in and above the second. */
__attribute__((target("avx2"))) static inline void
band_masks_avx2(const uint16_t *RESTRICT base, const uint16_t *RESTRICT expert, int64_t n,
                float lowest, float highest, float lowest2, float highest2,
                uint64_t *RESTRICT words, uint64_t *RESTRICT words2, int64_t *counts,
                const int two)
{
    const __m256 lo = _mm256_set1_ps(lowest), hi = _mm256_set1_ps(highest);
    const __m256 lo2 = _mm256_set1_ps(lowest2), hi2 = _mm256_set1_ps(highest2);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256i in_band = _mm256_setzero_si256(), above = _mm256_setzero_si256();
    __m256i in_band2 = _mm256_setzero_si256(), above2 = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        uint64_t word = 0, word2 = 0;
        for (int q = 0; q < 8; q++) {
            __m256 v = _mm256_sub_ps(widen8(_mm_loadu_si128((const __m128i *)(expert + j + 8 * q))),
                                     widen8(_mm_loadu_si128((const __m128i *)(base + j + 8 * q))));
            v = _mm256_and_ps(v, magnitude);
            __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ),
                                        _mm256_cmp_ps(v, hi, _CMP_LE_OQ));
            in_band = _mm256_sub_epi32(in_band, _mm256_castps_si256(keep));
            above = _mm256_sub_epi32(above, _mm256_castps_si256(_mm256_cmp_ps(v, hi, _CMP_NLE_UQ)));
            word |= (uint64_t)(uint32_t)_mm256_movemask_ps(keep) << (8 * q);
            if (two) {
                __m256 keep2 = _mm256_and_ps(_mm256_cmp_ps(v, lo2, _CMP_GE_OQ),
                                             _mm256_cmp_ps(v, hi2, _CMP_LE_OQ));
                in_band2 = _mm256_sub_epi32(in_band2, _mm256_castps_si256(keep2));
                above2 = _mm256_sub_epi32(above2,
                                          _mm256_castps_si256(_mm256_cmp_ps(v, hi2, _CMP_NLE_UQ)));
                word2 |= (uint64_t)(uint32_t)_mm256_movemask_ps(keep2) << (8 * q);
            }
        }
        words[j / 64] = word;
        if (two) words2[j / 64] = word2;
    }
    int32_t lanes[4][8];
    _mm256_storeu_si256((__m256i *)lanes[0], in_band);
    _mm256_storeu_si256((__m256i *)lanes[1], above);
    _mm256_storeu_si256((__m256i *)lanes[2], in_band2);
    _mm256_storeu_si256((__m256i *)lanes[3], above2);
    int64_t total[4] = {0, 0, 0, 0};
    for (int r = 0; r < 4; r++)
        for (int l = 0; l < 8; l++) total[r] += lanes[r][l];
    if (j < n) { /* the last, partial word */
        uint64_t word = 0, word2 = 0;
        for (int64_t i = j; i < n; i++) {
            float v = fabsf(bf16_to_f32(expert[i]) - bf16_to_f32(base[i]));
            int keep = (v >= lowest) & (v <= highest), keep2 = (v >= lowest2) & (v <= highest2);
            total[0] += keep;
            total[1] += !(v <= highest);
            total[2] += keep2;
            total[3] += !(v <= highest2);
            word |= (uint64_t)keep << (i - j);
            word2 |= (uint64_t)keep2 << (i - j);
        }
        words[j / 64] = word;
        if (two) words2[j / 64] = word2;
        j += 64;
    }
    for (; j < GROUPED; j += 64) {
        words[j / 64] = 0;
        if (two) words2[j / 64] = 0;
    }
    for (int r = 0; r < (two ? 4 : 2); r++) counts[r] = total[r];
}

__attribute__((target("avx2"))) static void
band_direct_masks(const uint16_t *RESTRICT base, const uint16_t *RESTRICT expert, int64_t n,
                  float lowest, float highest, uint64_t *RESTRICT words, int64_t *n_in,
                  int64_t *n_above)
{
    int64_t counts[2];
    band_masks_avx2(base, expert, n, lowest, highest, 0.0f, 0.0f, words, NULL, counts, 0);
    *n_in = counts[0];
    *n_above = counts[1];
}

__attribute__((target("avx2"))) static void
band_direct2_masks(const uint16_t *RESTRICT base, const uint16_t *RESTRICT expert, int64_t n,
                   float lowest, float highest, float lowest2, float highest2,
                   uint64_t *RESTRICT words, uint64_t *RESTRICT words2, int64_t *counts)
{
    band_masks_avx2(base, expert, n, lowest, highest, lowest2, highest2, words, words2, counts, 1);
}
#endif

/* The bits of |tau| from its float magnitude (the same bits: fabsf clears the sign). */
INLINE uint32_t magnitude_bits(const float *magnitudes, int64_t j) { return f2u(magnitudes[j]); }

typedef struct {
    const int64_t *addresses;
    int bf16;
    int64_t m, step, run;
    int64_t n_passes;
    const int64_t *experts; /* pass k counts expert experts[k] (sorted) */
    const uint8_t *top_bits, *collect;
    const int64_t *lows, *widths;
    int32_t *counts;        /* [n_passes, count_width] */
    int64_t count_width;
    int32_t *values;        /* [n_passes, capacity] */
    int64_t capacity;
    int64_t *filled;        /* [n_passes] */
} Passes;

/* tau_abs_histograms: counts of the ops.KthLargestAbs passes over |tau_e| (float32 bits), one
 * per row of counts, for every step-th of the m entries (base first, then the experts). Pass
 * k: with top_bits[k] the top 16 bits (2^15 bins); else bits - lows[k] clamped to
 * [0, widths[k] + 1]; with collect[k] only the entries below and above that band (bins 0 and
 * 1), the bit patterns inside it going to values[k, filled[k]++] while there is room (filled
 * counts them all). The base is read once for all passes. */
HOT static int tau_abs_histograms_impl(const Passes *q)
{
    const int64_t m = q->m, step = q->step, run = q->run;
    const int64_t period = run * step;
    const int64_t total = step == 1 ? m : m / period * run + (m % period < run ? m % period : run);
    float base[GROUPED], expert[GROUPED], magnitudes[GROUPED];
    uint32_t bins[GROUPED];
    union { uint8_t bytes[GROUPED]; uint64_t words[GROUPED / 8]; } inside, inside2;
    int64_t paired[4] = {0, 0, 0, 0}, pending = -1; /* band counts of pass `pending`, flagged in inside2 */
    int pending_bits = 0; /* inside2 holds bit masks */
    int64_t *ends = calloc((size_t)(q->n_passes ? q->n_passes : 1) * 2, sizeof(int64_t));
    if (!ends) return -1;
    memset(inside.bytes, 0, sizeof inside.bytes);
    memset(inside2.bytes, 0, sizeof inside2.bytes);
    for (int64_t t0 = 0; t0 < total; t0 += GROUPED) {
        int64_t length = total - t0 < GROUPED ? total - t0 : GROUPED;
        if (step > 1 && t0 + GROUPED < total) { /* the next tile's runs, while this one counts */
            int64_t after = total - t0 - GROUPED < GROUPED ? total - t0 - GROUPED : GROUPED;
            prefetch_sample(q->addresses[0], q->bf16, m, t0 + GROUPED, after, step, run);
            for (int64_t k = 0; k < q->n_passes; k++)
                if (k == 0 || q->experts[k] != q->experts[k - 1])
                    prefetch_sample(q->addresses[1 + q->experts[k]], q->bf16, m, t0 + GROUPED,
                                    after, step, run);
        }
        /* every entry of bfloat16 inputs: read in place; else widened copies of the sample */
        const int direct = step == 1 && q->bf16;
        const uint16_t *b16 = (const uint16_t *)(intptr_t)q->addresses[0] + t0, *e16 = NULL;
        if (!direct) load_sample(q->addresses[0], q->bf16, m, t0, length, step, run, base);
        int64_t loaded = -1, measured = -1;
        for (int64_t k = 0; k < q->n_passes; k++) {
            if (q->experts[k] != loaded) {
                loaded = q->experts[k];
                e16 = (const uint16_t *)(intptr_t)q->addresses[1 + loaded] + t0;
                if (!direct)
                    load_sample(q->addresses[1 + loaded], q->bf16, m, t0, length, step, run,
                                expert);
            }
            int32_t *row = q->counts + k * q->count_width;
            const int64_t low = q->lows[k], width = q->widths[k];
            if (q->top_bits[k]) { /* the bins in a vectorised loop, then the increments */
                if (direct)
                    for (int64_t j = 0; j < length; j++) bins[j] = direct_bits(b16, e16, j) >> 16;
                else
                    for (int64_t j = 0; j < length; j++) bins[j] = tau_bits(expert, base, j) >> 16;
                for (int64_t j = 0; j < length; j++) row[bins[j]] += 1;
                continue;
            }
            const int64_t highest = low + width; /* the band: bits low + 1 .. highest */
            if (highest >= (int64_t)F32_INF_BITS) { /* a band reaching Inf/NaN: entry by entry */
                for (int64_t j = 0; j < length; j++) {
                    uint32_t bits = direct ? direct_bits(b16, e16, j) : tau_bits(expert, base, j);
                    int64_t v = (int64_t)bits - low;
                    if (!q->collect[k]) {
                        row[v < 0 ? 0 : (v > width + 1 ? width + 1 : v)] += 1;
                    } else if (v <= 0) {
                        ends[2 * k] += 1;
                    } else if (v > width) {
                        ends[2 * k + 1] += 1;
                    } else {
                        int64_t at = q->filled[k];
                        if (at < q->capacity) q->values[k * q->capacity + at] = (int32_t)(v + low);
                        q->filled[k] = at + 1;
                    }
                }
                continue;
            }
            /* Most entries fall outside the band: a vectorised loop counts the entries in and
             * above it and flags those in it (a bit each with AVX2, else a byte each), and a
             * second loop visits only the flagged ones, a 64-bit word of flags at a time. */
            int64_t n_in = 0, n_above = 0;
            int per_bit = 0; /* inside.words: a bit per entry (else a byte) */
            const float lowest = u2f((uint32_t)(low + 1)), top = u2f((uint32_t)highest);
            const int pair = direct && k + 1 < q->n_passes && q->experts[k + 1] == loaded &&
                             !q->top_bits[k + 1] &&
                             q->lows[k + 1] + q->widths[k + 1] < (int64_t)F32_INF_BITS;
            if (pending == k) { /* counted with the pass before, of the same expert */
                per_bit = pending_bits;
                memcpy(inside.bytes, inside2.bytes, per_bit ? GROUPED / 8 : (size_t)length);
                n_in = paired[2], n_above = paired[3];
                pending = -1;
            } else if (pair) {
                const int64_t low2 = q->lows[k + 1], high2 = low2 + q->widths[k + 1];
                const float lowest2 = u2f((uint32_t)(low2 + 1)), top2 = u2f((uint32_t)high2);
#ifdef HAVE_AVX2_LOOPS
                if (band_masks) {
                    band_direct2_masks(b16, e16, length, lowest, top, lowest2, top2, inside.words,
                                       inside2.words, paired);
                    per_bit = 1;
                } else
#endif
                band_direct2(b16, e16, length, lowest, top, lowest2, top2, inside.bytes,
                             inside2.bytes, paired);
                pending_bits = per_bit;
                n_in = paired[0], n_above = paired[1];
                pending = k + 1;
            } else if (direct) {
#ifdef HAVE_AVX2_LOOPS
                if (band_masks) {
                    band_direct_masks(b16, e16, length, lowest, top, inside.words, &n_in,
                                      &n_above);
                    per_bit = 1;
                } else
#endif
                band_direct(b16, e16, length, lowest, top, inside.bytes, &n_in, &n_above);
            } else {
                if (measured != loaded) { /* |tau| once for all of this expert's band passes */
                    measured = loaded;
                    magnitudes_tile(expert, base, length, magnitudes);
                }
                band_tile(magnitudes, length, lowest, top, inside.bytes, &n_in, &n_above);
            }
            if (!per_bit)
                for (int64_t j = length; j < GROUPED; j++) inside.bytes[j] = 0;
            /* each flagged entry, by the lowest set bit of its word */
            const int shift = per_bit ? 0 : 3;
            const int64_t n_words = GROUPED / (per_bit ? 64 : 8), per_word = 64 >> shift;
            if (n_in != 0 && q->collect[k]) {
                int32_t *kept = q->values + k * q->capacity;
                int64_t at = q->filled[k];
                for (int64_t w = 0; w < n_words; w++) {
                    uint64_t flagged = inside.words[w];
                    while (flagged) {
                        int64_t j = per_word * w + (__builtin_ctzll(flagged) >> shift);
                        if (at < q->capacity)
                            kept[at] = (int32_t)(direct ? direct_bits(b16, e16, j)
                                                        : magnitude_bits(magnitudes, j));
                        at += 1;
                        flagged &= flagged - 1;
                    }
                }
                q->filled[k] = at;
            } else if (n_in != 0) {
                for (int64_t w = 0; w < n_words; w++) {
                    uint64_t flagged = inside.words[w];
                    while (flagged) {
                        int64_t j = per_word * w + (__builtin_ctzll(flagged) >> shift);
                        uint32_t bits = direct ? direct_bits(b16, e16, j) : magnitude_bits(magnitudes, j);
                        row[(int64_t)bits - low] += 1;
                        flagged &= flagged - 1;
                    }
                }
            }
            ends[2 * k] += length - n_in - n_above;
            ends[2 * k + 1] += n_above;
        }
    }
    for (int64_t k = 0; k < q->n_passes; k++) {
        if (q->top_bits[k]) continue;
        int32_t *row = q->counts + k * q->count_width;
        row[0] += (int32_t)ends[2 * k];
        row[q->collect[k] ? 1 : q->widths[k] + 1] += (int32_t)ends[2 * k + 1];
    }
    free(ends);
    return 0;
}

/* ops._locate: the bin holding the k-th largest item, and its rank inside it. */
static void locate_from_top_impl(const int64_t *counts, int64_t n, int64_t k, int64_t *bin,
                                 int64_t *rank)
{
    int64_t above = 0;
    for (int64_t i = n - 1; i >= 0; i--) {
        if (above + counts[i] >= k) {
            *bin = i;
            *rank = k - above;
            return;
        }
        above += counts[i];
    }
    *bin = 0;
    *rank = k - above;
}

/* ops._kth_largest_bits for non-negative int32 bit patterns (1 <= k <= n): the same two radix
 * steps (top 16 bits, then the low 16 inside that bucket). Returns -1 on a failed allocation. */
static int64_t kth_largest_bits_impl(const int32_t *values, int64_t n, int64_t k)
{
    int32_t lo = values[0], hi = values[0];
    for (int64_t i = 1; i < n; i++) {
        lo = values[i] < lo ? values[i] : lo;
        hi = values[i] > hi ? values[i] : hi;
    }
    int64_t first = lo >> 16, last = hi >> 16;
    int64_t *buckets = calloc((size_t)(last - first + 1), sizeof(int64_t));
    int64_t *lows = calloc((size_t)1 << 16, sizeof(int64_t));
    if (!buckets || !lows) {
        free(buckets);
        free(lows);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) buckets[(values[i] >> 16) - first] += 1;
    int64_t bucket, rank, low, unused;
    locate_from_top_impl(buckets, last - first + 1, k, &bucket, &rank);
    for (int64_t i = 0; i < n; i++)
        if ((values[i] >> 16) - first == bucket) lows[values[i] & 0xFFFF] += 1;
    locate_from_top_impl(lows, (int64_t)1 << 16, rank, &low, &unused);
    free(buckets);
    free(lows);
    return ((first + bucket) << 16) | low;
}

/* ---- a tensor's exact k-th largest |tau| in one call ------------------------------------ */

/* ops._locate over int32 counts (locate_from_top_impl's). */
static void locate32(const int32_t *counts, int64_t n, int64_t k, int64_t *bin, int64_t *rank)
{
    int64_t above = 0;
    for (int64_t i = n - 1; i >= 0; i--) {
        if (above + counts[i] >= k) {
            *bin = i;
            *rank = k - above;
            return;
        }
        above += counts[i];
    }
    *bin = 0;
    *rank = k - above;
}

/* The k-th largest (1 <= k <= n) of n non-negative int32 values, which it reorders: radix
 * steps of at most 2^11 bins over the values' range, keeping only the bin that holds the k-th
 * after each (a pass over n, then over that bin's few). */
static int32_t select_kth_largest(int32_t *v, int64_t n, int64_t k)
{
    uint32_t lo = (uint32_t)v[0], hi = (uint32_t)v[0];
    for (int64_t i = 1; i < n; i++) {
        lo = (uint32_t)v[i] < lo ? (uint32_t)v[i] : lo;
        hi = (uint32_t)v[i] > hi ? (uint32_t)v[i] : hi;
    }
    int32_t counts[2048];
    while (lo != hi) {
        const uint32_t span = hi - lo;
        const int width = 32 - __builtin_clz(span), shift = width > 11 ? width - 11 : 0;
        const int64_t bins = (int64_t)(span >> shift) + 1;
        memset(counts, 0, (size_t)bins * sizeof counts[0]);
        for (int64_t i = 0; i < n; i++) counts[((uint32_t)v[i] - lo) >> shift] += 1;
        int64_t bin, rank;
        locate32(counts, bins, k, &bin, &rank);
        int64_t kept = 0;
        for (int64_t i = 0; i < n; i++)
            if ((int64_t)(((uint32_t)v[i] - lo) >> shift) == bin) v[kept++] = v[i];
        n = kept, k = rank;
        const uint64_t first = (uint64_t)lo + ((uint64_t)bin << shift);
        const uint64_t last = first + ((uint64_t)1 << shift) - 1;
        lo = (uint32_t)first;
        hi = last < hi ? (uint32_t)last : hi;
        if (shift == 0) break;
    }
    return (int32_t)lo;
}

/* A rank's state in tau_kth_impl: ops.KthLargestAbs's modes, with its bucket, rank, width. */
enum { K_HIGH, K_LOW, K_BAND, K_COLLECT, K_DONE };
typedef struct {
    int mode;
    int64_t expert, k, bucket, rank, width, bits;
} Rank;

/* ops.KthLargestAbs._enter_band and _choose_band: from the sampled top-16-bit counts (ms
 * values standing for count), the band of buckets holding the k-th largest with overwhelming
 * probability; collected if the sample says it holds at most collect_max / 2 values, else
 * histogrammed if at most widest buckets wide, else two exact passes. */
static void enter_band(Rank *r, const int32_t *counts, int64_t ms, int64_t count,
                       int64_t collect_max, int64_t widest)
{
    const double q = (double)r->k / (double)count, expected = q * (double)ms;
    const double margin = 4 * sqrt((double)ms * q * (1 - q)) + 4;
    const double top = floor(expected - margin), bottom = ceil(expected + margin);
    r->mode = K_HIGH;
    if (!(top >= 1 && bottom <= (double)ms)) return;
    int64_t high, low, unused;
    locate32(counts, HIGH_BUCKETS, (int64_t)top, &high, &unused);
    locate32(counts, HIGH_BUCKETS, (int64_t)bottom, &low, &unused);
    int64_t inside = 0;
    for (int64_t b = low; b <= high; b++) inside += counts[b];
    r->bucket = low, r->width = (high - low + 1) << 16;
    if ((double)inside * ((double)count / (double)ms) <= (double)(collect_max / 2))
        r->mode = K_COLLECT;
    else if (high - low + 1 <= widest)
        r->mode = K_BAND;
}

/* The exact k-th largest |tau_e| = |e - b| (float32, from bfloat16 or float32 inputs, m entries
 * each at addresses: the base, then the experts) for each of n ranks (expert r[i].expert,
 * sorted; 1 <= k <= m), as bit patterns in r[i].bits: the passes of ops.KthLargestAbs (a
 * sampled first pass with stride > 1, shared by an expert's ranks and sampling each chunk of
 * `chunk` entries as ops._sample_runs does, a pass over the band of each rank, two exact
 * passes where the band missed), all in this call on this thread, with
 * tau_abs_histograms_impl counting (the base read once for every expert). Up to KTH_WHOLE entries
 * are collected whole instead. Returns how many passes it made over the inputs, or -1 on a
 * failed allocation. */
#define KTH_WHOLE 65536
static int tau_kth_impl(const int64_t *addresses, int64_t n_inputs, int bf16, int64_t m,
                        int64_t stride, int64_t run, int64_t chunk, int64_t collect_max,
                        int64_t widest, Rank *r, int64_t n)
{
    if (n == 0) return 0;
    if (m <= KTH_WHOLE) { /* every |tau|, then the k-th largest of a copy for each rank */
        int32_t *all = malloc((size_t)m * 2 * sizeof(int32_t));
        if (!all) return -1;
        const int64_t base = addresses[0];
        int64_t measured = -1;
        for (int64_t i = 0; i < n; i++) {
            if (r[i].expert != measured) {
                measured = r[i].expert;
                const int64_t expert = addresses[1 + measured];
                const uint16_t *b16 = (const uint16_t *)(intptr_t)base;
                const uint16_t *e16 = (const uint16_t *)(intptr_t)expert;
                const float *b32 = (const float *)(intptr_t)base, *e32 = (const float *)(intptr_t)expert;
                for (int64_t j = 0; j < m; j++)
                    all[j] = (int32_t)(bf16 ? direct_bits(b16, e16, j) : f2u(fabsf(e32[j] - b32[j])));
            }
            memcpy(all + m, all, (size_t)m * sizeof(int32_t));
            r[i].bits = select_kth_largest(all + m, m, r[i].k);
            r[i].mode = K_DONE;
        }
        free(all);
        return 1;
    }
    int64_t *index = malloc((size_t)n * 4 * sizeof(int64_t));
    uint8_t *flags = malloc((size_t)n * 2);
    int32_t *counts = NULL;
    if (!index || !flags) {
        free(index);
        free(flags);
        return -1;
    }
    int64_t *experts = index + n, *lows = index + 2 * n, *widths = index + 3 * n;
    uint8_t *top_bits = flags, *collect = flags + n;
    int status = 0, passes = 0;
    if (stride > 1) { /* the sampled first pass, shared by each expert's ranks */
        int64_t sampled = 0; /* experts, one pass each */
        for (int64_t i = 0; i < n; i++) {
            if (i > 0 && r[i].expert == r[i - 1].expert) continue;
            experts[sampled] = r[i].expert, top_bits[sampled] = 1, collect[sampled] = 0;
            lows[sampled] = 0, widths[sampled] = HIGH_BUCKETS;
            sampled++;
        }
        int64_t filled[1] = {0}, *starts = malloc((size_t)n_inputs * sizeof(int64_t));
        counts = calloc((size_t)(sampled * HIGH_BUCKETS), sizeof(int32_t));
        if (!counts || !starts) status = -1;
        for (int64_t first = 0; status == 0 && first < m; first += chunk) {
            for (int64_t i = 0; i < n_inputs; i++) starts[i] = addresses[i] + first * (bf16 ? 2 : 4);
            Passes q = {starts, bf16, m - first < chunk ? m - first : chunk, stride, run, sampled,
                        experts, top_bits, collect, lows, widths, counts, HIGH_BUCKETS, NULL, 0,
                        filled};
            status = tau_abs_histograms_impl(&q);
        }
        free(starts);
        passes++;
        for (int64_t i = 0, row = -1; status == 0 && i < n; i++) {
            if (i == 0 || r[i].expert != r[i - 1].expert) row++;
            const int32_t *sample = counts + row * HIGH_BUCKETS;
            int64_t ms = 0;
            for (int64_t b = 0; b < HIGH_BUCKETS; b++) ms += sample[b];
            enter_band(&r[i], sample, ms, m, collect_max, widest);
        }
        free(counts);
    } else {
        for (int64_t i = 0; i < n; i++) r[i].mode = K_HIGH;
    }
    while (status == 0) { /* one pass for every rank not done */
        int64_t active = 0, count_width = 2, any_collect = 0;
        for (int64_t i = 0; i < n; i++) {
            if (r[i].mode == K_DONE) continue;
            const int mode = r[i].mode;
            index[active] = i, experts[active] = r[i].expert;
            top_bits[active] = mode == K_HIGH, collect[active] = mode == K_COLLECT;
            lows[active] = mode == K_HIGH ? 0 : (r[i].bucket << 16) - 1;
            widths[active] = mode == K_HIGH ? HIGH_BUCKETS : mode == K_LOW ? LOW_BUCKETS : r[i].width;
            const int64_t need = mode == K_HIGH ? HIGH_BUCKETS : mode == K_COLLECT ? 2 : widths[active] + 2;
            count_width = need > count_width ? need : count_width;
            any_collect |= mode == K_COLLECT;
            active++;
        }
        if (active == 0) break;
        const int64_t capacity = any_collect ? collect_max : 0;
        int32_t *counts = calloc((size_t)(active * count_width), sizeof(int32_t));
        int32_t *values = capacity ? malloc((size_t)(active * capacity) * sizeof(int32_t)) : NULL;
        int64_t *filled = calloc((size_t)active, sizeof(int64_t));
        if (!counts || (capacity && !values) || !filled) {
            status = -1;
        } else {
            Passes q = {addresses, bf16, m, 1, run, active, experts, top_bits, collect, lows,
                        widths, counts, count_width, values, capacity, filled};
            status = tau_abs_histograms_impl(&q);
            passes++;
        }
        for (int64_t a = 0; status == 0 && a < active; a++) { /* KthLargestAbs.end_pass */
            Rank *x = &r[index[a]];
            const int32_t *row = counts + a * count_width;
            if (x->mode == K_HIGH) {
                locate32(row, HIGH_BUCKETS, x->k, &x->bucket, &x->rank);
                x->mode = K_LOW;
            } else if (x->mode == K_LOW) {
                int64_t low, unused;
                locate32(row + 1, LOW_BUCKETS, x->rank, &low, &unused);
                x->bits = (x->bucket << 16) | low, x->mode = K_DONE;
            } else if (x->mode == K_COLLECT) {
                const int64_t above = row[1], found = filled[a];
                if (found <= capacity && above < x->k && x->k <= above + found) {
                    x->bits = select_kth_largest(values + a * capacity, found, x->k - above);
                    x->mode = K_DONE;
                } else {
                    x->mode = K_HIGH; /* the sample misled, or too many values: exact passes */
                }
            } else { /* K_BAND */
                int64_t inside = 0;
                for (int64_t b = 1; b <= x->width; b++) inside += row[b];
                const int64_t above = row[x->width + 1];
                if (above < x->k && x->k <= above + inside) {
                    int64_t offset, unused;
                    locate32(row + 1, x->width, x->k - above, &offset, &unused);
                    x->bits = (x->bucket << 16) + offset, x->mode = K_DONE;
                } else {
                    x->mode = K_HIGH;
                }
            }
        }
        free(counts);
        free(values);
        free(filled);
        if (status < 0) break;
    }
    free(index);
    free(flags);
    return status < 0 ? -1 : passes;
}

/* No NaN or Inf among the m entries at addr (bfloat16 bits or float32). */
HOT static int all_finite_impl(int64_t addr, int bf16, int64_t m)
{
    uint32_t most = 0;
    if (bf16) {
        const uint16_t *src = (const uint16_t *)(intptr_t)addr;
        for (int64_t j = 0; j < m; j++) most = umax(most, (uint32_t)src[j] & 0x7FFFu);
        return most < 0x7F80u;
    }
    const uint32_t *src = (const uint32_t *)(intptr_t)addr;
    for (int64_t j = 0; j < m; j++) most = umax(most, src[j] & 0x7FFFFFFFu);
    return most < F32_INF_BITS;
}

/* ---- DARE's drop in half precision (kernels.dare_drop_) --------------------------------- */

/* float16 <-> float32: widening is exact; narrowing rounds to nearest even as torch does
 * (subnormals kept: the float adder rounds a value below 2^-14 to a multiple of 2^-24 when 0.5
 * is added to it; NaN becomes 0x7E00). */
INLINE float f16_to_f32(uint32_t h)
{
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    if (e == 31) return u2f(sign | F32_INF_BITS | (m << 13));
    return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

INLINE uint16_t f32_to_f16(float v)
{
    uint32_t u = f2u(v), sign = (u >> 16) & 0x8000u, o;
    u &= 0x7FFFFFFFu;
    if (u >= 0x47800000u) { /* 2^16 and beyond: Inf (NaN stays NaN) */
        o = u > F32_INF_BITS ? 0x7E00u : 0x7C00u;
    } else if (u < 0x38800000u) { /* below 2^-14: a subnormal or zero */
        o = f2u(u2f(u) + 0.5f) - 0x3F000000u;
    } else { /* rebias the exponent by (15 - 127) << 23 and round; a carry past 65504 gives Inf */
        u += 0xC8000FFFu + ((u >> 13) & 1u);
        o = u >> 13;
    }
    return (uint16_t)(o | sign);
}

INLINE float half_to_f32(uint32_t h, int fp16) { return fp16 ? f16_to_f32(h) : bf16_to_f32(h); }
INLINE uint16_t f32_to_half(float v, int fp16) { return fp16 ? f32_to_f16(v) : f32_to_bf16(v); }

/* ---- half-precision compute: the methods' steps in bfloat16 / float16 ------------------- */

/* x rounded to bfloat16 (nearest even) and widened back: what storing a torch op's float32
 * result into a bfloat16 tensor gives (NaN never reaches here: the loop declines it). */
INLINE float round_bf16(float x)
{
    uint32_t u = f2u(x);
    return u2f((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

/* x rounded to float16 and widened back (f32_to_f16 rounds as torch does). */
INLINE float round_fp16(float x) { return f16_to_f32(f32_to_f16(x)); }

INLINE float round_half(float x, const int fp16) { return fp16 ? round_fp16(x) : round_bf16(x); }

INLINE int not_finite(float x) { return (f2u(x) & 0x7FFFFFFFu) >= F32_INF_BITS; }

/* Entries [start, start + count) of a bfloat16 or float16 array, widened (exact). */
INLINE void load_half(int64_t addr, const int fp16, int64_t start, int64_t count,
                      float *RESTRICT dst)
{
    const uint16_t *src = (const uint16_t *)(intptr_t)addr + start;
    if (fp16)
        for (int64_t j = 0; j < count; j++) dst[j] = f16_to_f32(src[j]);
    else
        for (int64_t j = 0; j < count; j++) dst[j] = bf16_to_f32(src[j]);
}

/* src (values the dtype holds exactly) stored into entries [start, start + count). */
INLINE void store_half(int64_t addr, const int fp16, int64_t start, int64_t count,
                       const float *RESTRICT src)
{
    uint16_t *dst = (uint16_t *)(intptr_t)addr + start;
    if (fp16)
        for (int64_t j = 0; j < count; j++) dst[j] = f32_to_f16(src[j]);
    else
        for (int64_t j = 0; j < count; j++) dst[j] = (uint16_t)(f2u(src[j]) >> 16);
}

/* One step of steps.half_weighted_sum over a tile: acc (float32) = the product x * w rounded
 * to the dtype (w already in it), or acc + that product. */
INLINE void add_half_term(float *RESTRICT acc, const float *RESTRICT x, int64_t n, int first,
                          float w, const int fp16)
{
    if (first)
        for (int64_t j = 0; j < n; j++) acc[j] = round_half(x[j] * w, fp16);
    else
        for (int64_t j = 0; j < n; j++) acc[j] = acc[j] + round_half(x[j] * w, fp16);
}

/* keep_masks[k][q]: all ones where bit q of the keep byte k is set, else 0 (filled when the
 * module loads): a byte of DARE keep bits widened to the merge loops' eight 32-bit masks. */
static uint32_t keep_masks[256][8];

static void fill_keep_masks(void)
{
    for (int k = 0; k < 256; k++)
        for (int q = 0; q < 8; q++) keep_masks[k][q] = 0u - (((uint32_t)k >> q) & 1u);
}

/* half_chunk: m positions of a merge computed in bfloat16 (fp16 = 0) or float16, the inputs and
 * the output in that dtype: the torch operations of the methods' steps in that dtype, each
 * result rounded to it, in their order (steps.task_vectors, threshold_trim_ / band_trim_,
 * half_weighted_sum and add_scaled_ for the sums; elect_sign, disjoint_merge_ and elect_merge's
 * add_scaled_ for the elections). addresses: the base (if has_base) then n experts. params
 * hold the weights already rounded to the dtype; scalars S_LAMBDA (float32), S_TOTAL and
 * S_MIN_W (in the dtype). keeps: per expert, 0 or the address of its DARE keep bits (bit j of
 * the chunk: entry j; kernels.dare_keep_bits), applied to tau_i as steps.random_drop_ does after
 * the trim (the drop mode in column P_DARE_LIMIT: 1 keep only, 2 times P_DARE_DIVISOR, 3
 * divided by it; a dropped entry becomes its sign's zero). Returns FOUND_IN_INPUT where an
 * input, a vote, a sum or a divisor is NaN or Inf and FOUND_IN_RESULT where a result is: the
 * caller then runs the steps themselves (their NaN rules are torch's, not repeated here). */
INLINE int half_chunk_body(const int64_t *addresses, int n, int has_base,
                           const int fp16, int64_t m, int64_t out, const float *params,
                           const float *scalars, const int64_t *flags, const int64_t *keeps,
                           float *work)
{
    const int kind = (int)flags[F_KIND], band = flags[F_BAND] != 0;
    const int count_votes = flags[F_VOTE_COUNT] != 0, any_flip = flags[F_ANY_FLIP] != 0;
    const int divide_by = (int)flags[F_DIVIDE_BY], all_positive = flags[F_ALL_POSITIVE] != 0;
    const int sum_divide = flags[F_SUM_DIVIDE] != 0, scale = flags[F_SCALE] != 0;
    const float lam = scalars[S_LAMBDA], total = scalars[S_TOTAL], min_w = scalars[S_MIN_W];
    float *b = work, *acc = work + TILE, *sign = work + 2 * TILE, *divisor = work + 3 * TILE;
    float *tau = work + 4 * TILE;
    int found = 0;
    for (int64_t t0 = 0; t0 < m; t0 += TILE) {
        const int64_t cnt = m - t0 < TILE ? m - t0 : TILE;
        int bad = 0;
        if (has_base) {
            load_half(addresses[0], fp16, t0, cnt, b);
            for (int64_t j = 0; j < cnt; j++) bad |= not_finite(b[j]);
        }
        for (int i = 0; i < n; i++) {
            float *row = tau + (int64_t)i * TILE;
            const float *p = params + (int64_t)i * N_PARAMS;
            load_half(addresses[has_base + i], fp16, t0, cnt, row);
            for (int64_t j = 0; j < cnt; j++) bad |= not_finite(row[j]);
            if (has_base)
                for (int64_t j = 0; j < cnt; j++) row[j] = round_half(row[j] - b[j], fp16);
            const float low = p[P_LOW], high = p[P_HIGH];
            if (band) {
                for (int64_t j = 0; j < cnt; j++)
                    row[j] = hardshrink(row[j], low) - hardshrink(row[j], high);
            } else if (low >= 0.0f) {
                for (int64_t j = 0; j < cnt; j++) row[j] = hardshrink(row[j], low);
            }
            const int drop = (int)p[P_DARE_LIMIT];
            if (drop && keeps[i]) { /* t0 is a multiple of TILE: bit j of byte t0 / 8 on */
                const uint8_t *kb = (const uint8_t *)(intptr_t)keeps[i] + (t0 >> 3);
                uint32_t *kept = (uint32_t *)divisor; /* all ones where kept (scratch) */
                for (int64_t j0 = 0; j0 < cnt; j0 += 8) /* TILE is a multiple of 8 */
                    memcpy(kept + j0, keep_masks[kb[j0 >> 3]], sizeof keep_masks[0]);
                const float s = p[P_DARE_DIVISOR];
                if (drop == 2)
                    for (int64_t j = 0; j < cnt; j++) row[j] = round_half(row[j] * s, fp16);
                else if (drop == 3)
                    for (int64_t j = 0; j < cnt; j++) row[j] = round_half(row[j] / s, fp16);
                /* a dropped entry: its sign's zero (the rescale keeps the sign of a finite x) */
                for (int64_t j = 0; j < cnt; j++)
                    row[j] = u2f(f2u(row[j]) & (kept[j] | 0x80000000u));
            }
        }
        if (kind == KIND_SUM) {
            for (int i = 0; i < n; i++)
                add_half_term(acc, tau + (int64_t)i * TILE, cnt, i == 0,
                              params[(int64_t)i * N_PARAMS + P_SUM_W], fp16);
            for (int64_t j = 0; j < cnt; j++) {
                float v = round_half(acc[j], fp16);
                bad |= not_finite(v);
                if (sum_divide) v = round_half(v / total, fp16);
                if (has_base) {
                    if (scale) v = round_half(v * lam, fp16);
                    v = round_half(v + b[j], fp16);
                }
                acc[j] = v;
            }
        } else {
            /* elect_sign: the votes (sign(tau_i) with count_votes) weighted and summed, then
             * sign(v) + 0.5 and its sign: -1 where v < 0, else +1 */
            for (int i = 0; i < n; i++) {
                float *row = tau + (int64_t)i * TILE;
                const float w = params[(int64_t)i * N_PARAMS + P_VOTE_W];
                if (count_votes) {
                    for (int64_t j = 0; j < cnt; j++) divisor[j] = sign_of(row[j]);
                    add_half_term(acc, divisor, cnt, i == 0, w, fp16);
                } else {
                    add_half_term(acc, row, cnt, i == 0, w, fp16);
                }
            }
            for (int64_t j = 0; j < cnt; j++) {
                float v = round_half(acc[j], fp16);
                bad |= not_finite(v);
                sign[j] = v < 0.0f ? -1.0f : 1.0f;
            }
            /* disjoint_merge_: magnitudes relu(f_i * e * tau_i), their weighted sum times e */
            for (int i = 0; i < n; i++) {
                float *row = tau + (int64_t)i * TILE;
                const float *p = params + (int64_t)i * N_PARAMS;
                const float f = p[P_FLIP];
                for (int64_t j = 0; j < cnt; j++) {
                    float x = row[j] * sign[j];
                    if (any_flip) x = x * f;
                    row[j] = relu(x);
                }
                add_half_term(acc, row, cnt, i == 0, p[P_MERGE_W], fp16);
            }
            for (int64_t j = 0; j < cnt; j++) {
                float v = round_half(acc[j], fp16);
                bad |= not_finite(v);
                acc[j] = v * sign[j];
            }
            if (divide_by == DIVIDE_COUNT) {
                for (int64_t j = 0; j < cnt; j++) divisor[j] = 0.0f;
                for (int i = 0; i < n; i++) {
                    const float *row = tau + (int64_t)i * TILE;
                    for (int64_t j = 0; j < cnt; j++) divisor[j] += row[j] > 0.0f ? 1.0f : 0.0f;
                }
                for (int64_t j = 0; j < cnt; j++) {
                    float c = round_half(divisor[j], fp16);
                    acc[j] = round_half(acc[j] / (c < 1.0f ? 1.0f : c), fp16);
                }
            } else if (divide_by == DIVIDE_WEIGHT_SUM) {
                for (int i = 0; i < n; i++) {
                    const float *row = tau + (int64_t)i * TILE;
                    const float w = params[(int64_t)i * N_PARAMS + P_DIVISOR_W];
                    for (int64_t j = 0; j < cnt; j++) {
                        float term = round_half((row[j] > 0.0f ? 1.0f : 0.0f) * w, fp16);
                        divisor[j] = i == 0 ? term : divisor[j] + term;
                    }
                }
                for (int64_t j = 0; j < cnt; j++) {
                    float d = round_half(divisor[j], fp16);
                    bad |= not_finite(d);
                    if (all_positive)
                        d = d < min_w ? min_w : d;
                    else
                        d = d == 0.0f ? 1.0f : d;
                    acc[j] = round_half(acc[j] / d, fp16);
                }
            }
            for (int64_t j = 0; j < cnt; j++) {
                float v = acc[j];
                if (scale) v = round_half(v * lam, fp16);
                acc[j] = round_half(v + b[j], fp16);
            }
        }
        for (int64_t j = 0; j < cnt; j++) bad |= not_finite(acc[j]) << 1;
        found |= (bad & 1 ? FOUND_IN_INPUT : 0) | (bad & 2 ? FOUND_IN_RESULT : 0);
        if (found) return found; /* the caller runs the steps: no use finishing */
        store_half(out, fp16, t0, cnt, acc);
    }
    return found;
}

/* half_chunk_body with the dtype a compile-time constant: each loop then vectorises with one
 * rounding (bfloat16's bit operations, or float16's branches as selects). */
HOT static int half_chunk_bf16(const int64_t *addresses, int n, int has_base,
                               int64_t m, int64_t out, const float *params, const float *scalars,
                               const int64_t *flags, const int64_t *keeps, float *work)
{
    return half_chunk_body(addresses, n, has_base, 0, m, out, params, scalars, flags,
                           keeps, work);
}

HOT static int half_chunk_fp16(const int64_t *addresses, int n, int has_base,
                               int64_t m, int64_t out, const float *params, const float *scalars,
                               const int64_t *flags, const int64_t *keeps, float *work)
{
    return half_chunk_body(addresses, n, has_base, 1, m, out, params, scalars, flags,
                           keeps, work);
}

#define DROP_TILE_BITS 13 /* 2^13 entries of each block drawn per round of the streams (a longer
                           * run of each input in a row: fewer restarts of the CPU's prefetch) */
#define DROP_TILE (1 << DROP_TILE_BITS)
#define SPLIT_BITS 32   /* a bin's exact sum: low part + (high part << SPLIT_BITS) */

/* The integer significand of a half-precision magnitude `mag` (mb mantissa bits): its mantissa
 * with the leading 1 of a normal number (a subnormal has none); the value is that times the
 * unit of its exponent bin, 2^(max(e, 1) - bias - mb). */
INLINE uint32_t half_significand(uint32_t mag, const int mb)
{
    return (mag & ((1u << mb) - 1u)) | (mag >> mb ? 1u << mb : 0u);
}

/* Adds a tile's exact sum, `units` units of exponent bin e (2^(max(e, 1) - bias - mb)), to bin e
 * of a histogram whose high parts follow its `bins` low parts. */
INLINE void add_exact(int64_t *RESTRICT hist, int64_t bins, int e, uint64_t units)
{
    hist[e] += (int64_t)(units & ((1ull << SPLIT_BITS) - 1u));
    hist[bins + e] += (int64_t)(units >> SPLIT_BITS);
}

/* The first pass of steps.random_drop_ over entries [0, n) of k task vectors (half bits; entry 0
 * starts a DARE block of `block` entries), each of which it leaves as it is (taus[i]) or, given
 * the inputs (base and experts[i], the same dtype; 0: none), forms as torch.sub(expert, base)
 * does, the difference in float32 rounded to the half dtype, writing it to taus[i] where that is
 * not 0. For each vector i: DARE's keep bits (steps.dare_keep_block's stream and comparison:
 * entry kept iff the low 23 bits of its 32-bit draw < limits[i]; block b's stream is lane
 * b % DARE_LANES of vector i's states group b / DARE_LANES), one bit per entry into keeps[i]
 * (n / 8 bytes, rounded up), and steps.exact_sum_per_exponent of |tau| (all) and of the kept entries (kept), added
 * to row i: [2 * bins] each, bin e's sum being hist[e] + (hist[bins + e] << SPLIT_BITS) units of
 * 2^(max(e, 1) - bias - mb). NaN/Inf entries land in the top exponent's bin, which steps counts
 * as "not finite". The vectors take turns tile by tile, so the base's tile is read from memory
 * once (a: k scratch histograms).
 *
 * The sums are exact either way a tile takes: where its nonzero |tau| span at most
 * 62 - DROP_TILE_BITS - mb binades (exponents e_lo..e_hi), each entry is an integer number of
 * e_lo's units below 2^(e_hi - e_lo + mb + 1), so the sum of the tile's 2^DROP_TILE_BITS entries
 * stays below 2^63 of them: the tile's two totals are summed as integers (a loop that
 * vectorises) and go to bin e_lo whole; other tiles (and a NaN or an Inf) add each entry's
 * mantissa to its own exponent's bin. */
INLINE void dare_drop_counts_body(uint16_t *const *RESTRICT taus, const uint16_t *RESTRICT base,
                                  const uint16_t *const *RESTRICT experts, int k, int64_t n,
                                  const int fp16, const int64_t *RESTRICT limits,
                                  uint64_t *RESTRICT states, int64_t state_stride, int64_t block,
                                  uint8_t *const *RESTRICT keeps, int64_t *RESTRICT all,
                                  int64_t *RESTRICT kept,
                                  uint64_t *RESTRICT raw, int64_t (*RESTRICT a)[4][512])
{
    const int mb = fp16 ? 10 : 7, bins = fp16 ? 32 : 256;
    memset(a, 0, sizeof(*a) * (size_t)k);
    for (int i = 0; i < k; i++) memset(keeps[i], 0, (size_t)((n + 7) / 8));
    const int64_t blocks = (n + block - 1) / block, stride = DROP_TILE / 2;
    for (int64_t g = 0; g * DARE_LANES < blocks; g++) {
        for (int64_t off = 0; off < block && g * DARE_LANES * block + off < n; off += DROP_TILE) {
            for (int i = 0; i < k; i++) { /* a tile of the base, read again from the cache */
                sfc64_lanes(states + i * state_stride + g * 4 * DARE_LANES, raw, stride, stride);
                const uint32_t limit = (uint32_t)limits[i];
                int64_t *hist_all = all + i * 2 * bins, *hist_kept = kept + i * 2 * bins;
                for (int l = 0; l < DARE_LANES; l++) {
                    const int64_t b = g * DARE_LANES + l, start = b * block + off;
                    if (b >= blocks || start >= n) break;
                    const int64_t m = n - start < DROP_TILE ? n - start : DROP_TILE;
                    const uint32_t *r32 = (const uint32_t *)(raw + l * stride); /* low half first */
                    uint16_t local[DROP_TILE];
                    uint8_t kb[DROP_TILE + 8];
                    /* no tau: the difference is not kept */
                    uint16_t *t = taus[i] ? taus[i] + start : local;
                    uint8_t *bits = keeps[i] + start / 8; /* start is a multiple of 8 */
                    if (base) {
                        const uint16_t *x = experts[i] + start, *y = base + start;
                        for (int64_t j = 0; j < m; j++)
                            t[j] = f32_to_half(half_to_f32(x[j], fp16) - half_to_f32(y[j], fp16),
                                               fp16);
                    }
                    uint32_t most = 0, least = 0xFFFFu;
                    for (int64_t j = 0; j < m; j++) {
                        const uint32_t mag = t[j] & 0x7FFFu;
                        kb[j] = (r32[j] & 0x7FFFFFu) < limit;
                        most = mag > most ? mag : most;
                        least = (mag ? mag : 0xFFFFu) < least ? (mag ? mag : 0xFFFFu) : least;
                    }
                    if (m > 0 && m < DROP_TILE) memset(kb + m, 0, 8); /* the tail's last byte */
                    for (int64_t j0 = 0; j0 < m; j0 += 8) { /* eight 0/1 bytes into one of bits */
                        uint64_t eight;
                        memcpy(&eight, kb + j0, 8);
                        bits[j0 >> 3] = (uint8_t)((eight * 0x0102040810204080ull) >> 56);
                    }
                    const int top = (int)(most >> mb);
                    int bottom = least == 0xFFFFu ? top : (int)(least >> mb);
                    bottom = bottom < 1 ? 1 : bottom;
                    if (most == 0) continue; /* all zeros: nothing to add */
                    if (top < bins - 1 && top - bottom <= 62 - DROP_TILE_BITS - mb) {
                        uint64_t s_all = 0, s_kept = 0;
                        for (int64_t j = 0; j < m; j++) {
                            const uint32_t mag = t[j] & 0x7FFFu, e = mag >> mb;
                            const uint64_t mant = half_significand(mag, mb);
                            const uint64_t units = mant << ((e ? e : 1u) - (uint32_t)bottom);
                            s_all += units;
                            s_kept += kb[j] ? units : 0u;
                        }
                        add_exact(hist_all, bins, bottom, s_all);
                        add_exact(hist_kept, bins, bottom, s_kept);
                        continue;
                    }
                    for (int64_t j = 0; j < m; j++) {
                        const uint32_t mag = t[j] & 0x7FFFu;
                        a[i][j & 3][2 * (mag >> mb) + kb[j]] += half_significand(mag, mb);
                    }
                }
            }
        }
    }
    for (int i = 0; i < k; i++)
        for (int c = 0; c < 4; c++)
            for (int e = 0; e < bins; e++) {
                all[i * 2 * bins + e] += a[i][c][2 * e] + a[i][c][2 * e + 1];
                kept[i * 2 * bins + e] += a[i][c][2 * e + 1];
            }
}

/* dare_drop_counts_body with the dtype a compile-time constant (the difference's loop then
 * vectorises with one rounding). */
HOT static void dare_drop_counts_impl(uint16_t *const *RESTRICT taus,
                                      const uint16_t *RESTRICT base,
                                      const uint16_t *const *RESTRICT experts, int k, int64_t n,
                                      int fp16, const int64_t *RESTRICT limits,
                                      uint64_t *RESTRICT states, int64_t state_stride,
                                      int64_t block, uint8_t *const *RESTRICT keeps,
                                      int64_t *RESTRICT all,
                                      int64_t *RESTRICT kept, uint64_t *RESTRICT raw,
                                      int64_t (*RESTRICT a)[4][512])
{
    if (fp16)
        dare_drop_counts_body(taus, base, experts, k, n, 1, limits, states, state_stride, block,
                              keeps, all, kept, raw, a);
    else
        dare_drop_counts_body(taus, base, experts, k, n, 0, limits, states, state_stride, block,
                              keeps, all, kept, raw, a);
}

/* The writing pass of steps.random_drop_ on finite half bits, operation for operation: tau *
 * keep (a dropped entry becomes its sign's zero), then nothing (mode 0), * s (mode 1: the L1
 * rescale's before / after) or / s (mode 2: the keep rate), in float32 and rounded, as torch's
 * half-precision mul_ and div_ by a scalar; s > 0. */
INLINE void dare_drop_apply_body(uint16_t *RESTRICT tau, int64_t n, const int fp16,
                                 const uint8_t *RESTRICT keep, const int mode, float s)
{
    for (int64_t j = 0; j < n; j++) {
        const uint32_t h = tau[j];
        const int kb = (keep[j >> 3] >> (j & 7)) & 1;
        uint16_t v = (uint16_t)h;
        if (mode == 1)
            v = f32_to_half(half_to_f32(h, fp16) * s, fp16);
        else if (mode == 2)
            v = f32_to_half(half_to_f32(h, fp16) / s, fp16);
        tau[j] = kb ? v : (uint16_t)(h & 0x8000u);
    }
}

/* dare_drop_apply_body with the dtype and the mode compile-time constants. */
HOT static void dare_drop_apply_impl(uint16_t *RESTRICT tau, int64_t n, int fp16,
                                     const uint8_t *RESTRICT keep, int mode, float s)
{
#define APPLY(h, md)                                                                            \
    if (fp16 == h && mode == md) {                                                              \
        dare_drop_apply_body(tau, n, h, keep, md, s);                                           \
        return;                                                                                 \
    }
    APPLY(0, 0) APPLY(0, 1) APPLY(0, 2) APPLY(1, 0) APPLY(1, 1) APPLY(1, 2)
#undef APPLY
}

/* ---- Python bindings -------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

/* The C-contiguous buffer of obj (a NumPy array) with items of itemsize bytes, or NULL with an
 * error set. */
static void *buffer_of(PyObject *obj, Buf *b, Py_ssize_t itemsize, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) return NULL;
    b->held = 1;
    if (b->view.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes expected, got %zd", what, itemsize,
                     b->view.itemsize);
        return NULL;
    }
    return b->view.buf;
}

static Py_ssize_t items(const Buf *b) { return b->view.len / b->view.itemsize; }

static Py_ssize_t dim(const Buf *b, int axis)
{
    return axis < b->view.ndim ? b->view.shape[axis] : 1;
}

static void release(Buf *bufs, int n)
{
    for (int i = 0; i < n; i++)
        if (bufs[i].held) PyBuffer_Release(&bufs[i].view);
}

static PyObject *py_merge_chunk(PyObject *self, PyObject *args)
{
    PyObject *o_addr, *o_params, *o_scalars, *o_flags, *o_states, *o_lanes;
    int bf16_in, bf16_out;
    long long m, out, block;
    (void)self;
    if (!PyArg_ParseTuple(args, "OpLLpOOOOOL", &o_addr, &bf16_in, &m, &out, &bf16_out, &o_params,
                          &o_scalars, &o_flags, &o_states, &o_lanes, &block))
        return NULL;
    Buf bufs[6];
    memset(bufs, 0, sizeof bufs);
    PyObject *result = NULL;
    const int64_t *addresses, *flags, *lanes;
    const float *params, *scalars;
    const uint64_t *states;
    if (!(addresses = buffer_of(o_addr, &bufs[0], 8, 0, "addresses"))) goto done;
    if (!(params = buffer_of(o_params, &bufs[1], 4, 0, "params"))) goto done;
    if (!(scalars = buffer_of(o_scalars, &bufs[2], 4, 0, "scalars"))) goto done;
    if (!(flags = buffer_of(o_flags, &bufs[3], 8, 0, "flags"))) goto done;
    if (!(states = buffer_of(o_states, &bufs[4], 8, 0, "states"))) goto done;
    if (!(lanes = buffer_of(o_lanes, &bufs[5], 8, 0, "lanes"))) goto done;
    int n = (int)items(&bufs[0]) - 1;
    if (n < 1 || items(&bufs[1]) != (Py_ssize_t)n * N_PARAMS || items(&bufs[2]) < N_SCALARS ||
        items(&bufs[3]) < N_FLAGS) {
        PyErr_SetString(PyExc_ValueError, "merge_chunk: inconsistent argument sizes");
        goto done;
    }
    int64_t n_blocks = dim(&bufs[5], 0), n_groups = dim(&bufs[4], 0);
    if (items(&bufs[5]) == 0) n_blocks = 0;
    if (items(&bufs[4]) == 0) n_groups = 0;
    if (n_blocks > 0 && (items(&bufs[5]) != n_blocks * n ||
                         items(&bufs[4]) != n_groups * 4 * DARE_LANES || block <= 0)) {
        PyErr_SetString(PyExc_ValueError, "merge_chunk: inconsistent DARE streams");
        goto done;
    }
    for (int64_t i = 0; i < n_blocks * n; i++) {
        if (lanes[i] >= n_groups * DARE_LANES) {
            PyErr_SetString(PyExc_ValueError, "merge_chunk: a lane without a stream");
            goto done;
        }
    }
    Merge g = {addresses, n, bf16_in, bf16_out, (int64_t)out, params, scalars, flags};
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = merge_chunk_impl(&g, m, states, n_groups, lanes, n_blocks, block);
    Py_END_ALLOW_THREADS
    if (found < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyLong_FromLong(found);
done:
    release(bufs, 6);
    return result;
}

static PyObject *py_sum_chunk(PyObject *self, PyObject *args)
{
    PyObject *o_addr, *o_weights, *o_scalars, *o_flags;
    int has_base, bf16_in, bf16_out;
    long long m, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OppLLpOOO", &o_addr, &has_base, &bf16_in, &m, &out, &bf16_out,
                          &o_weights, &o_scalars, &o_flags))
        return NULL;
    Buf bufs[4];
    memset(bufs, 0, sizeof bufs);
    PyObject *result = NULL;
    const int64_t *addresses, *flags;
    const float *weights, *scalars;
    if (!(addresses = buffer_of(o_addr, &bufs[0], 8, 0, "addresses"))) goto done;
    if (!(weights = buffer_of(o_weights, &bufs[1], 4, 0, "weights"))) goto done;
    if (!(scalars = buffer_of(o_scalars, &bufs[2], 4, 0, "scalars"))) goto done;
    if (!(flags = buffer_of(o_flags, &bufs[3], 8, 0, "flags"))) goto done;
    int n = (int)items(&bufs[0]) - (has_base ? 1 : 0);
    if (n < 1 || items(&bufs[1]) < n || items(&bufs[2]) < N_SCALARS || items(&bufs[3]) < N_FLAGS) {
        PyErr_SetString(PyExc_ValueError, "sum_chunk: inconsistent argument sizes");
        goto done;
    }
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = sum_chunk_impl(addresses, n, has_base, bf16_in, m, (int64_t)out, bf16_out, weights,
                           scalars, flags);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(found);
done:
    release(bufs, 4);
    return result;
}

static PyObject *py_half_chunk(PyObject *self, PyObject *args)
{
    PyObject *o_addr, *o_params, *o_scalars, *o_flags, *o_keeps;
    int has_base, fp16;
    long long m, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OppLLOOOO", &o_addr, &has_base, &fp16, &m, &out,
                          &o_params, &o_scalars, &o_flags, &o_keeps))
        return NULL;
    Buf bufs[5];
    memset(bufs, 0, sizeof bufs);
    PyObject *result = NULL;
    const int64_t *addresses, *flags;
    const float *params, *scalars;
    if (!(addresses = buffer_of(o_addr, &bufs[0], 8, 0, "addresses"))) goto done;
    if (!(params = buffer_of(o_params, &bufs[1], 4, 0, "params"))) goto done;
    if (!(scalars = buffer_of(o_scalars, &bufs[2], 4, 0, "scalars"))) goto done;
    if (!(flags = buffer_of(o_flags, &bufs[3], 8, 0, "flags"))) goto done;
    const int64_t *keeps;
    if (!(keeps = buffer_of(o_keeps, &bufs[4], 8, 0, "keeps"))) goto done;
    int n = (int)items(&bufs[0]) - (has_base ? 1 : 0);
    if (n < 1 || items(&bufs[1]) != (Py_ssize_t)n * N_PARAMS || items(&bufs[2]) < N_SCALARS ||
        items(&bufs[3]) < N_FLAGS || items(&bufs[4]) != n ||
        (!has_base && flags[F_KIND] != KIND_SUM)) {
        PyErr_SetString(PyExc_ValueError, "half_chunk: inconsistent arguments");
        goto done;
    }
    float *work = malloc(sizeof(float) * TILE * (size_t)(n + 4));
    if (!work) {
        PyErr_NoMemory();
        goto done;
    }
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = (fp16 ? half_chunk_fp16 : half_chunk_bf16)(addresses, n, has_base,
                                                       (int64_t)m, (int64_t)out, params, scalars,
                                                       flags, keeps, work);
    Py_END_ALLOW_THREADS
    free(work);
    result = PyLong_FromLong(found);
done:
    release(bufs, 5);
    return result;
}

static PyObject *py_tau_abs_histograms(PyObject *self, PyObject *args)
{
    PyObject *o_addr, *o_experts, *o_top, *o_lows, *o_widths, *o_collect, *o_counts, *o_values,
        *o_filled;
    int bf16;
    long long m, step, run;
    (void)self;
    if (!PyArg_ParseTuple(args, "OpLLLOOOOOOOO", &o_addr, &bf16, &m, &step, &run, &o_experts,
                          &o_top, &o_lows, &o_widths, &o_collect, &o_counts, &o_values, &o_filled))
        return NULL;
    Buf bufs[9];
    memset(bufs, 0, sizeof bufs);
    PyObject *result = NULL;
    Passes q;
    q.addresses = buffer_of(o_addr, &bufs[0], 8, 0, "addresses");
    if (!q.addresses) goto done;
    q.experts = buffer_of(o_experts, &bufs[1], 8, 0, "experts");
    if (!q.experts) goto done;
    q.top_bits = buffer_of(o_top, &bufs[2], 1, 0, "top_bits");
    if (!q.top_bits) goto done;
    q.lows = buffer_of(o_lows, &bufs[3], 8, 0, "lows");
    if (!q.lows) goto done;
    q.widths = buffer_of(o_widths, &bufs[4], 8, 0, "widths");
    if (!q.widths) goto done;
    q.collect = buffer_of(o_collect, &bufs[5], 1, 0, "collect");
    if (!q.collect) goto done;
    q.counts = buffer_of(o_counts, &bufs[6], 4, 1, "counts");
    if (!q.counts) goto done;
    q.values = buffer_of(o_values, &bufs[7], 4, 1, "values");
    if (!q.values) goto done;
    q.filled = buffer_of(o_filled, &bufs[8], 8, 1, "filled");
    if (!q.filled) goto done;
    q.n_passes = items(&bufs[1]);
    q.count_width = dim(&bufs[6], 1);
    q.capacity = dim(&bufs[7], 1);
    if (items(&bufs[7]) == 0) q.capacity = 0;
    q.bf16 = bf16, q.m = m, q.step = step, q.run = run;
    int n_inputs = (int)items(&bufs[0]);
    int ok = step >= 1 && run >= 1 && GROUPED % run == 0 && items(&bufs[2]) == q.n_passes &&
             items(&bufs[3]) == q.n_passes && items(&bufs[4]) == q.n_passes &&
             items(&bufs[5]) == q.n_passes && items(&bufs[8]) == q.n_passes &&
             dim(&bufs[6], 0) >= q.n_passes;
    for (int64_t k = 0; ok && k < q.n_passes; k++) {
        ok = q.experts[k] >= 0 && q.experts[k] + 1 < n_inputs &&
             (q.top_bits[k] ? q.count_width >= (1 << 15)
                            : (q.collect[k] ? q.count_width >= 2 : q.count_width >= q.widths[k] + 2));
        if (ok && q.collect[k] && !q.top_bits[k]) ok = dim(&bufs[7], 0) >= q.n_passes || q.capacity == 0;
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "tau_abs_histograms: inconsistent argument sizes");
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = tau_abs_histograms_impl(&q);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release(bufs, 9);
    return result;
}

/* tau_kth(addresses, bf16, m, stride, run, chunk, collect_max, widest, experts, ranks, out)
 * -> passes:
 * tau_kth_impl for the int64 ranks (1 <= k <= m each) of the int64 experts (sorted) into out
 * (int64 bit patterns, as many). */
static PyObject *py_tau_kth(PyObject *self, PyObject *args)
{
    long long m, stride, run, chunk, collect_max, widest;
    int bf16;
    PyObject *o_addr, *o_experts, *o_ranks, *o_out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OpLLLLLLOOO", &o_addr, &bf16, &m, &stride, &run, &chunk,
                          &collect_max, &widest, &o_experts, &o_ranks, &o_out))
        return NULL;
    Buf bufs[4];
    memset(bufs, 0, sizeof bufs);
    PyObject *result = NULL;
    Rank *r = NULL;
    const int64_t *addresses = buffer_of(o_addr, &bufs[0], 8, 0, "addresses");
    if (!addresses) goto done;
    const int64_t *experts = buffer_of(o_experts, &bufs[1], 8, 0, "experts");
    if (!experts) goto done;
    const int64_t *ks = buffer_of(o_ranks, &bufs[2], 8, 0, "ranks");
    if (!ks) goto done;
    int64_t *out = buffer_of(o_out, &bufs[3], 8, 1, "out");
    if (!out) goto done;
    const int64_t n = items(&bufs[2]), n_experts = items(&bufs[0]) - 1;
    int ok = n == items(&bufs[1]) && n == items(&bufs[3]) && m >= 1 && m < ((int64_t)1 << 31) &&
             stride >= 1 && run >= 1 && GROUPED % run == 0 && chunk >= 1 &&
             collect_max >= 2 && widest >= 0;
    for (int64_t i = 0; ok && i < n; i++)
        ok = ks[i] >= 1 && ks[i] <= m && experts[i] >= 0 && experts[i] < n_experts &&
             (i == 0 || experts[i] >= experts[i - 1]);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "tau_kth: inconsistent arguments");
        goto done;
    }
    r = calloc((size_t)(n ? n : 1), sizeof(Rank));
    if (!r) {
        PyErr_NoMemory();
        goto done;
    }
    for (int64_t i = 0; i < n; i++) r[i].k = ks[i], r[i].expert = experts[i];
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = tau_kth_impl(addresses, n_experts + 1, bf16, m, stride, run, chunk, collect_max,
                          widest, r, n);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    for (int64_t i = 0; i < n; i++) out[i] = r[i].bits;
    result = PyLong_FromLong(status);
done:
    free(r);
    release(bufs, 4);
    return result;
}

/* Whether the CPU has AVX2 (and FMA, where fma) and this build has loops that use them. */
static int cpu_has_avx2(int fma)
{
#ifdef HAVE_AVX2_LOOPS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && (!fma || __builtin_cpu_supports("fma"));
#else
    (void)fma;
    return 0;
#endif
}

/* switch(on) -> whether it was on: sets *flag to on where the CPU allows it. */
static PyObject *set_switch(PyObject *args, int *flag, int allowed)
{
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    int before = *flag;
    *flag = on && allowed;
    return PyBool_FromLong(before);
}

/* vector_loops(on) -> whether two_avx2's loops ran before (see vector_loops). */
static PyObject *py_vector_loops(PyObject *self, PyObject *args)
{
    (void)self;
    return set_switch(args, &vector_loops, cpu_has_avx2(1));
}

/* band_masks(on) -> whether the AVX2 bit masks ran before (see band_masks). */
static PyObject *py_band_masks(PyObject *self, PyObject *args)
{
    (void)self;
    return set_switch(args, &band_masks, cpu_has_avx2(0));
}

static PyObject *py_kth_largest_bits(PyObject *self, PyObject *args)
{
    PyObject *o_values;
    long long k;
    (void)self;
    if (!PyArg_ParseTuple(args, "OL", &o_values, &k)) return NULL;
    Buf buf;
    memset(&buf, 0, sizeof buf);
    const int32_t *values = buffer_of(o_values, &buf, 4, 0, "values");
    if (!values) {
        release(&buf, 1);
        return NULL;
    }
    int64_t n = items(&buf);
    if (k < 1 || k > n) {
        release(&buf, 1);
        return PyErr_Format(PyExc_ValueError, "kth_largest_bits: k=%lld outside 1..%lld", k,
                            (long long)n);
    }
    int64_t found;
    Py_BEGIN_ALLOW_THREADS
    found = kth_largest_bits_impl(values, n, k);
    Py_END_ALLOW_THREADS
    release(&buf, 1);
    if (found < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong(found);
}

static PyObject *py_locate_from_top(PyObject *self, PyObject *args)
{
    PyObject *o_counts;
    long long k;
    (void)self;
    if (!PyArg_ParseTuple(args, "OL", &o_counts, &k)) return NULL;
    Buf buf;
    memset(&buf, 0, sizeof buf);
    const int64_t *counts = buffer_of(o_counts, &buf, 8, 0, "counts");
    if (!counts) {
        release(&buf, 1);
        return NULL;
    }
    int64_t bin, rank;
    locate_from_top_impl(counts, items(&buf), k, &bin, &rank);
    release(&buf, 1);
    return Py_BuildValue("LL", (long long)bin, (long long)rank);
}

static PyObject *py_all_finite(PyObject *self, PyObject *args)
{
    long long addr, m;
    int bf16, finite;
    (void)self;
    if (!PyArg_ParseTuple(args, "LpL", &addr, &bf16, &m)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    finite = all_finite_impl((int64_t)addr, bf16, m);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(finite);
}

static PyObject *py_sfc64_fill(PyObject *self, PyObject *args)
{
    PyObject *o_states, *o_rows;
    long long steps;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOL", &o_states, &o_rows, &steps)) return NULL;
    Buf bufs[2];
    memset(bufs, 0, sizeof bufs);
    PyObject *result = NULL;
    uint64_t *states, *rows;
    if (!(states = buffer_of(o_states, &bufs[0], 8, 1, "states"))) goto done;
    if (!(rows = buffer_of(o_rows, &bufs[1], 8, 1, "rows"))) goto done;
    int64_t groups = dim(&bufs[0], 0), stride = dim(&bufs[1], 1);
    if (items(&bufs[0]) != groups * 4 * DARE_LANES || dim(&bufs[1], 0) < groups * DARE_LANES ||
        steps > stride || steps < 0) {
        PyErr_SetString(PyExc_ValueError, "sfc64_fill: inconsistent argument sizes");
        goto done;
    }
    for (int64_t gi = 0; gi < groups; gi++)
        sfc64_lanes(states + gi * 4 * DARE_LANES, rows + gi * DARE_LANES * stride, steps, stride);
    result = Py_NewRef(Py_None);
done:
    release(bufs, 2);
    return result;
}

static PyObject *py_dare_drop_counts(PyObject *self, PyObject *args)
{
    PyObject *o_taus, *o_experts, *o_limits, *o_states, *o_keep, *o_all, *o_kept;
    long long base, n, block;
    int fp16;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLOLpOOLOOO", &o_taus, &base, &o_experts, &n, &fp16, &o_limits,
                          &o_states, &block, &o_keep, &o_all, &o_kept))
        return NULL;
    Buf bufs[7];
    memset(bufs, 0, sizeof bufs);
    PyObject *result = NULL;
    int64_t *taus, *experts, *limits, *keeps, *all, *kept;
    uint64_t *states;
    if (!(taus = buffer_of(o_taus, &bufs[0], 8, 0, "taus"))) goto done;
    if (!(experts = buffer_of(o_experts, &bufs[1], 8, 0, "experts"))) goto done;
    if (!(limits = buffer_of(o_limits, &bufs[2], 8, 0, "limits"))) goto done;
    if (!(states = buffer_of(o_states, &bufs[3], 8, 1, "states"))) goto done;
    if (!(keeps = buffer_of(o_keep, &bufs[4], 8, 0, "keeps"))) goto done;
    if (!(all = buffer_of(o_all, &bufs[5], 8, 1, "all"))) goto done;
    if (!(kept = buffer_of(o_kept, &bufs[6], 8, 1, "kept"))) goto done;
    const int64_t k = items(&bufs[0]), bins = fp16 ? 32 : 256;
    const int64_t blocks = block > 0 ? (n + block - 1) / block : 0;
    const int64_t groups = (blocks + DARE_LANES - 1) / DARE_LANES;
    int bad = n < 0 || block <= 0 || block % DROP_TILE || k < 1 || items(&bufs[1]) != k ||
              items(&bufs[2]) != k || items(&bufs[4]) != k ||
              items(&bufs[5]) < k * 2 * bins || items(&bufs[6]) < k * 2 * bins ||
              dim(&bufs[3], 0) != k || items(&bufs[3]) < k * groups * 4 * DARE_LANES;
    for (int64_t i = 0; i < k && !bad; i++)
        bad = (base == 0) != (experts[i] == 0) || (taus[i] == 0 && base == 0) ||
              limits[i] < 0 || limits[i] > (1ll << 23) || keeps[i] == 0;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "dare_drop_counts: inconsistent argument sizes");
        goto done;
    }
    uint64_t *raw = malloc(sizeof(uint64_t) * DARE_LANES * (DROP_TILE / 2));
    int64_t(*a)[4][512] = malloc(sizeof(*a) * (size_t)k);
    if (!raw || !a) {
        free(raw), free(a);
        PyErr_NoMemory();
        goto done;
    }
    const int64_t state_stride = items(&bufs[3]) / k;
    Py_BEGIN_ALLOW_THREADS
    dare_drop_counts_impl((uint16_t *const *)taus, (const uint16_t *)(intptr_t)base,
                          (const uint16_t *const *)experts, (int)k, n, fp16, limits, states,
                          state_stride, block, (uint8_t *const *)keeps, all, kept, raw, a);
    Py_END_ALLOW_THREADS
    free(raw), free(a);
    result = Py_NewRef(Py_None);
done:
    release(bufs, 7);
    return result;
}

static PyObject *py_dare_drop_apply(PyObject *self, PyObject *args)
{
    PyObject *o_keep;
    long long address, n;
    int fp16, mode;
    double s;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLpOid", &address, &n, &fp16, &o_keep, &mode, &s)) return NULL;
    Buf bufs[1];
    memset(bufs, 0, sizeof bufs);
    PyObject *result = NULL;
    const uint8_t *keep;
    if (!(keep = buffer_of(o_keep, &bufs[0], 1, 0, "keep"))) goto done;
    if (n < 0 || items(&bufs[0]) < (n + 7) / 8 || mode < 0 || mode > 2) {
        PyErr_SetString(PyExc_ValueError, "dare_drop_apply: inconsistent arguments");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    dare_drop_apply_impl((uint16_t *)(intptr_t)address, n, fp16, keep, mode, (float)s);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(bufs, 1);
    return result;
}

#ifdef HAVE_MAPPING
/* ---- memory maps that do not hold the GIL ----------------------------------------------- */

/* A read-only shared map of part of a file, its pages mapped at once (MAP_POPULATE, Linux; not
 * with populate=False, for a pass that reads a few of its pages: each is then mapped when it is
 * first read), with the buffer protocol (torch.frombuffer takes it). Python 3.11's mmap module holds the GIL while
 * it maps and unmaps; mapping a tensor's inputs takes milliseconds, and every other thread of
 * the merge (the other workers, the writer) would wait for it: this maps and unmaps without. */
typedef struct {
    PyObject_HEAD
    void *data;
    size_t size;
} Mapping;

static PyObject *mapping_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"fd", "offset", "length", "populate", NULL};
    int fd, populate = 1;
    long long offset, length;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iLL|p", keywords, &fd, &offset, &length,
                                     &populate))
        return NULL;
    if (offset < 0 || length <= 0)
        return PyErr_Format(PyExc_ValueError, "Mapping: offset %lld, length %lld", offset, length);
    int flags = MAP_SHARED;
#ifdef MAP_POPULATE
    if (populate) flags |= MAP_POPULATE;
#endif
    void *data;
    Py_BEGIN_ALLOW_THREADS
    data = mmap(NULL, (size_t)length, PROT_READ, flags, fd, (off_t)offset);
    Py_END_ALLOW_THREADS
    if (data == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
    Mapping *self = (Mapping *)type->tp_alloc(type, 0);
    if (!self) {
        munmap(data, (size_t)length);
        return NULL;
    }
    self->data = data;
    self->size = (size_t)length;
    return (PyObject *)self;
}

static void mapping_dealloc(Mapping *self)
{
    void *data = self->data;
    size_t size = self->size;
    if (data) {
        Py_BEGIN_ALLOW_THREADS
        munmap(data, size);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int mapping_getbuffer(Mapping *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, (Py_ssize_t)self->size, 1, flags);
}

static PyObject *mapping_address(Mapping *self, void *closure)
{
    (void)closure;
    return PyLong_FromVoidPtr(self->data);
}

static PyBufferProcs mapping_buffer = {(getbufferproc)mapping_getbuffer, NULL};
static PyGetSetDef mapping_getset[] = {
    {"address", (getter)mapping_address, NULL, "where the map starts", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mergelab.merge._loops.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_dealloc = (destructor)mapping_dealloc,
    .tp_as_buffer = &mapping_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mapping(fd, offset, length): a read-only shared memory map of "
              "length bytes of the file from offset (a multiple of the page size); mapped and "
              "unmapped without holding the GIL.",
    .tp_getset = mapping_getset,
    .tp_new = mapping_new,
};
#endif

static PyMethodDef methods[] = {
    {"merge_chunk", py_merge_chunk, METH_VARARGS,
     "merge_chunk(addresses, bf16_in, m, out_address, bf16_out, params, scalars, flags, states, "
     "lanes, block) -> NaN/Inf flags"},
    {"sum_chunk", py_sum_chunk, METH_VARARGS,
     "sum_chunk(addresses, has_base, bf16_in, m, out_address, bf16_out, weights, scalars, "
     "flags) -> NaN/Inf flags"},
    {"half_chunk", py_half_chunk, METH_VARARGS,
     "half_chunk(addresses, has_base, fp16, m, out_address, params, scalars, flags, "
     "keeps) "
     "-> NaN/Inf flags"},
    {"tau_abs_histograms", py_tau_abs_histograms, METH_VARARGS,
     "tau_abs_histograms(addresses, bf16, m, step, run, experts, top_bits, lows, widths, "
     "collect, counts, values, filled)"},
    {"tau_kth", py_tau_kth, METH_VARARGS,
     "tau_kth(addresses, bf16, m, stride, run, chunk, collect_max, widest, experts, ranks, out)"
     " -> passes"},
    {"band_masks", py_band_masks, METH_VARARGS,
     "band_masks(on) -> whether the AVX2 band masks were on"},
    {"vector_loops", py_vector_loops, METH_VARARGS,
     "vector_loops(on) -> whether the AVX2 two-expert loops were on"},
    {"kth_largest_bits", py_kth_largest_bits, METH_VARARGS, "kth_largest_bits(values, k) -> int"},
    {"locate_from_top", py_locate_from_top, METH_VARARGS,
     "locate_from_top(counts, k) -> (bin, rank)"},
    {"all_finite", py_all_finite, METH_VARARGS, "all_finite(address, bf16, m) -> bool"},
    {"sfc64_fill", py_sfc64_fill, METH_VARARGS, "sfc64_fill(states, rows, steps)"},
    {"dare_drop_counts", py_dare_drop_counts, METH_VARARGS,
     "dare_drop_counts(taus, base, experts, n, fp16, limits, states, block, keeps, all, "
     "kept): addresses in taus, experts and keeps"},
    {"dare_drop_apply", py_dare_drop_apply, METH_VARARGS,
     "dare_drop_apply(address, n, fp16, keep, mode, s)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_loops", "mergelab's compiled merge loops (see kernels.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__loops(void)
{
    PyObject *mod = PyModule_Create(&module);
    if (!mod) return NULL;
    band_masks = cpu_has_avx2(0);
    vector_loops = cpu_has_avx2(1);
    fill_keep_masks();
#ifdef HAVE_MAPPING
    if (PyType_Ready(&MappingType) < 0 || PyModule_AddObjectRef(mod, "Mapping",
                                                                 (PyObject *)&MappingType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
#endif
    const struct { const char *name; long value; } constants[] = {
        {"VERSION", LOOPS_VERSION}, {"TILE", TILE}, {"GROUPED", GROUPED},
        {"DARE_LANES", DARE_LANES}, {"RUN_HASH", (long)RUN_HASH}, {"N_PARAMS", N_PARAMS},
        {"N_FLAGS", N_FLAGS}, {"P_LOW", P_LOW}, {"P_HIGH", P_HIGH},
        {"P_DARE_LIMIT", P_DARE_LIMIT}, {"P_DARE_DIVISOR", P_DARE_DIVISOR}, {"P_SUM_W", P_SUM_W},
        {"P_VOTE_W", P_VOTE_W}, {"P_FLIP", P_FLIP}, {"P_MERGE_W", P_MERGE_W},
        {"P_DIVISOR_W", P_DIVISOR_W}, {"F_KIND", F_KIND}, {"F_BAND", F_BAND},
        {"F_VOTE_COUNT", F_VOTE_COUNT}, {"F_VOTE_PLAIN", F_VOTE_PLAIN}, {"F_ANY_FLIP", F_ANY_FLIP},
        {"F_MERGE_PLAIN", F_MERGE_PLAIN}, {"F_DIVIDE_BY", F_DIVIDE_BY},
        {"F_DIVISOR_PLAIN", F_DIVISOR_PLAIN}, {"F_ALL_POSITIVE", F_ALL_POSITIVE},
        {"F_SUM_DIVIDE", F_SUM_DIVIDE}, {"F_SCALE", F_SCALE}, {"S_LAMBDA", S_LAMBDA},
        {"S_TOTAL", S_TOTAL}, {"S_MIN_W", S_MIN_W}, {"KIND_SUM", KIND_SUM},
        {"KIND_ELECT", KIND_ELECT}, {"DIVIDE_NONE", DIVIDE_NONE}, {"DIVIDE_COUNT", DIVIDE_COUNT},
        {"DIVIDE_WEIGHT_SUM", DIVIDE_WEIGHT_SUM}, {"FOUND_IN_INPUT", FOUND_IN_INPUT},
        {"FOUND_IN_RESULT", FOUND_IN_RESULT}, {"TAU_KTH_WHOLE", KTH_WHOLE},
    };
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++) {
        if (PyModule_AddIntConstant(mod, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(mod);
            return NULL;
        }
    }
    return mod;
}
