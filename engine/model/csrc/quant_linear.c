/* kvscope CPU kernel: y = x W^T (+ b) with W held as the GGUF's quantized blocks (Q4_1, Q8_0), or
 * as 16-bit floats (F16, BF16: a GGUF's such tensors, or fp32 weights that are exactly bf16/fp16
 * values, e.g. a bf16 checkpoint loaded in fp32), widened to fp32 exactly.
 *
 * A GGUF block covers 32 consecutive weights of one row: Q4_1 = fp16 d, fp16 m, 16 bytes of
 * nibbles (weight j in the low nibble of byte j, weight j+16 in the high one), w = d * q + m;
 * Q8_0 = fp16 d, 32 int8, w = q * d (gguf-py's dequantizer, which transformers' GGUF loader
 * uses: both products and the sum rounded to fp32 one by one, never fused).
 *
 * The blocks of 16 rows are interleaved once into panels (kvscope_qpack), byte for byte the same
 * scales and quantized values, so that the 16 weights of one column k lie side by side:
 *   Q4_1 panel block (320 bytes = 20 per 32 weights, as in the file): d[16] fp16, m[16] fp16,
 *        then for each column pair (k, k+1), k even, 16 bytes: byte j = row j's nibble of column k
 *        | its nibble of column k+1 << 4;
 *   Q8_0 panel block (544 bytes = 34 per 32 weights): d[16] fp16, then for k = 0..31 16 int8.
 * F16 / BF16 (and Q4_1 / Q8_0 on CPUs without AVX2): each weight is widened to fp32 in
 * registers with exactly the dequantizer's arithmetic, and the outputs are accumulated in exactly
 * linear.c's order (16 outputs in vector lanes, blocks of KB terms, each block's fused
 * multiply-add chain added to a running total). So every output is bitwise the fp32 packed
 * kernel's on the de-quantized weight, for any row count. Up to 6 rows: weights widened once per
 * column and used by every row. More rows: a panel is widened into a scratch buffer and linear.c's
 * tiles run over it (kvscope_linear_panel).
 *
 * Q4_1 / Q8_0 with AVX-512 or AVX2 (the same arithmetic, so the same bits; AVX2 runs it 8 of a
 * panel's 16 rows at a time): the sum is factorized by block, as the block's scale is common to its
 * 32 weights: sum_k (d q_k + m) x_k = d * sum_k q_k x_k + m * sum_k x_k, so the codes are only
 * converted to fp32 and multiplied by x (no dequantizing multiply-add per weight), and sum_k x_k
 * is computed once per row and block for every output. That is the same value up to fp32
 * rounding, not bitwise the fp32 kernel's (kvscope_qlinear_bitwise says which a type gets; the
 * engine checks the bound when it packs a model). The order is fixed per output whatever the row
 * count or the tile: per block, the even and the odd columns each in a left-to-right fused
 * multiply-add chain from zero, their sum s, then (Q4_1) t = fma(m, sum x, d * s) or (Q8_0)
 * fma(d, s, total), t added to the running total block after block; so a row's result does not
 * depend on its batch either. AVX-512: below SCRATCH_ROWS rows the codes are converted in
 * registers, per column pair, for the tile's rows; from SCRATCH_ROWS rows a block's codes may
 * instead be converted once into a small buffer that every row tile reads (the same fp32 values,
 * the same chains). Which of the two is faster depends on the CPU (about 2x either way): the
 * library measures both when it loads (kvscope_qlinear_scratch_rows) and keeps the faster. AVX2:
 * 1-2 rows per column pair in registers, 3 to 23, 31 or 32 rows (verification; measured when the
 * library loads) one parity's chains at a time in registers (gtile), more rows through the scratch.
 */
#include <limits.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvscope.h"
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define QL_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QL_AVX512 1
#endif
#endif

#define NR 16
#define KB 64
#define QK 32
#define T_F16 1       /* ggml type ids */
#define T_Q4_1 3
#define T_Q8_0 8
#define T_BF16 30
#define IS_HALF(t) ((t) == T_F16 || (t) == T_BF16)


/* the value passes through an empty asm, so the compiler cannot fuse the product into the add
 * that follows (the dequantizer rounds d * q before adding m) */
#if defined(__x86_64__) || defined(__i386__)
static inline float opq(float v) { __asm__("" : "+x"(v)); return v; }
#else
static inline float opq(float v) { volatile float t = v; return t; }
#endif

static float half_to_float(uint16_t h) {
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits;
    if (e == 0) {
        if (m == 0) bits = s;
        else {                                  /* subnormal: exact in fp32 */
            float f = (float)m * (1.0f / 16777216.0f);
            memcpy(&bits, &f, 4);
            bits |= s;
        }
    } else if (e == 31) bits = s | 0x7f800000u | (m << 13);
    else bits = s | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* F16 / BF16 "blocks" are 32 plain 16-bit values (panel block: for k = 0..31 the 16 rows' values) */
static int block_bytes(int type) { return type == T_Q4_1 ? 20 : type == T_Q8_0 ? 34 : IS_HALF(type) ? 64 : 0; }
static int panel_block_bytes(int type) {
    return type == T_Q4_1 ? 320 : type == T_Q8_0 ? 544 : IS_HALF(type) ? 1024 : 0;
}

static float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

long long kvscope_qpanel_bytes(int type, int N, int K) {
    if (!block_bytes(type) || N < 1 || K < QK || K % QK) return -1;
    return (long long)((N + NR - 1) / NR) * (K / QK) * panel_block_bytes(type);
}

/* src: the GGUF tensor's blocks, rows of K / 32 blocks; row_map[n] = the GGUF row of output n */
int kvscope_qpack(int type, const uint8_t *src, long long src_rows, const int32_t *row_map, int N, int K,
                  uint8_t *out) {
    const int bb = block_bytes(type), pb = panel_block_bytes(type), nb = K / QK;
    if (!bb || N < 1 || K < QK || K % QK) return -1;
    const int np = (N + NR - 1) / NR;
    for (int n = 0; n < N; n++)
        if (row_map[n] < 0 || row_map[n] >= src_rows) return -2;
    memset(out, 0, (size_t)np * nb * pb);
    for (int p = 0; p < np; p++)
        for (int b = 0; b < nb; b++) {
            uint8_t *dst = out + ((size_t)p * nb + b) * pb;
            for (int j = 0; j < NR; j++) {
                const int n = p * NR + j;
                if (n >= N) continue;                       /* zero rows: d = m = q = 0 -> w = 0 */
                const uint8_t *blk = src + ((size_t)row_map[n] * nb + b) * bb;
                if (IS_HALF(type)) {
                    for (int k = 0; k < QK; k++) memcpy(dst + 2 * (k * NR + j), blk + 2 * k, 2);
                    continue;
                }
                memcpy(dst + 2 * j, blk, 2);                /* d */
                if (type == T_Q4_1) {
                    memcpy(dst + 32 + 2 * j, blk + 2, 2);   /* m */
                    for (int k = 0; k < QK; k++) {
                        const uint8_t q = k < 16 ? blk[4 + k] & 15 : blk[4 + k - 16] >> 4;
                        dst[64 + (k / 2) * 16 + j] |= (uint8_t)(k & 1 ? q << 4 : q);
                    }
                } else {
                    for (int k = 0; k < QK; k++) dst[32 + k * 16 + j] = blk[2 + k];
                }
            }
        }
    return 0;
}

/* one panel block's 16 x 32 weights in fp32, w[k * 16 + j]: the portable reference (and the
 * widening on CPUs without AVX2 / F16C) */
static void widen_block_scalar(int type, const uint8_t *blk, float *w) {
    if (IS_HALF(type)) {
        for (int i = 0; i < QK * NR; i++) {
            uint16_t h;
            memcpy(&h, blk + 2 * i, 2);
            w[i] = type == T_F16 ? half_to_float(h) : bf16_to_float(h);
        }
        return;
    }
    for (int j = 0; j < NR; j++) {
        uint16_t dh;
        memcpy(&dh, blk + 2 * j, 2);
        const float d = half_to_float(dh);
        if (type == T_Q4_1) {
            uint16_t mh;
            memcpy(&mh, blk + 32 + 2 * j, 2);
            const float m = half_to_float(mh);
            for (int k = 0; k < QK; k++) {
                const uint8_t byte = blk[64 + (k / 2) * 16 + j];
                const float q = (float)(k & 1 ? byte >> 4 : byte & 15);
                w[k * NR + j] = opq(d * q) + m;
            }
        } else {
            for (int k = 0; k < QK; k++) w[k * NR + j] = (float)(int8_t)blk[32 + k * 16 + j] * d;
        }
    }
}

/* panels -> W [N, K] row-major fp32 (the weights the kernel computes with) */
int kvscope_qunpack(int type, const uint8_t *panels, int N, int K, float *w) {
    const int pb = panel_block_bytes(type), nb = K / QK;
    if (!pb || N < 1 || K < QK || K % QK) return -1;
    float t[QK * NR];
    for (int p = 0; p < (N + NR - 1) / NR; p++)
        for (int b = 0; b < nb; b++) {
            widen_block_scalar(type, panels + ((size_t)p * nb + b) * pb, t);
            for (int j = 0; j < NR && p * NR + j < N; j++)
                for (int k = 0; k < QK; k++) w[(size_t)(p * NR + j) * K + b * QK + k] = t[k * NR + j];
        }
    return 0;
}

#ifdef QL_AVX2
/* per-block constants for the 16 rows, and column k's 16 weights from them */
typedef struct { __m256 d0, d1, m0, m1; const uint8_t *q; } bconst;

static inline __attribute__((always_inline)) bconst block_consts(int type, const uint8_t *blk) {
    bconst c;
    if (IS_HALF(type)) {
        c.d0 = c.d1 = c.m0 = c.m1 = _mm256_setzero_ps();
        c.q = blk;
        return c;
    }
    c.d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    c.d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
    if (type == T_Q4_1) {
        c.m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32)));
        c.m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 48)));
        c.q = blk + 64;
    } else {
        c.m0 = c.m1 = _mm256_setzero_ps();
        c.q = blk + 32;
    }
    return c;
}

