/* kvscope CPU kernel: Q4_1 Linears on AMX's bf16 tiles (Intel Sapphire Rapids and later), for
 * calls of kvscope_amx_min_rows rows or more (8 by default), where the CPU has AMX, the library was
 * built for it (-march=native) and the process may use it (kvscope_amx).
 *
 * A Q4_1 code (0..15) is exact in bf16, and so is any fp32 x once cut into three bf16 parts:
 * x = x1 + x2 + x3, x1 = x's top 8 significant bits, x2 the next 8 of x - x1, x3 the rest (each
 * difference exact). So each of a block's 32 products q_k x_k is three exact products q_k x1_k,
 * q_k x2_k, q_k x3_k, summed in the tile unit (TDPBF16PS) into an fp32 tile, the smallest part
 * first; then per block the AVX path's finish: t = fma(m, sum x, d * s), added to the running
 * total block after block. The tile unit's own adder rounds as the hardware does (no IEEE order
 * reproduces its bits; measured on random blocks, within 1.9 eps of sum |q x| of the exact sum,
 * where the AVX path's two fused-multiply-add chains reach 4.2), so this path's bits are not the
 * AVX paths'; but every row is computed alone (a tile's rows never mix, whatever the tile's row
 * count or its other rows: checked), so a row's result does not depend on its batch among calls
 * of min_rows or more. Calls of fewer rows (one-row decode, verification up to k = min_rows - 2)
 * take the AVX path: the tile unit costs about the same for one row as for sixteen, so below ~7
 * rows the AVX path is faster (`scripts/qlinear_ab.py --model`, 1 thread: 9.4 against 13.2 ms a
 * step's Linears at 1 row, 12.2 / 14.0 at 5, 20.5 / 16.8 at 8, 34.0 / 22.1 at 16). A row's bits
 * thus depend on which side of min_rows its call falls; both are within fp32 rounding of the
 * exact product.
 *
 * Tiles (all 16 rows x 64 bytes, the rows of A and C cut to M below 16 rows, where the unit is
 * about 1.7x faster): 0, 1 = C of two 16-output panels (rows x 16 fp32), 2 = A (16 rows of one part
 * of x over a block: 32 bf16), 3, 4 = B of the two panels (16 column pairs x 16 outputs x 2 bf16:
 * a panel block's codes as they lie, byte j of pair kk = output j's code of k | of k + 1 << 4). */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvscope.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#define AMX_BUILD 1
#endif

#define QK 32
#define NR 16
#define PB 320 /* bytes of a Q4_1 panel block */
#define MC 64  /* rows per chunk: their three parts of x stay in L2 while a thread's panels pass */

static int amx_on; /* 1: every Q4_1 Linear of this process runs here */

#ifdef AMX_BUILD
#define AI inline __attribute__((always_inline))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, so the stores of the rest of the
 * 64-byte configuration can be dropped before it: the whole array is the operand here */
static void tile_config(int rows) {
    uint8_t c[64] __attribute__((aligned(64)));
    memset(c, 0, sizeof c);
    c[0] = 1;
    for (int t = 0; t < 8; t++) {
        c[16 + 2 * t] = 64;
        c[48 + t] = (uint8_t)(t == 3 || t == 4 ? 16 : rows);
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(*(const uint8_t(*)[64])c));
}

/* bf16 of 0..15, as words 0..15 of a vpermw table */
static AI __m512i code_table(void) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) {
        const float f = (float)(i & 15);
        uint32_t u;
        memcpy(&u, &f, 4);
        t[i] = (uint16_t)(u >> 16);
    }
    return _mm512_loadu_si512(t);
}

/* a panel block's 32 x 16 codes as the B tile: row kk/2 = (code of k, code of k + 1) per output */
static AI void block_codes(const uint8_t *blk, uint16_t *dst, __m512i tab) {
    const __m512i lo = _mm512_set1_epi32(0x000F000F);
    for (int r = 0; r < 16; r++) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 + 16 * r)));
        /* (v | v << 12) & 0x000F000F: word 0 the low nibble, word 1 the high one */
        const __m512i w = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), lo, 0xA8);
        _mm512_store_si512(dst + 32 * r, _mm512_permutexvar_epi16(w, tab));
    }
}

