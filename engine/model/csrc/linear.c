/* kvscope CPU kernel: y = x W^T (+ b) for the engine's Linear layers, fp32.
 *
 * W [N, K] is packed once into column panels of NR = 16 outputs: panels[p][k][0..15] holds
 * W[16p .. 16p+15][k] (zero-padded past N), so each panel is read front to back. The microkernel
 * keeps an MR x 16 tile of outputs (MR <= 6 rows, 12 vector accumulators) in registers and adds
 * x[m][k] * panel[k][:] for every k: one broadcast and two panel loads per 12 fused multiply-adds.
 * Work is split over panels on OpenMP threads (the libgomp torch loaded, shared with torch); while
 * one panel is read, the next one is prefetched line by line (12% less time at 16 rows, measured).
 *
 * Every output y[m][n] is summed over k in the same order whatever M is (blocks of KB terms,
 * each block added to a running total), so a row's result does not depend on what else is in
 * the batch. Portable C with GCC vector extensions (8 x fp32), no intrinsics.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvscope.h"

#define NR 16
#define KB 64


#define TILE(MR)                                                                                   \
static void tile_##MR(const float *x, int K, const float *panel, const float *bias, float *y,    \
                      int ldy, int nvalid) {                                                       \
    v8 a0[MR], a1[MR], t0[MR], t1[MR];                                                             \
    for (int r = 0; r < MR; r++) { t0[r] = splat(0.f); t1[r] = splat(0.f); }                      \
    for (int kb = 0; kb < K; kb += KB) {                                                           \
        const int ke = kb + KB < K ? kb + KB : K;                                                  \
        for (int r = 0; r < MR; r++) { a0[r] = splat(0.f); a1[r] = splat(0.f); }                  \
        for (int k = kb; k < ke; k++) {                                                            \
            __builtin_prefetch(panel + (size_t)(K + k) * NR);   /* the next panel, same row */     \
            const v8 w0 = ld(panel + (size_t)k * NR), w1 = ld(panel + (size_t)k * NR + 8);        \
            for (int r = 0; r < MR; r++) {                                                         \
                const v8 xb = splat(x[(size_t)r * K + k]);                                         \
                a0[r] += xb * w0;                                                                  \
                a1[r] += xb * w1;                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MR; r++) { t0[r] += a0[r]; t1[r] += a1[r]; }                          \
    }                                                                                              \
    if (bias) {                                                                                    \
        float bb[NR] = {0};                                                                        \
        for (int j = 0; j < nvalid; j++) bb[j] = bias[j];                                          \
        for (int r = 0; r < MR; r++) { t0[r] += ld(bb); t1[r] += ld(bb + 8); }                    \
    }                                                                                              \
    for (int r = 0; r < MR; r++) {                                                                 \
        float *o = y + (size_t)r * ldy;                                                            \
        if (nvalid == NR) { st(o, t0[r]); st(o + 8, t1[r]); }                                      \
        else {                                                                                     \
            float t[NR];                                                                           \
            st(t, t0[r]); st(t + 8, t1[r]);                                                        \
            for (int j = 0; j < nvalid; j++) o[j] = t[j];                                          \
        }                                                                                          \
    }                                                                                              \
}
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)


/* One row (decode at batch 1): P full panels at a time, so 2P accumulator chains are in flight
 * instead of two (a single row has too little work per loaded line to hide the FMA latency
 * otherwise: 22 -> 16 ms for the default model's weights, measured). Each output is summed in
 * exactly tile_1's order, so the result is bitwise the same. */