static inline __attribute__((always_inline)) void widen_col(int type, const bconst *c, int k, v8 *w0, v8 *w1) {
    if (type == T_Q4_1) {
        /* column k's 16 rows: the low (k even) or high (k odd) nibbles of its pair's 16 bytes */
        const __m128i b = _mm_loadu_si128((const __m128i *)(c->q + (k / 2) * 16));
        const __m128i q = _mm_and_si128(k & 1 ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0f));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
        /* d q is exact in fp32 (an 11-bit significand times a 4-bit integer), so rounding d q + m
         * once (a fused multiply-add) gives exactly the dequantizer's round(round(d q) + m) */
        *w0 = (v8)_mm256_fmadd_ps(c->d0, lo, c->m0);
        *w1 = (v8)_mm256_fmadd_ps(c->d1, hi, c->m1);
    } else if (type == T_F16) {
        *w0 = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c->q + k * 32)));
        *w1 = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c->q + k * 32 + 16)));
    } else if (type == T_BF16) {
        const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(c->q + k * 32)));
        const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(c->q + k * 32 + 16)));
        *w0 = (v8)_mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
        *w1 = (v8)_mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    } else {
        const uint8_t *p = c->q + k * 16;
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
        *w0 = (v8)_mm256_mul_ps(lo, c->d0);
        *w1 = (v8)_mm256_mul_ps(hi, c->d1);
    }
}

static void widen_block(int type, const uint8_t *blk, float *w) {
    const bconst c = block_consts(type, blk);
    for (int k = 0; k < QK; k++) {
        v8 w0, w1;
        widen_col(type, &c, k, &w0, &w1);
        st(w + k * NR, w0);
        st(w + k * NR + 8, w1);
    }
}

/* MR rows x P consecutive panels, widened in registers; linear.c's tile order per output */
static inline __attribute__((always_inline)) void qtile(int type, int MR, int P, const float *x, int K,
                                                        const uint8_t *pan, const float *bias, float *y, int ldy,
                                                        int nvalid_last) {
    const int nb = K / QK, pb = panel_block_bytes(type);
    v8 a0[6][4], a1[6][4], t0[6][4], t1[6][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < P; q++) { t0[r][q] = splat(0.f); t1[r][q] = splat(0.f); }
    for (int kb = 0; kb < K; kb += KB) {
        const int ke = kb + KB < K ? kb + KB : K;
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < P; q++) { a0[r][q] = splat(0.f); a1[r][q] = splat(0.f); }
        for (int b = kb / QK; b < ke / QK; b++) {
            bconst c[4];
            for (int q = 0; q < P; q++) c[q] = block_consts(type, pan + ((size_t)q * nb + b) * pb);
            for (int kk = 0; kk < QK; kk++) {
                const int k = b * QK + kk;
                for (int q = 0; q < P; q++) {
                    v8 w0, w1;
                    widen_col(type, &c[q], kk, &w0, &w1);
                    for (int r = 0; r < MR; r++) {
                        const v8 xb = splat(x[(size_t)r * K + k]);
                        a0[r][q] += xb * w0;
                        a1[r][q] += xb * w1;
                    }
                }
            }
        }
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < P; q++) { t0[r][q] += a0[r][q]; t1[r][q] += a1[r][q]; }
    }
    for (int q = 0; q < P; q++) {
        const int nvalid = q == P - 1 ? nvalid_last : NR;
        float bb[NR] = {0};
        if (bias)
            for (int j = 0; j < nvalid; j++) bb[j] = bias[q * NR + j];
        for (int r = 0; r < MR; r++) {
            if (bias) { t0[r][q] += ld(bb); t1[r][q] += ld(bb + 8); }
            float *o = y + (size_t)r * ldy + q * NR;
            if (nvalid == NR) { st(o, t0[r][q]); st(o + 8, t1[r][q]); }
            else {
                float t[NR];
                st(t, t0[r][q]); st(t + 8, t1[r][q]);
                for (int j = 0; j < nvalid; j++) o[j] = t[j];
            }
        }
    }
}

#define QT(TY, MR, P)                                                                              \
static void qt_##TY##_##MR##_##P(const float *x, int K, const uint8_t *pan, const float *bias,    \
                                  float *y, int ldy, int nvalid_last) {                          \
    qtile(TY, MR, P, x, K, pan, bias, y, ldy, nvalid_last);                                        \
}
QT(3, 1, 4) QT(3, 1, 2) QT(3, 1, 1) QT(3, 2, 1) QT(3, 3, 1) QT(3, 4, 1) QT(3, 5, 1) QT(3, 6, 1)
QT(8, 1, 4) QT(8, 1, 2) QT(8, 1, 1) QT(8, 2, 1) QT(8, 3, 1) QT(8, 4, 1) QT(8, 5, 1) QT(8, 6, 1)
QT(1, 1, 4) QT(1, 1, 2) QT(1, 1, 1) QT(1, 2, 1) QT(1, 3, 1) QT(1, 4, 1) QT(1, 5, 1) QT(1, 6, 1)
QT(30, 1, 4) QT(30, 1, 2) QT(30, 1, 1) QT(30, 2, 1) QT(30, 3, 1) QT(30, 4, 1) QT(30, 5, 1) QT(30, 6, 1)

typedef void (*qt_fn)(const float *, int, const uint8_t *, const float *, float *, int, int);
static const qt_fn QT4[7] = {0, qt_3_1_1, qt_3_2_1, qt_3_3_1, qt_3_4_1, qt_3_5_1, qt_3_6_1};
static const qt_fn QT8[7] = {0, qt_8_1_1, qt_8_2_1, qt_8_3_1, qt_8_4_1, qt_8_5_1, qt_8_6_1};
static const qt_fn QTF16[7] = {0, qt_1_1_1, qt_1_2_1, qt_1_3_1, qt_1_4_1, qt_1_5_1, qt_1_6_1};
static const qt_fn QTBF16[7] = {0, qt_30_1_1, qt_30_2_1, qt_30_3_1, qt_30_4_1, qt_30_5_1, qt_30_6_1};
#else
static void widen_block(int type, const uint8_t *blk, float *w) { widen_block_scalar(type, blk, w); }
#endif

