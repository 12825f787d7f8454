/* kvscope CPU kernel: y = x W^T (+ b) for the engine's Linear layers, fp32.
 *
 * W [N, K] is packed once into column panels of NR = 16 outputs: panels[p][k][0..15] holds
 * W[16p .. 16p+15][k] (zero-padded past N), so each panel is read front to back. The microkernel
 * keeps an MR x 16 tile of outputs in registers and adds x[m][k] * panel[k][:] for every k: one
 * broadcast per row and the panel row's loads per MR fused multiply-adds of 16 lanes. 8-lane
 * vectors (AVX2): MR <= 6, 12 accumulators.
 * AVX-512: one 16-lane vector per tile row and MR <= 12, so 12 independent chains cover the
 * multiply-add latency of two full-width units (AMD Zen 5, 1 thread, the default model's shapes:
 * 127-128 -> 206-218 GFLOP/s at 256 rows, 99-113 -> 186-193 at 16; the same bits); and from 2
 * rows two panels a tile (tile2_MR, MR <= 6), each broadcast of x serving 32 outputs: 213-214 ->
 * 241-253 GFLOP/s at 256 rows, 184-192 -> 195-207 at 16, 141-154 -> 163-174 at 6 (the same bits).
 * Work is split over panels on OpenMP threads (the libgomp torch loaded, shared with torch); while
 * one panel is read, the next one is prefetched line by line (12% less time at 16 rows, measured).
 *
 * Every output y[m][n] is summed over k in the same order whatever M is (blocks of KB terms,
 * each block added to a running total), so a row's result does not depend on what else is in
 * the batch (MR and the vector width do not change it). Portable C with GCC vector extensions, no
 * intrinsics.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvscope.h"

#define NR 16
#define KB 64


/* kvscope.h's vw: with AVX-512 a tile row's 16 outputs are one 16-lane vector (the same lane-wise
   arithmetic as two 8-lane halves, so the same bits; one instruction where there were two, which
   is twice the rate on cores with full-width 512-bit units, e.g. AMD Zen 5) */
#define VL VW_LANES      /* lanes per vector */
#define NH (NR / VL)     /* vectors per tile row */