#define GEMV(P)                                                                                   \
static void gemv_##P(const float *x, int K, const float *panel, const float *bias, float *y) {    \
    v8 a0[P], a1[P], t0[P], t1[P];                                                                 \
    for (int q = 0; q < P; q++) { t0[q] = splat(0.f); t1[q] = splat(0.f); }                       \
    for (int kb = 0; kb < K; kb += KB) {                                                           \
        const int ke = kb + KB < K ? kb + KB : K;                                                  \
        for (int q = 0; q < P; q++) { a0[q] = splat(0.f); a1[q] = splat(0.f); }                   \
        for (int k = kb; k < ke; k++) {                                                            \
            const v8 xb = splat(x[k]);                                                             \
            for (int q = 0; q < P; q++) {                                                          \
                const float *pp = panel + (size_t)q * K * NR + (size_t)k * NR;                     \
                a0[q] += xb * ld(pp);                                                              \
                a1[q] += xb * ld(pp + 8);                                                          \
            }                                                                                      \
        }                                                                                          \
        for (int q = 0; q < P; q++) { t0[q] += a0[q]; t1[q] += a1[q]; }                           \
    }                                                                                              \
    for (int q = 0; q < P; q++) {                                                                  \
        if (bias) { t0[q] += ld(bias + q * NR); t1[q] += ld(bias + q * NR + 8); }                 \
        st(y + q * NR, t0[q]); st(y + q * NR + 8, t1[q]);                                          \
    }                                                                                              \
}
GEMV(4) GEMV(2)

/* panels [p0, p1) of a one-row product */
static void gemv_range(const float *x, int K, const float *panels, int N, const float *bias, float *y,
                       int p0, int p1) {
    int p = p0;
    for (; p + 4 <= p1 && (p + 4) * NR <= N; p += 4)
        gemv_4(x, K, panels + (size_t)p * K * NR, bias ? bias + p * NR : NULL, y + p * NR);
    for (; p + 2 <= p1 && (p + 2) * NR <= N; p += 2)
        gemv_2(x, K, panels + (size_t)p * K * NR, bias ? bias + p * NR : NULL, y + p * NR);
    for (; p < p1; p++) {
        const int nvalid = N - p * NR < NR ? N - p * NR : NR;
        tile_1(x, K, panels + (size_t)p * K * NR, bias ? bias + p * NR : NULL, y + p * NR, N, nvalid);
    }
}

typedef void (*tile_fn)(const float *, int, const float *, const float *, float *, int, int);
static const tile_fn TILES[7] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* every row of one panel (nvalid of its 16 outputs real): y[m][0..nvalid) for m < M, row stride
 * ldy; also what quant_linear.c runs over a panel it has widened to fp32 */
void kvscope_linear_panel(const float *x, int M, int K, const float *panel, const float *bias, float *y, int ldy,
                          int nvalid) {
    for (int m = 0; m < M; m += 6) {
        const int mr = M - m < 6 ? M - m : 6;
        TILES[mr](x + (size_t)m * K, K, panel, bias, y + (size_t)m * ldy, ldy, nvalid);
    }
}

long long kvscope_linear_packed_floats(int N, int K) { return (long long)((N + NR - 1) / NR) * K * NR; }

/* w [N, K] row-major -> panels (kvscope_linear_packed_floats(N, K) floats) */
void kvscope_linear_pack(const float *w, int N, int K, float *panels) {
    const int np = (N + NR - 1) / NR;
    for (int p = 0; p < np; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                const int n = p * NR + j;
                panels[((size_t)p * K + k) * NR + j] = n < N ? w[(size_t)n * K + k] : 0.f;
            }
}

/* y [M, N] = x [M, K] . W^T + bias (bias may be NULL); returns 0, or -1 for bad sizes */
int kvscope_linear(const float *x, int M, int K, const float *panels, int N, const float *bias, float *y,
                   int n_threads) {
    if (M < 0 || K < 1 || N < 1) return -1;
    if (M == 0) return 0;
    const int np = (N + NR - 1) / NR;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > np) n_threads = np;
    if (M == 1) {       /* contiguous panel ranges per thread, so groups of four stay whole */
        #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            gemv_range(x, K, panels, N, bias, y, (int)((long long)np * t / nt), (int)((long long)np * (t + 1) / nt));
        }
        return 0;
    }
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int p = 0; p < np; p++)
        kvscope_linear_panel(x, M, K, panels + (size_t)p * K * NR, bias ? bias + p * NR : NULL, y + p * NR, N,
                             N - p * NR < NR ? N - p * NR : NR);
    return 0;
}