#ifdef QL_AVX2
#define SCRATCH_ROWS 8  /* AVX-512: from this many rows a block's codes may be converted once, for every row */
#ifndef G2_MAX_ROWS
#define G2_MAX_ROWS 32  /* AVX2: the last row count gtile runs by default (its section, below) */
#endif
#ifdef QL_AVX512
#define SCRATCH_DEFAULT SCRATCH_ROWS
#else
#define SCRATCH_DEFAULT (G2_MAX_ROWS + 1)
#endif
/* from this many rows the factorized kernel reads codes converted once per block (AVX-512) or per
 * panel (AVX2) into a scratch; measured when the library loads (tune_scratch_rows) */
static int scratch_rows = SCRATCH_DEFAULT;
#endif

/* The running thread's cursor of the plan (kvscope.h) its Linear was given, NULL outside one; set
 * and cleared by the thread inside each parallel region, so concurrent calls (two engines in one
 * process) never see each other's. Initial-exec TLS: a shared library's default model calls
 * __tls_get_addr at every access. */
static __thread kv_side_cursor *side_cur __attribute__((tls_model("initial-exec")));
static inline void side_enter(kv_side_plan *side, int t) {
    side_cur = side && t < KV_SIDE_THREADS ? &side->cur[t] : NULL;
}
static inline __attribute__((always_inline)) void kv_side_prefetch(void) {
    kv_side_cursor *c = side_cur;
    if (!c) return;
    for (int s = c->step; s > 0; s--) {
        if (c->p >= c->end) {
            if (c->i >= c->i1) return;
            c->p = (c->i & 1 ? c->v : c->k) + (size_t)c->blocks[c->i >> 1] * c->bytes;
            c->end = c->p + c->bytes;
            c->i++;
        }
        __builtin_prefetch(c->p, 0, 2); /* non-temporal (hint 0): W16's steps no faster than without */
        c->p += 64;
    }
}

#ifdef QL_AVX2
#ifndef QL_PREFETCH
#define QL_PREFETCH 16
#endif
/* QL_PREFETCH: blocks ahead, per panel (the next rows of a stream the hardware may not see): 5 KB
 * of Q4_1, 8.5 KB of Q8_0. A decode step reads its 97 MB of weights from memory, and at a few rows
 * a block takes a few tens of ns, so 4 blocks ahead was less than one memory latency: the default
 * model's 30 layers + lm_head (scripts/qlinear_ab.py --model, Zen 5, 1 thread, AVX-512) took 1.20x
 * less time at 16 blocks ahead at 1 row, 1.09x at 5, 1.04x at 16, 1.02x at 512; 24 and 32 no
 * better. */
static inline __attribute__((always_inline)) void prefetch_bytes(const uint8_t *p, int n) {
    for (int o = 0; o < n; o += 64) __builtin_prefetch(p + o);
}
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *blk, int pb) {
    prefetch_bytes(blk + (size_t)QL_PREFETCH * pb, pb);
}
#endif

#ifdef QL_AVX512
#define FMR 6           /* rows per tile with the codes converted in registers (from RT2_MIN rows
                         * over two panels: 2 MR x 2 chains + 4 code vectors in the 32 zmm, the
                         * 2 MR totals, touched once a block, spilled where they do not fit) */
#define RT2_MIN 3       /* from this many rows a register tile covers two panels (rtile's P = 2) */
#define SMR 3           /* rows per tile reading converted codes from the scratch (x 4 panels: 24
                         * accumulators + 6 broadcasts stay in registers, the codes are memory operands) */
/* Which of the two row paths runs from SCRATCH_ROWS rows is the CPU's to decide: both give the
 * same bits (the same fp32 codes, the same chains), only their speed differs. Where the vector
 * unit converts codes on ports the FMAs do not use and loads one zmm per cycle (AMD Zen 4), the
 * register path is about 2x the scratch path; where conversions take FMA ports and two zmm loads
 * issue per cycle (Intel), the scratch path was faster. kvscope_qlinear_scratch_rows(0) (called
 * when the library loads) measures both. */
#ifndef RC
#define RC 48
#endif
/* RC: rows per chunk of the scratch path (its running totals stay in L1 / L2) */
#define AI inline __attribute__((always_inline))

/* column pair (kk, kk + 1) of a panel block as fp32 codes, 16 rows in the lanes: *e column kk,
 * *o column kk + 1. Q4_1's odd codes two ways, by o16: the high nibble shifted down (q), or left
 * in place (16 q: one AND instead of a shift, where conversions set the pace) and scaled back by
 * 1/16 in the block's finish. Both give the same s = e + o, exactly (16 q sums to 16 times the q
 * sums: a power of two), so the same bits. */
static AI void pair_codes(int type, const uint8_t *blk, int kk, __m512 *e, __m512 *o, int o16) {
    if (type == T_Q4_1) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 + kk * 8)));
        *e = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)));
        *o = _mm512_cvtepi32_ps(o16 ? _mm512_and_si512(v, _mm512_set1_epi32(0xf0)) : _mm512_srli_epi32(v, 4));
    } else {
        const uint8_t *c = blk + 32 + kk * 16;
        *e = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
        *o = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
    }
}

/* the one per-block finish, for every tile: even / odd chains -> s -> added to the running total.
 * With q odd codes s is an add, off the FMA ports that set the pace from a few rows: 1.02x at 5-512
 * rows on Zen 4, but 0.98x at 2 rows, so 1-2 row tiles keep 16 q (kernel alone, 1 thread). */
static AI __m512 finish_block(int type, __m512 d, __m512 m, __m512 e, __m512 o, float sx, __m512 tot, int o16) {
    if (type == T_Q4_1) {
        const __m512 s = o16 ? _mm512_fmadd_ps(o, _mm512_set1_ps(0.0625f), e) : _mm512_add_ps(e, o);
        return _mm512_add_ps(tot, _mm512_fmadd_ps(m, _mm512_set1_ps(sx), _mm512_mul_ps(d, s)));
    }
    return _mm512_fmadd_ps(d, _mm512_add_ps(e, o), tot);
}

static AI __m512 block_d(const uint8_t *blk) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk)); }
static AI __m512 block_m(int type, const uint8_t *blk) {
    return type == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : _mm512_setzero_ps();
}

static AI void store_out(__m512 t, const float *bias, float *y, int nvalid) {
    const __mmask16 mask = (__mmask16)((1u << nvalid) - 1);
    if (bias) t = _mm512_add_ps(t, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(y, mask, t);
}

/* MR rows x P (1 or 2) consecutive panels (16 outputs each), codes converted in registers per
 * column pair and used by the tile's rows; sx [MR][nb] the rows' per-block sums of x. Each panel's
 * outputs get the same chains whatever P, so the same bits. P = 2 from RT2_MIN rows: each broadcast
 * of x serves two panels (2 x 2 MR accumulators); its two streams must each be prefetched on into
 * the next tile's same panel, or half the weights arrive unprefetched (0.72-0.8x from memory when
 * they were not; two or four panels a tile at 1-3 rows were 0.55-0.8x on a Zen 4 for that reason).
 * With it, scripts/qlinear_ab.py --model, Zen 5, 1 thread: 1.13x at 3 rows, 1.07x at 4, 1.04-1.05x at
 * 5, 1.06x at 6 (2 threads 0.99 / 1.04 / 1.03x at 3 / 5 / 6) against one panel a tile; and tiles of
 * at most 6 rows over two panels against 8 over one: 1.05x at 7 rows, 1.06x at 8, 1.06-1.07x at
 * 16, 1.04-1.07x at 64, 1.05-1.07x at 512 (2 threads 1.04-1.07x at 7-16). */
static AI void rtile(int type, int MR, int P, const float *x, const float *sx, int K, const uint8_t *pan,
                     const float *bias, float *y, int ldy, int nvalid) {
    const int nb = K / QK, pb = panel_block_bytes(type);
    const size_t pstride = (size_t)nb * pb; /* the panels lie one after another */
    __m512 tot[FMR][2];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < P; q++) tot[r][q] = _mm512_setzero_ps();
    const int o16 = MR <= 2; /* the odd codes' form: the conversion and the finish must agree */
    for (int b = 0; b < nb; b++) {
        kv_side_prefetch();
        __m512 ae[FMR][2], ao[FMR][2];
        const uint8_t *blk[2];
        for (int q = 0; q < P; q++) {
            blk[q] = pan + q * pstride + (size_t)b * pb;
            /* QL_PREFETCH blocks ahead in this stream, which goes on into the same panel of the
             * next tile's P (so with P = 1 simply the blocks that follow in memory) */
            const int bf = b + QL_PREFETCH;
            prefetch_bytes(bf < nb ? blk[q] + (size_t)QL_PREFETCH * pb
                                   : pan + (P + q) * pstride + (size_t)(bf - nb) * pb, pb);
        }
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < P; q++) ae[r][q] = ao[r][q] = _mm512_setzero_ps();
        for (int kk = 0; kk < QK; kk += 2) {
            const int k = b * QK + kk;
            __m512 e[2], o[2];
            for (int q = 0; q < P; q++) pair_codes(type, blk[q], kk, &e[q], &o[q], o16);
            for (int r = 0; r < MR; r++) {
                const __m512 xe = _mm512_set1_ps(x[(size_t)r * K + k]), xo = _mm512_set1_ps(x[(size_t)r * K + k + 1]);
                for (int q = 0; q < P; q++) {
                    ae[r][q] = _mm512_fmadd_ps(e[q], xe, ae[r][q]);
                    ao[r][q] = _mm512_fmadd_ps(o[q], xo, ao[r][q]);
                }
            }
        }
        for (int q = 0; q < P; q++) {
            const __m512 d = block_d(blk[q]), m = block_m(type, blk[q]);
            for (int r = 0; r < MR; r++)
                tot[r][q] = finish_block(type, d, m, ae[r][q], ao[r][q], sx[r * nb + b], tot[r][q], o16);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < P; q++)
            store_out(tot[r][q], bias ? bias + q * NR : NULL, y + (size_t)r * ldy + q * NR, q == P - 1 ? nvalid : NR);
}