#define TILE(MR)                                                                                   \
static void tile_##MR(const float *x, int K, const float *panel, const float *bias, float *y,    \
                      int ldy, int nvalid) {                                                       \
    vw a[MR][NH], t[MR][NH];                                                                       \
    for (int r = 0; r < MR; r++)                                                                   \
        for (int h = 0; h < NH; h++) t[r][h] = splatw(0.f);                                        \
    for (int kb = 0; kb < K; kb += KB) {                                                           \
        const int ke = kb + KB < K ? kb + KB : K;                                                  \
        for (int r = 0; r < MR; r++)                                                               \
            for (int h = 0; h < NH; h++) a[r][h] = splatw(0.f);                                    \
        for (int k = kb; k < ke; k++) {                                                            \
            __builtin_prefetch(panel + (size_t)(K + k) * NR);   /* the next panel, same row */     \
            vw w[NH];                                                                              \
            for (int h = 0; h < NH; h++) w[h] = ldw(panel + (size_t)k * NR + h * VL);             \
            for (int r = 0; r < MR; r++) {                                                         \
                const vw xb = splatw(x[(size_t)r * K + k]);                                        \
                for (int h = 0; h < NH; h++) a[r][h] += xb * w[h];                                 \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MR; r++)                                                               \
            for (int h = 0; h < NH; h++) t[r][h] += a[r][h];                                       \
    }                                                                                              \
    if (bias) {                                                                                    \
        float bb[NR] = {0};                                                                        \
        for (int j = 0; j < nvalid; j++) bb[j] = bias[j];                                          \
        for (int r = 0; r < MR; r++)                                                               \
            for (int h = 0; h < NH; h++) t[r][h] += ldw(bb + h * VL);                              \
    }                                                                                              \
    for (int r = 0; r < MR; r++) {                                                                 \
        float *o = y + (size_t)r * ldy;                                                            \
        if (nvalid == NR) {                                                                        \
            for (int h = 0; h < NH; h++) stw(o + h * VL, t[r][h]);                                 \
        } else {                                                                                   \
            float tmp[NR];                                                                         \
            for (int h = 0; h < NH; h++) stw(tmp + h * VL, t[r][h]);                               \
            for (int j = 0; j < nvalid; j++) o[j] = tmp[j];                                        \
        }                                                                                          \
    }                                                                                              \
}
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#ifdef __AVX512F__
TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#endif


#ifdef __AVX512F__
/* MR <= 6 rows x two panels (32 outputs; nvalid of the second panel's real): each broadcast of x
   serves both panels' vectors, so half the broadcasts per fused multiply-add of tile_MR. Each
   output's chain is tile_MR's, so the same bits. */
#define TILE2(MR)                                                                                  \
static void tile2_##MR(const float *x, int K, const float *panel, const float *bias, float *y,   \
                       int ldy, int nvalid) {                                                      \
    v16 a[MR][2], t[MR][2];                                                                        \
    for (int r = 0; r < MR; r++) t[r][0] = t[r][1] = splat16(0.f);                                 \
    for (int kb = 0; kb < K; kb += KB) {                                                           \
        const int ke = kb + KB < K ? kb + KB : K;                                                  \
        for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = splat16(0.f);                             \
        for (int k = kb; k < ke; k++) {                                                            \
            __builtin_prefetch(panel + (size_t)(2 * K + k) * NR); /* the next two panels */        \
            __builtin_prefetch(panel + (size_t)(3 * K + k) * NR);                                  \
            const v16 w0 = ld16(panel + (size_t)k * NR), w1 = ld16(panel + (size_t)(K + k) * NR); \
            for (int r = 0; r < MR; r++) {                                                         \
                const v16 xb = splat16(x[(size_t)r * K + k]);                                      \
                a[r][0] += xb * w0;                                                                \
                a[r][1] += xb * w1;                                                                \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MR; r++) t[r][0] += a[r][0], t[r][1] += a[r][1];                       \
    }                                                                                              \
    float bb[2 * NR] = {0}, tmp[2 * NR];                                                           \
    if (bias)                                                                                      \
        for (int j = 0; j < NR + nvalid; j++) bb[j] = bias[j];                                     \
    for (int r = 0; r < MR; r++) {                                                                 \
        float *o = y + (size_t)r * ldy;                                                            \
        st16(tmp, bias ? t[r][0] + ld16(bb) : t[r][0]);                                            \
        st16(tmp + NR, bias ? t[r][1] + ld16(bb + NR) : t[r][1]);                                  \
        memcpy(o, tmp, sizeof(float) * (NR + nvalid));                                             \
    }                                                                                              \
}
TILE2(1) TILE2(2) TILE2(3) TILE2(4) TILE2(5) TILE2(6)
#endif
/* One row (decode at batch 1): P full panels at a time, so P * NH accumulator chains are in
 * flight instead of NH (a single row has too little work per loaded line to hide the FMA latency
 * otherwise: 22 -> 16 ms for the default model's weights, measured). Each output is summed in
 * exactly tile_1's order, so the result is bitwise the same. */
#define GEMV(P)                                                                                   \
static void gemv_##P(const float *x, int K, const float *panel, const float *bias, float *y) {    \
    vw a[P][NH], t[P][NH];                                                                         \
    for (int q = 0; q < P; q++)                                                                    \
        for (int h = 0; h < NH; h++) t[q][h] = splatw(0.f);                                        \
    for (int kb = 0; kb < K; kb += KB) {                                                           \
        const int ke = kb + KB < K ? kb + KB : K;                                                  \
        for (int q = 0; q < P; q++)                                                                \
            for (int h = 0; h < NH; h++) a[q][h] = splatw(0.f);                                    \
        for (int k = kb; k < ke; k++) {                                                            \
            const vw xb = splatw(x[k]);                                                            \
            for (int q = 0; q < P; q++) {                                                          \
                const float *pp = panel + (size_t)q * K * NR + (size_t)k * NR;                     \
                for (int h = 0; h < NH; h++) a[q][h] += xb * ldw(pp + h * VL);                     \
            }                                                                                      \
        }                                                                                          \
        for (int q = 0; q < P; q++)                                                                \
            for (int h = 0; h < NH; h++) t[q][h] += a[q][h];                                       \
    }                                                                                              \
    for (int q = 0; q < P; q++)                                                                    \
        for (int h = 0; h < NH; h++) {                                                             \
            if (bias) t[q][h] += ldw(bias + q * NR + h * VL);                                      \
            stw(y + q * NR + h * VL, t[q][h]);                                                     \
        }                                                                                          \
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
#ifdef __AVX512F__
#ifndef MR_MAX
#define MR_MAX 12
#endif
static const tile_fn TILES[13] = {0,      tile_1, tile_2, tile_3,  tile_4,  tile_5, tile_6,
                                  tile_7, tile_8, tile_9, tile_10, tile_11, tile_12};
#else
#define MR_MAX 6
static const tile_fn TILES[7] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
#endif

#ifdef __AVX512F__
#define PW 2 /* panels a tile group from 2 rows */
static const tile_fn TILES2[7] = {0, tile2_1, tile2_2, tile2_3, tile2_4, tile2_5, tile2_6};
/* every row of two consecutive panels, in ceil(M / 6) row tiles as even as can be */
static void linear_panel2(const float *x, int M, int K, const float *panel, const float *bias, float *y, int ldy,
                          int nvalid) {
    for (int t = 0, m = 0, nt = (M + 5) / 6; t < nt; t++) {
        const int mr = share_size(M, nt, t);
        TILES2[mr](x + (size_t)m * K, K, panel, bias, y + (size_t)m * ldy, ldy, nvalid);
        m += mr;
    }
}
#else
#define PW 1
#endif
/* every row of one panel (nvalid of its 16 outputs real): y[m][0..nvalid) for m < M, row stride
 * ldy; also what quant_linear.c runs over a panel it has widened to fp32 */
void kvscope_linear_panel(const float *x, int M, int K, const float *panel, const float *bias, float *y, int ldy,
                          int nvalid) {
    for (int m = 0; m < M; m += MR_MAX) {
        const int mr = M - m < MR_MAX ? M - m : MR_MAX;
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
            gemv_range(x, K, panels, N, bias, y, share_start(np, nt, t), share_start(np, nt, t + 1));
        }
        return 0;
    }
    /* groups of PW panels (with AVX-512 pairs, linear_panel2; the last panel alone where np is odd) */
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int g = 0; g < (np + PW - 1) / PW; g++) {
        const int p = g * PW, w = np - p < PW ? np - p : PW, nv = N - (p + w - 1) * NR < NR ? N - (p + w - 1) * NR : NR;
        const float *pan = panels + (size_t)p * K * NR, *b = bias ? bias + p * NR : NULL;
#ifdef __AVX512F__
        if (w == 2) {
            linear_panel2(x, M, K, pan, b, y + p * NR, N, nv);
            continue;
        }
#endif
        kvscope_linear_panel(x, M, K, pan, b, y + p * NR, N, nv);
    }
    return 0;
}