/* x's three bf16 parts, each [rows][K] (rows past M zero) */
static void split_rows(const float *x, int M, int Mp, int K, uint16_t *xp) {
    const size_t part = (size_t)Mp * K;
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    #pragma omp for schedule(static)
    for (int r = 0; r < Mp; r++)
        for (int k = 0; k < K; k += 16) {
            const __m512 v = r < M ? _mm512_loadu_ps(x + (size_t)r * K + k) : _mm512_setzero_ps();
            const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), hi));
            const __m512 r1 = _mm512_sub_ps(v, a);
            const __m512 b = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), hi));
            const __m512 c = _mm512_sub_ps(r1, b);
            const __m512 p[3] = {a, b, c};
            for (int i = 0; i < 3; i++)
                _mm256_storeu_si256((__m256i *)(xp + i * part + (size_t)r * K + k),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p[i]), 16)));
        }
}

/* block b's finish for mr rows x P panels: t = fma(m, sum x, d * s) added to the running totals
 * (tot [mr][2][16]), s the tile sums in cbb [P][16][16] */
static AI void finish(int P, const uint8_t *pan, size_t pstride, int b, int mr, const float *sx, int nb,
                      const float *cbb, float *tot) {
    for (int q = 0; q < P; q++) {
        const uint8_t *blk = pan + q * pstride + (size_t)b * PB;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        for (int r = 0; r < mr; r++) {
            float *t = tot + (size_t)(r * 2 + q) * NR;
            const __m512 s = _mm512_load_ps(cbb + (size_t)(q * 16 + r) * NR);
            const __m512 f = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(size_t)r * nb + b]), _mm512_mul_ps(d, s));
            _mm512_store_ps(t, _mm512_add_ps(_mm512_load_ps(t), f));
        }
    }
}

/* rows r0..r0+mr-1 (mr <= 16) x P (1 or 2) panels over all blocks: bsc the panels' B tiles
 * [P][nb], tot [mr][P][16] running totals */
static AI void tile_rows(int P, const uint16_t *xp, size_t part, int r0, int mr, int K, const float *sx,
                         const uint8_t *pan, size_t pstride, uint16_t *bsc, int convert, __m512i tab,
                         const float *bias, float *y, int N, int nvalid_last, float *tot, float *cb) {
    const int nb = K / QK;
    memset(tot, 0, sizeof(float) * 16 * 2 * NR);
    for (int b = 0; b < nb; b++) {
        if (convert) /* the first row tile converts each block's codes just before its products */
            for (int q = 0; q < P; q++) {
                const uint8_t *blk = pan + q * pstride + (size_t)b * PB;
                for (int l = 0; l < PB; l += 64) _mm_prefetch((const char *)(blk + 8 * PB + l), _MM_HINT_T0);
                block_codes(blk, bsc + (size_t)(q * nb + b) * 512, tab);
            }
        _tile_zero(0);
        _tile_loadd(3, bsc + (size_t)b * 512, 64);
        if (P == 2) {
            _tile_zero(1);
            _tile_loadd(4, bsc + (size_t)(nb + b) * 512, 64);
        }
        for (int i = 2; i >= 0; i--) { /* the smallest part first */
            _tile_loadd(2, xp + i * part + (size_t)r0 * K + b * QK, 2 * K);
            _tile_dpbf16ps(0, 2, 3);
            if (P == 2) _tile_dpbf16ps(1, 2, 4);
        }
        float *cbb = cb + (size_t)(b & 1) * 2 * 16 * NR; /* this block's sums; the last block's in the other half */
        _tile_stored(0, cbb, 64);
        if (P == 2) _tile_stored(1, cbb + 16 * NR, 64);
        /* the previous block's finish after this block's tile work was issued, so the two overlap
           (the same finish, block after block: the same bits) */
        if (b > 0) finish(P, pan, pstride, b - 1, mr, sx + (size_t)r0 * nb, nb, cb + (size_t)((b - 1) & 1) * 2 * 16 * NR, tot);
    }
    finish(P, pan, pstride, nb - 1, mr, sx + (size_t)r0 * nb, nb, cb + (size_t)((nb - 1) & 1) * 2 * 16 * NR, tot);
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < P; q++) {
            const int nv = q == P - 1 ? nvalid_last : NR;
            const __mmask16 mask = (__mmask16)((1u << nv) - 1);
            __m512 t = _mm512_load_ps(tot + (size_t)(r * 2 + q) * NR);
            if (bias) t = _mm512_add_ps(t, _mm512_maskz_loadu_ps(mask, bias + q * NR));
            _mm512_mask_storeu_ps(y + (size_t)(r0 + r) * N + q * NR, mask, t);
        }
}