/* MR rows x P panels of one block, the codes read from wsc (P x 32 columns x 16 floats, converted
 * by pair_codes: the same values), the running totals from / to tb (row stride P x 16) */
static AI void stile(int type, int MR, int P, const float *x, const float *sx, int K, int b, const float *wsc,
                     const __m512 *d, const __m512 *m, float *tb) {
    const int nb = K / QK;
    __m512 ae[SMR][4], ao[SMR][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < P; q++) { ae[r][q] = _mm512_setzero_ps(); ao[r][q] = _mm512_setzero_ps(); }
    for (int kk = 0; kk < QK; kk += 2) {
        const int k = b * QK + kk;
        for (int q = 0; q < P; q++) {
            const __m512 e = _mm512_loadu_ps(wsc + (size_t)(q * QK + kk) * NR);
            const __m512 o = _mm512_loadu_ps(wsc + (size_t)(q * QK + kk + 1) * NR);
            for (int r = 0; r < MR; r++) {
                ae[r][q] = _mm512_fmadd_ps(e, _mm512_set1_ps(x[(size_t)r * K + k]), ae[r][q]);
                ao[r][q] = _mm512_fmadd_ps(o, _mm512_set1_ps(x[(size_t)r * K + k + 1]), ao[r][q]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < P; q++) {
            float *t = tb + (size_t)(r * P + q) * NR;
            _mm512_storeu_ps(t, finish_block(type, d[q], m[q], ae[r][q], ao[r][q], sx[r * nb + b], _mm512_loadu_ps(t), 0));
        }
}

#define RT(TY, MR)                                                                                               \
static void rt_##TY##_##MR(const float *x, const float *sx, int K, const uint8_t *pan, const float *bias, float *y, \
                           int ldy, int nv) {                                                                    \
    rtile(TY, MR, 1, x, sx, K, pan, bias, y, ldy, nv);                                                           \
}
#define RT2(TY, MR)                                                                                              \
static void rt2_##TY##_##MR(const float *x, const float *sx, int K, const uint8_t *pan, const float *bias,         \
                            float *y, int ldy, int nv) {                                                         \
    rtile(TY, MR, 2, x, sx, K, pan, bias, y, ldy, nv);                                                           \
}
#define ST(TY, MR, P)                                                                                            \
static void st_##TY##_##MR##_##P(const float *x, const float *sx, int K, int b, const float *wsc, const __m512 *d, \
                                 const __m512 *m, float *tb) {                                                   \
    stile(TY, MR, P, x, sx, K, b, wsc, d, m, tb);                                                                \
}
#define TILES(TY)                                                                                                \
    RT(TY, 1) RT(TY, 2) RT(TY, 3) RT(TY, 4) RT(TY, 5) RT(TY, 6)                                                 \
    RT2(TY, 3) RT2(TY, 4) RT2(TY, 5) RT2(TY, 6)                                                                 \
    ST(TY, 1, 1) ST(TY, 2, 1) ST(TY, 3, 1) ST(TY, 1, 2) ST(TY, 2, 2) ST(TY, 3, 2) ST(TY, 1, 4) ST(TY, 2, 4) ST(TY, 3, 4)
TILES(3) TILES(8)
typedef void (*rt_fn)(const float *, const float *, int, const uint8_t *, const float *, float *, int, int);
typedef void (*st_fn)(const float *, const float *, int, int, const float *, const __m512 *, const __m512 *, float *);
/* [type is Q8_0][rows]: up to FMR rows (verification's k + 1 up to k = 5) go in one tile, so each
 * column's codes are converted once for all of them; RTILES2 the same over two panels, RTILES for a
 * thread's last odd panel and for 1-2 rows (the weights' memory rate sets their pace) */
static const rt_fn RTILES[2][FMR + 1] = {{0, rt_3_1, rt_3_2, rt_3_3, rt_3_4, rt_3_5, rt_3_6},
                                         {0, rt_8_1, rt_8_2, rt_8_3, rt_8_4, rt_8_5, rt_8_6}};
static const rt_fn RTILES2[2][FMR + 1] = {{0, 0, 0, rt2_3_3, rt2_3_4, rt2_3_5, rt2_3_6},
                                          {0, 0, 0, rt2_8_3, rt2_8_4, rt2_8_5, rt2_8_6}};
/* [type is Q8_0][panels - 1][rows] */
static const st_fn STILES[2][4][SMR + 1] = {
    {{0, st_3_1_1, st_3_2_1, st_3_3_1}, {0, st_3_1_2, st_3_2_2, st_3_3_2}, {0}, {0, st_3_1_4, st_3_2_4, st_3_3_4}},
    {{0, st_8_1_1, st_8_2_1, st_8_3_1}, {0, st_8_1_2, st_8_2_2, st_8_3_2}, {0}, {0, st_8_1_4, st_8_2_4, st_8_3_4}}};

/* P (1, 2 or 4) panels for M <= RC rows: per block, the panels' codes converted once into wsc, then
 * every row tile reads them (tb: M x P x 16 running totals) */
static void scratch_panels(int type, int P, const float *x, const float *sx, int M, int K, const uint8_t *pan,
                           size_t pstride, const float *bias, float *y, int N, int nvalid_last, float *wsc, float *tb) {
    const int nb = K / QK, pb = panel_block_bytes(type), q8 = type == T_Q8_0;
    memset(tb, 0, sizeof(float) * (size_t)M * P * NR);
    for (int b = 0; b < nb; b++) {
        kv_side_prefetch();
        __m512 d[4], m[4];
        for (int q = 0; q < P; q++) {
            const uint8_t *blk = pan + q * pstride + (size_t)b * pb;
            prefetch_block(blk, pb);
            d[q] = block_d(blk);
            m[q] = block_m(type, blk);
            for (int kk = 0; kk < QK; kk += 2) {
                __m512 e, o;
                pair_codes(type, blk, kk, &e, &o, 0);
                _mm512_storeu_ps(wsc + (size_t)(q * QK + kk) * NR, e);
                _mm512_storeu_ps(wsc + (size_t)(q * QK + kk + 1) * NR, o);
            }
        }
        for (int r = 0; r < M; r += SMR) {
            const int mr = M - r < SMR ? M - r : SMR;
            STILES[q8][P - 1][mr](x + (size_t)r * K, sx + (size_t)r * nb, K, b, wsc, d, m, tb + (size_t)r * P * NR);
        }
    }
    for (int r = 0; r < M; r++)
        for (int q = 0; q < P; q++)
            store_out(_mm512_loadu_ps(tb + (size_t)(r * P + q) * NR), bias ? bias + q * NR : NULL,
                      y + (size_t)r * N + q * NR, q == P - 1 ? nvalid_last : NR);
}

/* outputs of the last of panels p..p+w-1 that exist (only the matrix's last panel is partial,
 * so a group may end on it: each output's sum does not depend on its tile) */
static int last_valid(int N, int p, int w) {
    const int n = N - (p + w - 1) * NR;
    return n < NR ? n : NR;
}

static int qlinear_factorized(int type, const float *x, int M, int K, const uint8_t *panels, int N, const float *bias,
                              float *y, int n_threads, kv_side_plan *side) {
    const int np = (N + NR - 1) / NR, nb = K / QK, q8 = type == T_Q8_0;
    const size_t pstride = (size_t)nb * panel_block_bytes(type);
    float *sx = kv_alloc(sizeof(float) * (size_t)M * nb);
    if (!sx) return -3;
    int rc = 0;
    #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        kv_block_sums(x, M, K, sx, !q8);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = share_start(np, nt, t), p1 = share_start(np, nt, t + 1);
        int p = p0;
        side_enter(side, t);
        if (M >= scratch_rows) {
            float *wsc = kv_alloc(sizeof(float) * 4 * QK * NR), *tb = kv_alloc(sizeof(float) * RC * 4 * NR);
            if (!wsc || !tb) {
                #pragma omp atomic write
                rc = -3;
            } else {
                /* chunks of RC rows outermost: a chunk of x (48 x 1,536 floats at most) stays in L2
                   while the thread's panels pass over it, each panel's codes converted once a chunk.
                   Panel groups outermost re-read all of x (1.2-3.1 MB at 512 rows, more than a 2 MiB
                   L2 keeps beside the weights) for every 4 panels: 1.02-1.06x slower at 512 rows
                   (Intel Xeon, AVX-512, scripts/qlinear_ab.py --model). The same chains per output,
                   so the same bits. */
                for (int r0 = 0; r0 < M; r0 += RC) {
                    const int mr = M - r0 < RC ? M - r0 : RC;
                    p = p0;
                    for (int w = 4; w >= 1; w /= 2)
                        for (; p + w <= p1; p += w)
                            scratch_panels(type, w, x + (size_t)r0 * K, sx + (size_t)r0 * nb, mr, K,
                                           panels + p * pstride, pstride, bias ? bias + p * NR : NULL,
                                           y + (size_t)r0 * N + p * NR, N, last_valid(N, p, w), wsc, tb);
                }
            }
            free(wsc);
            free(tb);
        } else /* ceil(M / FMR) tiles as even as can be (7 = 4 + 3, 16 = 6 + 5 + 5; never a 1-row tile
                  * beside others: it is a whole pass of its own at the weights' memory rate); any split
                  * gives the same bits */
            for (int t = 0, r0 = 0, nt = (M + FMR - 1) / FMR; t < nt; t++) {
                const int mr = share_size(M, nt, t);
                p = p0;
                if (mr >= RT2_MIN)
                    for (; p + 2 <= p1; p += 2)
                        RTILES2[q8][mr](x + (size_t)r0 * K, sx + (size_t)r0 * nb, K, panels + p * pstride,
                                        bias ? bias + p * NR : NULL, y + (size_t)r0 * N + p * NR, N,
                                        last_valid(N, p, 2));
                for (; p < p1; p++)
                    RTILES[q8][mr](x + (size_t)r0 * K, sx + (size_t)r0 * nb, K, panels + p * pstride,
                                   bias ? bias + p * NR : NULL, y + (size_t)r0 * N + p * NR, N, last_valid(N, p, 1));
                r0 += mr;
            }
        side_enter(NULL, 0);
    }
    free(sx);
    return rc;
}

#endif

#if defined(QL_AVX2) && !defined(QL_AVX512)
/* Q4_1 / Q8_0 factorized by block on AVX2: the AVX-512 path's arithmetic 8 lanes at a time (a panel
 * is two halves of 8 rows), so both ISAs give the same bits: per block the even and the odd columns
 * each in a left-to-right fused multiply-add chain from zero (Q4_1's odd codes q, shifted down),
 * s = even + odd, then t = fma(m, sum x, d * s) added to the running total (Q8_0:
 * fma(d, even + odd, total)). Three row paths, all with these chains (so the same bits for a row
 * whatever its batch): 1 or 2 rows in ftile (codes of a column pair converted in registers, both
 * parities' chains live), 3 to scratch_rows - 1 rows (verification's k + 1, short prefill chunks) in
 * gtile (one parity at a time, so a whole panel's 16 outputs x up to 6 rows fit in the registers),
 * more rows through a scratch of converted codes that 6-row x 16-output tiles read (below). */
#define F2_PG 8         /* panels per group of gtile's path (they stay in L2 for the next row tile) */
#define AI2 inline __attribute__((always_inline))

/* column pair (kk, kk + 1) of half h (rows 8h..8h+7) of a panel block as fp32 codes */
static AI2 void pair_codes8(int type, const uint8_t *blk, int kk, int h, __m256 *e, __m256 *o) {
    if (type == T_Q4_1) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 64 + kk * 8 + 8 * h)));
        *e = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
        *o = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    } else {
        const uint8_t *c = blk + 32 + kk * 16 + 8 * h;
        *e = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
        *o = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 16))));
    }
}

static AI2 __m256 finish8(int type, __m256 d, __m256 m, __m256 e, __m256 o, float sx, __m256 tot) {
    if (type == T_Q4_1) {
        const __m256 s = _mm256_add_ps(e, o); /* as finish_block's, the odd codes q */
        return _mm256_add_ps(tot, _mm256_fmadd_ps(m, _mm256_set1_ps(sx), _mm256_mul_ps(d, s)));
    }
    return _mm256_fmadd_ps(d, _mm256_add_ps(e, o), tot);
}

static AI2 __m256 half_d(const uint8_t *blk, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
}
static AI2 __m256 half_m(int type, const uint8_t *blk, int h) {
    return type == T_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)))
                          : _mm256_setzero_ps();
}

/* 8 outputs (o0 .. o0 + 7 of y's row, nv of them valid) + bias */
static AI2 void store8(__m256 t, const float *bias, float *y, int nv) {
    if (nv >= 8) {
        if (bias) t = _mm256_add_ps(t, _mm256_loadu_ps(bias));
        _mm256_storeu_ps(y, t);
        return;
    }
    float tt[8];
    _mm256_storeu_ps(tt, t);
    for (int j = 0; j < nv; j++) y[j] = bias ? tt[j] + bias[j] : tt[j];
}

/* MR (1 or 2) rows x one panel (both halves of 8 outputs), codes converted in registers, both
 * parities' chains live; nout = valid outputs from the panel's first */
static AI2 void ftile(int type, int MR, const float *x, const float *sx, int K, const uint8_t *pan, const float *bias,
                      float *y, int ldy, int nout) {
    const int nb = K / QK, pb = panel_block_bytes(type);
    __m256 tot[2][2];
    for (int r = 0; r < MR; r++) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 ae[2][2], ao[2][2];
        const uint8_t *blk = pan + (size_t)b * pb;
        prefetch_block(blk, pb);
        for (int r = 0; r < MR; r++) ae[r][0] = ae[r][1] = ao[r][0] = ao[r][1] = _mm256_setzero_ps();
        for (int kk = 0; kk < QK; kk += 2) {
            const int k = b * QK + kk;
            for (int h = 0; h < 2; h++) {
                __m256 e, o;
                pair_codes8(type, blk, kk, h, &e, &o);
                for (int r = 0; r < MR; r++) {
                    ae[r][h] = _mm256_fmadd_ps(e, _mm256_broadcast_ss(x + (size_t)r * K + k), ae[r][h]);
                    ao[r][h] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(x + (size_t)r * K + k + 1), ao[r][h]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = half_d(blk, h), m = half_m(type, blk, h);
            for (int r = 0; r < MR; r++) tot[r][h] = finish8(type, d, m, ae[r][h], ao[r][h], sx[r * nb + b], tot[r][h]);
        }
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < MR; r++)
            store8(tot[r][h], bias ? bias + 8 * h : NULL, y + (size_t)r * ldy + 8 * h, nout - 8 * h);
}

#define FT(TY, MR)                                                                                          \
static void ft_##TY##_##MR(const float *x, const float *sx, int K, const uint8_t *pan, const float *bias,  \
                           float *y, int ldy, int nout) {                                                  \
    ftile(TY, MR, x, sx, K, pan, bias, y, ldy, nout);                                                       \
}
FT(3, 1) FT(3, 2) FT(8, 1) FT(8, 2)
typedef void (*ft_fn)(const float *, const float *, int, const uint8_t *, const float *, float *, int, int);
/* [type is Q8_0][rows]: a whole panel (both halves) a tile */
static const ft_fn FTILES[2][3] = {{0, ft_3_1, ft_3_2}, {0, ft_8_1, ft_8_2}};