int kvscope_amx_qlinear(const float *x, int M, int K, const uint8_t *panels, int N, const float *bias, float *y,
                        int n_threads) {
    const int np = (N + NR - 1) / NR, nb = K / QK, Mp = M < 16 ? M : (M + 15) / 16 * 16;
    const size_t pstride = (size_t)nb * PB, part = (size_t)Mp * K;
    uint16_t *xp = kv_alloc(sizeof(uint16_t) * 3 * part);
    float *sx = kv_alloc(sizeof(float) * (size_t)M * nb);
    int rc = 0;
    if (!xp || !sx) rc = -3;
    if (n_threads > np) n_threads = np;
    #pragma omp parallel num_threads(n_threads) if (n_threads > 1 && !rc)
    if (!rc) {
        kv_block_sums(x, M, K, sx, 1); /* the AVX paths' sums */
        split_rows(x, M, Mp, K, xp); /* ends in the omp for's barrier */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = share_start(np, nt, t), p1 = share_start(np, nt, t + 1);
        uint16_t *bsc = kv_alloc(sizeof(uint16_t) * 512 * 2 * (size_t)nb);
        float *tot = kv_alloc(sizeof(float) * 16 * 2 * NR), *cb = kv_alloc(sizeof(float) * 2 * 2 * 16 * NR);
        if (!bsc || !tot || !cb) {
            #pragma omp atomic write
            rc = -3;
        } else {
            const __m512i tab = code_table();
            tile_config(M < 16 ? M : 16);
            for (int r0 = 0; r0 < M; r0 += MC) {
                const int rc_rows = M - r0 < MC ? M - r0 : MC;
                for (int p = p0; p < p1; p += 2) {
                    const int P = p + 2 <= p1 ? 2 : 1;
                    const int nv = N - (p + P - 1) * NR < NR ? N - (p + P - 1) * NR : NR;
                    for (int r = r0; r < r0 + rc_rows; r += 16) {
                        const int mr = r0 + rc_rows - r < 16 ? r0 + rc_rows - r : 16;
                        if (P == 2)
                            tile_rows(2, xp, part, r, mr, K, sx, panels + p * pstride, pstride, bsc, r == r0, tab,
                                      bias ? bias + p * NR : NULL, y + p * NR, N, nv, tot, cb);
                        else
                            tile_rows(1, xp, part, r, mr, K, sx, panels + p * pstride, pstride, bsc, r == r0, tab,
                                      bias ? bias + p * NR : NULL, y + p * NR, N, nv, tot, cb);
                    }
                }
            }
            _tile_release();
        }
        free(bsc);
        free(tot);
        free(cb);
    }
    free(xp);
    free(sx);
    return rc;
}

/* 1 when a child process could ask for the tile state, configure tiles and get an exact product
 * from them (a guest whose hypervisor does not pass AMX through faults there, so the child, not
 * this process, takes that) */
static int amx_works_in_child(void) {
    const pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) _exit(2);
        uint16_t a[16 * 32] __attribute__((aligned(64))), bb[16 * 32] __attribute__((aligned(64)));
        float c[16 * 16] __attribute__((aligned(64)));
        for (int i = 0; i < 16 * 32; i++) { a[i] = 0x3F80; bb[i] = 0x4000; } /* 1.0, 2.0 */
        tile_config(16);
        _tile_loadd(2, a, 64);
        _tile_loadd(3, bb, 64);
        _tile_zero(0);
        _tile_dpbf16ps(0, 2, 3);
        _tile_stored(0, c, 64);
        _tile_release();
        for (int i = 0; i < 256; i++)
            if (c[i] != 64.f) _exit(3);
        _exit(0);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
#else
int kvscope_amx_qlinear(const float *x, int M, int K, const uint8_t *panels, int N, const float *bias, float *y,
                        int n_threads) {
    (void)x, (void)M, (void)K, (void)panels, (void)N, (void)bias, (void)y, (void)n_threads;
    return -1;
}
#endif

/* on = 1: Q4_1 Linears on AMX from now on, where this build and CPU can (probed in a child
 * process first, then the tile state asked for this one); 0: the AVX path; -1: only read.
 * Returns 1 when on. */
int kvscope_amx(int on) {
#ifdef AMX_BUILD
    if (on == 0) amx_on = 0;
    else if (on == 1 && !amx_on)
        amx_on = amx_works_in_child() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    (void)on;
#endif
    return amx_on;
}

#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8
#endif
static int amx_min_rows = AMX_MIN_ROWS;

/* rows > 0: calls of at least this many rows take the tiles (while on); returns the setting */
int kvscope_amx_min_rows(int rows) {
    if (rows > 0) amx_min_rows = rows;
    return amx_min_rows;
}

/* whether a Q4_1 call of M rows goes here */
int kvscope_amx_takes(int M) { return amx_on && M >= amx_min_rows; }