/* column k of half h (rows 8h..8h+7) of a panel block as fp32 codes: pair_codes8's e (k even) or o
 * (k odd), the same values */
static AI2 __m256 col_codes8(int type, const uint8_t *blk, int k, int h) {
    if (type == T_Q4_1) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 64 + (k >> 1) * 16 + 8 * h)));
        return _mm256_cvtepi32_ps(k & 1 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 32 + k * 16 + 8 * h))));
}

/* MR (3..6) rows x one panel (16 outputs), for 3..G2_MAX_ROWS rows (verification's k + 1, short
 * prefill chunks): per block the even columns' chains of all MR x 16 outputs first, parked, then
 * the odd columns', then the block's finish: the same chains and finish as ftile, so the same bits.
 * Per column the panel's two code vectors are converted once and used by every row, and each row's
 * broadcast x by both halves: MR + 2 loads per 2 MR fused multiply-adds, 2 MR chains. (ftile keeps
 * both parities' chains live, so at 5 rows it has room for one half panel only: a broadcast per
 * fused multiply-add, and the loads, not the FMAs, set its pace: ~58 GFLOP/s here against ~66.) */
static AI2 void gtile(int type, int MR, const float *x, const float *sx, int K, const uint8_t *pan, const float *bias,
                      float *y, int ldy, int nout) {
    const int nb = K / QK, pb = panel_block_bytes(type);
    __m256 tot[6][2], ev[6][2];
    for (int r = 0; r < MR; r++) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        kv_side_prefetch();
        const uint8_t *blk = pan + (size_t)b * pb;
        const float *xb = x + b * QK;
        prefetch_block(blk, pb);
        #pragma GCC unroll 2
        for (int par = 0; par < 2; par++) {
            /* the odd pass loads its code bytes again: without this barrier GCC copies every
             * block's bytes once for both passes through general registers to the stack (~1.4x
             * slower) */
            __asm__ volatile("" ::: "memory");
            __m256 a[6][2];
            for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
            /* up to 5 rows the next column's codes are converted before this column's FMAs (2 more
             * registers; 6 rows would spill, 1.38x slower): 2-3 % faster at 3-5 and 9 rows */
            __m256 n0 = col_codes8(type, blk, par, 0), n1 = col_codes8(type, blk, par, 1);
            #pragma GCC unroll 16
            for (int k = par; k < QK; k += 2) {
                __m256 c0 = n0, c1 = n1;
                if (MR > 5) c0 = col_codes8(type, blk, k, 0), c1 = col_codes8(type, blk, k, 1);
                else if (k + 2 < QK) n0 = col_codes8(type, blk, k + 2, 0), n1 = col_codes8(type, blk, k + 2, 1);
                for (int r = 0; r < MR; r++) {
                    const __m256 xv = _mm256_broadcast_ss(xb + (size_t)r * K + k);
                    a[r][0] = _mm256_fmadd_ps(c0, xv, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(c1, xv, a[r][1]);
                }
            }
            if (par == 0) {
                for (int r = 0; r < MR; r++) ev[r][0] = a[r][0], ev[r][1] = a[r][1];
            } else
                for (int h = 0; h < 2; h++) {
                    const __m256 d = half_d(blk, h), m = half_m(type, blk, h);
                    for (int r = 0; r < MR; r++)
                        tot[r][h] = finish8(type, d, m, ev[r][h], a[r][h], sx[r * nb + b], tot[r][h]);
                }
        }
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < MR; r++)
            store8(tot[r][h], bias ? bias + 8 * h : NULL, y + (size_t)r * ldy + 8 * h, nout - 8 * h);
}

#define GT(TY, MR)                                                                                         \
static void gt_##TY##_##MR(const float *x, const float *sx, int K, const uint8_t *pan, const float *bias,  \
                           float *y, int ldy, int nout) {                                                  \
    gtile(TY, MR, x, sx, K, pan, bias, y, ldy, nout);                                                      \
}
GT(3, 3) GT(3, 4) GT(3, 5) GT(3, 6) GT(8, 3) GT(8, 4) GT(8, 5) GT(8, 6)
typedef void (*gt_fn)(const float *, const float *, int, const uint8_t *, const float *, float *, int, int);
/* [type is Q8_0][rows] */
static const gt_fn GTILES[2][7] = {{0, 0, 0, gt_3_3, gt_3_4, gt_3_5, gt_3_6}, {0, 0, 0, gt_8_3, gt_8_4, gt_8_5, gt_8_6}};
/* G2_MAX_ROWS: the last row count gtile runs by default; the scratch path (below) takes more. A
 * whole pass of the default model's Linears, 1 thread on an AVX2 Zen 3, gtile / scratch: 0.80x at 9
 * rows, 0.87x at 16, 0.97x at 24, 0.99x at 32, 1.02x at 64, 1.03x at 128. On a Zen 4 (the AVX2
 * build, scripts/qlinear_ab.py): 0.81-0.82x at 9, 0.88-0.89x at 16, but 1.03-1.05x at 24 and
 * 1.02-1.03x at 32; so the library measures where the scratch takes over (tune_scratch_rows).
 * G2_TILE_ROWS: the most rows a tile (2 x G2_TILE_ROWS accumulators); 5 was 1.05-1.14x slower than
 * 6 at 6, 12 and 16 rows. */
#ifndef G2_TILE_ROWS
#define G2_TILE_ROWS 6
#endif

/* rows 0..M-1 (3 to scratch_rows - 1) over panels [p0, p1) in gtile's tiles: the rows split into
 * ceil(M / G2_TILE_ROWS) tiles as even as can be (7 = 4 + 3, 9 = 5 + 4), each over a group of F2_PG
 * panels in turn (they stay in L2 for the next tile) */
static void g2_register(int type, const float *x, const float *sx, int M, int K, const uint8_t *panels, size_t pstride,
                        int N, const float *bias, float *y, int p0, int p1) {
    const int q8 = type == T_Q8_0, nb = K / QK, nt = (M + G2_TILE_ROWS - 1) / G2_TILE_ROWS;
    for (int g0 = p0; g0 < p1; g0 += F2_PG) {
        const int g1 = g0 + F2_PG < p1 ? g0 + F2_PG : p1;
        for (int t = 0, r0 = 0; t < nt; t++) {
            const int mr = share_size(M, nt, t);
            for (int p = g0; p < g1; p++)
                GTILES[q8][mr](x + (size_t)r0 * K, sx + (size_t)r0 * nb, K, panels + p * pstride,
                               bias ? bias + p * NR : NULL, y + (size_t)r0 * N + p * NR, N, N - p * NR);
            r0 += mr;
        }
    }
}

/* 1 or 2 rows over panels [p0, p1) in ftile's tiles, a whole panel each: one stream of blocks. Two
 * panels a tile for 1 row (4 half panels, each broadcast x shared by more FMAs) ran at 0.6-0.75x
 * this on a Zen 4 where the weights come from memory (a 49152 x 576 matrix, 1 thread; 1.07x where
 * they stay in L2), and half a panel a tile at 0.75-0.87x. */
static void f2_register(int type, const float *x, const float *sx, int M, int K, const uint8_t *panels, size_t pstride,
                        int N, const float *bias, float *y, int p0, int p1) {
    for (int p = p0; p < p1; p++)
        FTILES[type == T_Q8_0][M](x, sx, K, panels + p * pstride, bias ? bias + p * NR : NULL, y + p * NR, N,
                                  N - p * NR);
}

/* From scratch_rows rows (prefill chunks; G2_MAX_ROWS + 1 by default) a panel's codes are converted
 * once into an fp32 scratch (per block: d[16], m[16], the even columns' codes [16][16], the odd
 * columns' [16][16]; Q4_1's odd codes q, exactly the register path's values) and 6-row x 16-output
 * tiles read it like linear.c's: the even chains of a block first (12 accumulators), parked in memory, then the odd
 * chains, then the block's finish into the running totals. The same fp32 values and the same
 * chains as the register path, so the same bits for every row, whatever the row count. At 256 rows
 * on an AVX2 Zen 3 this runs at ~0.89x the fp32-widening tiles (linear.c's order) that AVX2 ran
 * before: the block's finish (d s, the two fused multiply-adds) adds 3 FMA-port operations per 32
 * chain FMAs, which that order did not need. Grouping blocks so their codes stay in L1 was slower. */
#ifndef F2_SROWS
#define F2_SROWS 6      /* rows per scratch tile (12 accumulators; 3 and 4 were 0.6-0.7x of 6 at 64-256 rows) */
#endif
#define F2_SB 544       /* scratch floats per block */

static void f2_convert_panel(int type, const uint8_t *pan, int nb, float *sc) {
    const int pb = panel_block_bytes(type);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = pan + (size_t)b * pb;
        float *s = sc + (size_t)b * F2_SB;
        for (int h = 0; h < 2; h++) {
            _mm256_storeu_ps(s + 8 * h, half_d(blk, h));
            _mm256_storeu_ps(s + 16 + 8 * h, half_m(type, blk, h));
            for (int i = 0; i < QK / 2; i++) {
                __m256 e, o;
                pair_codes8(type, blk, 2 * i, h, &e, &o);
                _mm256_storeu_ps(s + 32 + i * 16 + 8 * h, e);
                _mm256_storeu_ps(s + 288 + i * 16 + 8 * h, o);
            }
        }
    }
}

static AI2 void stile2(int type, int MR, const float *x, const float *sx, int K, const float *sc, const float *bias,
                       float *y, int ldy, int nout) {
    const int nb = K / QK;
    __m256 tot[6][2];
    float ev[6][16] __attribute__((aligned(32)));
    for (int r = 0; r < MR; r++) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        kv_side_prefetch();
        const float *s = sc + (size_t)b * F2_SB, *xb = x + b * QK;
        __m256 a[6][2];
        for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int i = 0; i < QK / 2; i++) {
            const __m256 w0 = _mm256_loadu_ps(s + 32 + i * 16), w1 = _mm256_loadu_ps(s + 40 + i * 16);
            for (int r = 0; r < MR; r++) {
                const __m256 xv = _mm256_broadcast_ss(xb + (size_t)r * K + 2 * i);
                a[r][0] = _mm256_fmadd_ps(w0, xv, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w1, xv, a[r][1]);
            }
        }
        for (int r = 0; r < MR; r++) {
            _mm256_store_ps(ev[r], a[r][0]);
            _mm256_store_ps(ev[r] + 8, a[r][1]);
            a[r][0] = a[r][1] = _mm256_setzero_ps();
        }
        for (int i = 0; i < QK / 2; i++) {
            const __m256 w0 = _mm256_loadu_ps(s + 288 + i * 16), w1 = _mm256_loadu_ps(s + 296 + i * 16);
            for (int r = 0; r < MR; r++) {
                const __m256 xv = _mm256_broadcast_ss(xb + (size_t)r * K + 2 * i + 1);
                a[r][0] = _mm256_fmadd_ps(w0, xv, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w1, xv, a[r][1]);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_loadu_ps(s + 8 * h), m = _mm256_loadu_ps(s + 16 + 8 * h);
            for (int r = 0; r < MR; r++)
                tot[r][h] = finish8(type, d, m, _mm256_load_ps(ev[r] + 8 * h), a[r][h], sx[r * nb + b], tot[r][h]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int h = 0; h < 2; h++)
            store8(tot[r][h], bias ? bias + 8 * h : NULL, y + (size_t)r * ldy + 8 * h,
                   nout - 8 * h);
}

#define STL(TY, MR)                                                                                        \
static void stl_##TY##_##MR(const float *x, const float *sx, int K, const float *sc, const float *bias,   \
                            float *y, int ldy, int nout) {                                                 \
    stile2(TY, MR, x, sx, K, sc, bias, y, ldy, nout);                                                      \
}
STL(3, 1) STL(3, 2) STL(3, 3) STL(3, 4) STL(3, 5) STL(3, 6) STL(8, 1) STL(8, 2) STL(8, 3) STL(8, 4) STL(8, 5) STL(8, 6)
typedef void (*stl_fn)(const float *, const float *, int, const float *, const float *, float *, int, int);
static const stl_fn STILES2[2][7] = {{0, stl_3_1, stl_3_2, stl_3_3, stl_3_4, stl_3_5, stl_3_6},
                                     {0, stl_8_1, stl_8_2, stl_8_3, stl_8_4, stl_8_5, stl_8_6}};

/* rows 0..M-1 over panels [p0, p1) through the scratch (sc: nb * F2_SB floats) */
static void f2_scratch(int type, const float *x, const float *sx, int M, int K, const uint8_t *panels,
                       size_t pstride, int N, const float *bias, float *y, int p0, int p1, float *sc) {
    const int q8 = type == T_Q8_0, nb = K / QK;
    for (int p = p0; p < p1; p++) {
        f2_convert_panel(type, panels + p * pstride, nb, sc);
        for (int r0 = 0; r0 < M; r0 += F2_SROWS) {
            const int mr = M - r0 < F2_SROWS ? M - r0 : F2_SROWS;
            STILES2[q8][mr](x + (size_t)r0 * K, sx + (size_t)r0 * nb, K, sc, bias ? bias + p * NR : NULL,
                            y + (size_t)r0 * N + p * NR, N, N - p * NR);
        }
    }
}

static int qlinear_factorized2(int type, const float *x, int M, int K, const uint8_t *panels, int N, const float *bias,
                               float *y, int n_threads, kv_side_plan *side) {
    const int np = (N + NR - 1) / NR, nb = K / QK, q8 = type == T_Q8_0;
    const size_t pstride = (size_t)nb * panel_block_bytes(type);
    float *sx = kv_alloc(sizeof(float) * (size_t)M * nb);
    if (!sx) return -3;
    #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        kv_block_sums(x, M, K, sx, !q8);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = share_start(np, nt, t), p1 = share_start(np, nt, t + 1);
        float *sc = M >= scratch_rows ? kv_alloc(sizeof(float) * (size_t)nb * F2_SB) : NULL;
        side_enter(side, t);
        if (sc) f2_scratch(type, x, sx, M, K, panels, pstride, N, bias, y, p0, p1, sc);
        else if (M >= 3) g2_register(type, x, sx, M, K, panels, pstride, N, bias, y, p0, p1);
        else f2_register(type, x, sx, M, K, panels, pstride, N, bias, y, p0, p1);
        side_enter(NULL, 0);
        free(sc);
    }
    free(sx);
    return 0;
}
#endif

#ifdef QL_AVX2
static int qlinear_fact(int type, const float *x, int M, int K, const uint8_t *panels, int N, float *y) {
#ifdef QL_AVX512
    return qlinear_factorized(type, x, M, K, panels, N, NULL, y, 1, NULL);
#else
    return qlinear_factorized2(type, x, M, K, panels, N, NULL, y, 1, NULL);
#endif
}

/* 1 when M rows run faster with scratch_rows = b than with a, on a synthetic Q4_1 weight (256 x
 * 576, 1 thread; the two settings alternating, best of 5 rounds of 4 calls each) */
static int setting_b_faster(int M, int a, int b) {
    enum { N = 256, K = 576, MMAX = 32, NB = K / QK };
    const size_t bytes = (size_t)(N / NR) * NB * 320;
    uint8_t *pan = aligned_alloc(64, bytes);
    float *x = aligned_alloc(64, sizeof(float) * MMAX * K), *y = aligned_alloc(64, sizeof(float) * MMAX * N);
    int faster = 0;
    if (pan && x && y && M <= MMAX) {
        uint32_t r = 12345;
        for (size_t i = 0; i < bytes; i++) { r = r * 1664525u + 1013904223u; pan[i] = (uint8_t)(r >> 24); }
        for (size_t o = 0; o < bytes; o += 320)        /* finite scales: fp16 1/64 and -1/8 */
            for (int j = 0; j < 16; j++) { pan[o + 2 * j] = 0x00; pan[o + 2 * j + 1] = 0x24;
                                           pan[o + 32 + 2 * j] = 0x00; pan[o + 33 + 2 * j] = 0xB0; }
        for (int i = 0; i < M * K; i++) { r = r * 1664525u + 1013904223u; x[i] = (float)(r >> 8) / 16777216.f - .5f; }
        const int modes[2] = {a, b};
        double best[2] = {1e30, 1e30};
        for (int round = 0; round < 5; round++)
            for (int i = 0; i < 2; i++) {
                scratch_rows = modes[i];
                qlinear_fact(T_Q4_1, x, M, K, pan, N, y);
                const double t0 = omp_get_wtime();
                for (int rep = 0; rep < 4; rep++) qlinear_fact(T_Q4_1, x, M, K, pan, N, y);
                const double dt = omp_get_wtime() - t0;
                if (dt < best[i]) best[i] = dt;
            }
        faster = best[1] < best[0];
    }
    free(pan);
    free(x);
    free(y);
    return faster;
}

/* The row count from which the scratch path runs, measured. AVX-512: from SCRATCH_ROWS, or never
 * (the register path at every row count), by 32 rows. AVX2: the register path (gtile) beats the
 * scratch at 9-16 rows on Zen 3 and Zen 4, loses at 24 and 32 rows on Zen 4 (0.95-0.97x) and not
 * on Zen 3; so from 24 rows if the scratch wins there, else from 32 if it wins there, else from
 * G2_MAX_ROWS + 1. */
static int tune_scratch_rows(void) {
#ifdef QL_AVX512
    return setting_b_faster(32, SCRATCH_ROWS, INT_MAX) ? INT_MAX : SCRATCH_ROWS;
#else
    if (setting_b_faster(24, SCRATCH_DEFAULT, 24)) return 24;
    return setting_b_faster(32, SCRATCH_DEFAULT, 32) ? 32 : SCRATCH_DEFAULT;
#endif
}
#endif

/* From how many rows the factorized Q4_1 / Q8_0 kernel converts codes once into the scratch
 * buffer: rows > 0 sets it, 0 measures both paths here and keeps the faster, -1 only reads it.
 * Returns the setting (INT_MAX: the register path at every row count; 0: no such choice in this
 * build). */
int kvscope_qlinear_scratch_rows(int rows) {
#ifdef QL_AVX2
    if (rows > 0) scratch_rows = rows;
    else if (rows == 0) scratch_rows = tune_scratch_rows();
    return scratch_rows;
#else
    (void)rows;
    return 0;
#endif
}

/* the vector path this build runs ("AVX-512", "AVX2" or "scalar"); KVSCOPE_ISA=avx2 builds the
 * AVX2 one on an AVX-512 CPU (engine/model/cpu_kernels.py) */
const char *kvscope_isa(void) {
#if defined(QL_AVX512)
    return "AVX-512";
#elif defined(QL_AVX2)
    return "AVX2";
#else
    return "scalar";
#endif
}

/* 1: this build's kernel for `type` sums the widened weights in linear.c's order (bitwise the fp32
 * kernel's outputs); 0: it factorizes by block (the same value up to fp32 rounding); -1: no kernel */
int kvscope_qlinear_bitwise(int type) {
    if (!panel_block_bytes(type)) return -1;
#ifdef QL_AVX2
    if (type == T_Q4_1 || type == T_Q8_0) return 0;
#endif
    return 1;
}

/* panel p of every row through the scratch buffer and linear.c's tiles */
static void panel_via_scratch(int type, const float *x, int M, int K, const uint8_t *pan, const float *bias,
                              float *y, int N, int nvalid, float *scratch) {
    const int nb = K / QK, pb = panel_block_bytes(type);
    for (int b = 0; b < nb; b++) widen_block(type, pan + (size_t)b * pb, scratch + (size_t)b * QK * NR);
    kvscope_linear_panel(x, M, K, scratch, bias, y, N, nvalid);
}

/* y [M, N] = x [M, K] . W^T + bias; returns 0, or -1 for bad sizes / type, -3 out of memory */
int kvscope_qlinear(int type, const float *x, int M, int K, const uint8_t *panels, int N, const float *bias, float *y,
                    int n_threads) {
    return kvscope_qlinear_side(type, x, M, K, panels, N, bias, y, n_threads, NULL);
}

/* kvscope_qlinear, prefetching `side`'s K/V as it goes where Q4_1 / Q8_0 run factorized (layer.c) */
int kvscope_qlinear_side(int type, const float *x, int M, int K, const uint8_t *panels, int N, const float *bias,
                         float *y, int n_threads, kv_side_plan *side) {
    const int pb = panel_block_bytes(type);
    if (!pb || M < 0 || N < 1 || K < QK || K % QK) return -1;
    if (M == 0) return 0;
    const int np = (N + NR - 1) / NR, nb = K / QK;
    const size_t pstride = (size_t)nb * pb;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > np) n_threads = np;
    int rc = 0;
    if (type == T_Q4_1 && kvscope_amx_takes(M)) return kvscope_amx_qlinear(x, M, K, panels, N, bias, y, n_threads);
#ifdef QL_AVX512
    if (type == T_Q4_1 || type == T_Q8_0) return qlinear_factorized(type, x, M, K, panels, N, bias, y, n_threads, side);
#elif defined(QL_AVX2)
    if (type == T_Q4_1 || type == T_Q8_0) return qlinear_factorized2(type, x, M, K, panels, N, bias, y, n_threads, side);
#endif
#ifdef QL_AVX2
    const qt_fn *tiles = type == T_Q4_1 ? QT4 : type == T_Q8_0 ? QT8 : type == T_F16 ? QTF16 : QTBF16;
    if (M == 1) {
        const qt_fn g4 = type == T_Q4_1 ? qt_3_1_4 : type == T_Q8_0 ? qt_8_1_4 : type == T_F16 ? qt_1_1_4 : qt_30_1_4;
        const qt_fn g2 = type == T_Q4_1 ? qt_3_1_2 : type == T_Q8_0 ? qt_8_1_2 : type == T_F16 ? qt_1_1_2 : qt_30_1_2;
        #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int p1 = share_start(np, nt, t + 1);
            int p = share_start(np, nt, t);
            for (; p + 4 <= p1 && (p + 4) * NR <= N; p += 4)
                g4(x, K, panels + p * pstride, bias ? bias + p * NR : NULL, y + p * NR, N, NR);
            for (; p + 2 <= p1 && (p + 2) * NR <= N; p += 2)
                g2(x, K, panels + p * pstride, bias ? bias + p * NR : NULL, y + p * NR, N, NR);
            for (; p < p1; p++)
                tiles[1](x, K, panels + p * pstride, bias ? bias + p * NR : NULL, y + p * NR, N,
                         N - p * NR < NR ? N - p * NR : NR);
        }
        return 0;
    }
    if (M <= 6) {
        #pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
        for (int p = 0; p < np; p++)
            tiles[M](x, K, panels + p * pstride, bias ? bias + p * NR : NULL, y + p * NR, N,
                     N - p * NR < NR ? N - p * NR : NR);
        return 0;
    }
#endif
    #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        float *scratch = kv_alloc((size_t)K * NR * sizeof(float));
        if (!scratch) {
            #pragma omp atomic write
            rc = -3;
        }
        #pragma omp for schedule(static)
        for (int p = 0; p < np; p++)
            if (scratch)
                panel_via_scratch(type, x, M, K, panels + p * pstride, bias ? bias + p * NR : NULL, y + p * NR, N,
                                  N - p * NR < NR ? N - p * NR : NR, scratch);
        free(scratch);
    }
    return rc;
}
