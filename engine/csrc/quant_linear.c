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
 *        then for k = 0..31 eight bytes, byte j = row j's nibble | row j+8's nibble << 4;
 *   Q8_0 panel block (544 bytes = 34 per 32 weights): d[16] fp16, then for k = 0..31 16 int8.
 * F16 / BF16 (and Q4_1 / Q8_0 on CPUs without AVX-512): each weight is widened to fp32 in
 * registers with exactly the dequantizer's arithmetic, and the outputs are accumulated in exactly
 * linear.c's order (16 outputs in vector lanes, blocks of KB terms, each block's fused
 * multiply-add chain added to a running total). So every output is bitwise the fp32 packed
 * kernel's on the de-quantized weight, for any row count. Up to 6 rows: weights widened once per
 * column and used by every row. More rows: a panel is widened into a scratch buffer and linear.c's
 * tiles run over it (kvscope_linear_panel).
 *
 * Q4_1 / Q8_0 with AVX-512: the sum is factorized by block, as the block's scale is common to its
 * 32 weights: sum_k (d q_k + m) x_k = d * sum_k q_k x_k + m * sum_k x_k, so the codes are only
 * converted to fp32 and multiplied by x (no dequantizing multiply-add per weight), and sum_k x_k
 * is computed once per row and block for every output. That is the same value up to fp32
 * rounding, not bitwise the fp32 kernel's (kvscope_qlinear_bitwise says which a type gets; the
 * engine checks the bound when it packs a model). The order is fixed per output whatever the row
 * count or the tile: per block, the even and the odd columns each in a left-to-right fused
 * multiply-add chain from zero, their sum s, then (Q4_1) t = fma(m, sum x, d * s) or (Q8_0)
 * fma(d, s, total), t added to the running total block after block; so a row's result does not
 * depend on its batch either.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

typedef float v8 __attribute__((vector_size(32)));

void kvscope_linear_panel(const float *x, int M, int K, const float *panel, const float *bias, float *y, int ldy,
                          int nvalid);

static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

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
                        dst[64 + k * 8 + (j & 7)] |= (uint8_t)(j < 8 ? q : q << 4);
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
                const uint8_t byte = blk[64 + k * 8 + (j & 7)];
                const float q = (float)(j < 8 ? byte & 15 : byte >> 4);
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
        /* rows 8..15 sit in the high nibbles: their q is read as 16 q and d scaled by 1/16, and
         * (d / 16) (16 q) rounds to exactly d q (powers of two scale exactly; d / 16 >= 2^-28 stays
         * normal in fp32) */
        c.d1 = _mm256_mul_ps(c.d1, _mm256_set1_ps(0.0625f));
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
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c->q + k * 8)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xf0)));
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
        st8(w + k * NR, w0);
        st8(w + k * NR + 8, w1);
    }
}

/* MR rows x P consecutive panels, widened in registers; linear.c's tile order per output */
static inline __attribute__((always_inline)) void qtile(int type, int MR, int P, const float *x, int K,
                                                        const uint8_t *pan, const float *bias, float *y, int ldy,
                                                        int nvalid_last) {
    const int nb = K / QK, pb = panel_block_bytes(type);
    v8 a0[6][4], a1[6][4], t0[6][4], t1[6][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < P; q++) { t0[r][q] = splat8(0.f); t1[r][q] = splat8(0.f); }
    for (int kb = 0; kb < K; kb += KB) {
        const int ke = kb + KB < K ? kb + KB : K;
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < P; q++) { a0[r][q] = splat8(0.f); a1[r][q] = splat8(0.f); }
        for (int b = kb / QK; b < ke / QK; b++) {
            bconst c[4];
            for (int q = 0; q < P; q++) c[q] = block_consts(type, pan + ((size_t)q * nb + b) * pb);
            for (int kk = 0; kk < QK; kk++) {
                const int k = b * QK + kk;
                for (int q = 0; q < P; q++) {
                    v8 w0, w1;
                    widen_col(type, &c[q], kk, &w0, &w1);
                    for (int r = 0; r < MR; r++) {
                        const v8 xb = splat8(x[(size_t)r * K + k]);
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
            if (bias) { t0[r][q] += ld8(bb); t1[r][q] += ld8(bb + 8); }
            float *o = y + (size_t)r * ldy + q * NR;
            if (nvalid == NR) { st8(o, t0[r][q]); st8(o + 8, t1[r][q]); }
            else {
                float t[NR];
                st8(t, t0[r][q]); st8(t + 8, t1[r][q]);
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

#ifdef QL_AVX512
#define QL_PREFETCH 4 /* blocks ahead, per panel (the next rows of a stream the hardware may not see) */
#define FMR 4         /* rows per tile */

/* one row's broadcasts for the Q4_1 tile: xp[8 k .. 8 k + 15] = x[k] eight times then x[k + 1]
 * eight times (k even: the lanes of a column pair), and sx[b] = block b's 32 x, left to right */
static void row_pairs(const float *x, int K, float *xp, float *sx) {
    for (int k = 0; k < K; k += 2)
        _mm512_storeu_ps(xp + (size_t)k * 8, _mm512_insertf32x8(_mm512_set1_ps(x[k]), _mm256_set1_ps(x[k + 1]), 1));
    for (int b = 0; b < K / QK; b++) {
        float t = 0.f;
        for (int k = 0; k < QK; k++) t += x[b * QK + k];
        sx[b] = t;
    }
}

static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *blk, int pb) {
    for (int o = 0; o < pb; o += 64) __builtin_prefetch(blk + (size_t)QL_PREFETCH * pb + o);
}

static inline __attribute__((always_inline)) void store_tile(int MR, int P, __m512 tot[FMR][4], const float *bias,
                                                             float *y, int ldy, int nvalid_last) {
    for (int q = 0; q < P; q++) {
        const int nvalid = q == P - 1 ? nvalid_last : NR;
        const __mmask16 mask = (__mmask16)((1u << nvalid) - 1);
        const __m512 bb = bias ? _mm512_maskz_loadu_ps(mask, bias + q * NR) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const __m512 o = bias ? _mm512_add_ps(tot[r][q], bb) : tot[r][q];
            _mm512_mask_storeu_ps(y + (size_t)r * ldy + q * NR, mask, o);
        }
    }
}

/* MR rows x P consecutive Q4_1 panels. A column pair's 16 code bytes widen to 16 lanes: lanes
 * 0-7 the pair's first column for rows 0-7 (low nibbles) or 8-15 (high nibbles, read as 16 q and
 * scaled by 1/16 at the block's end, exactly), lanes 8-15 its second column. */
static inline __attribute__((always_inline)) void f4tile(int MR, int P, const float *xp, const float *sx, int K,
                                                         const uint8_t *pan, size_t pstride, const float *bias,
                                                         float *y, int ldy, int nvalid_last) {
    const int nb = K / QK, pb = 320;
    const size_t xs = (size_t)K * 8;
    const __m512i m_lo = _mm512_set1_epi32(0x0f), m_hi = _mm512_set1_epi32(0xf0);
    __m512 tot[FMR][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < P; q++) tot[r][q] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 alo[FMR][4], ahi[FMR][4];
        const uint8_t *blk[4];
        for (int q = 0; q < P; q++) {
            blk[q] = pan + q * pstride + (size_t)b * pb;
            prefetch_block(blk[q], pb);
            for (int r = 0; r < MR; r++) { alo[r][q] = _mm512_setzero_ps(); ahi[r][q] = _mm512_setzero_ps(); }
        }
        for (int kk = 0; kk < QK; kk += 2) {
            __m512 xv[FMR];
            for (int r = 0; r < MR; r++) xv[r] = _mm512_loadu_ps(xp + r * xs + (size_t)(b * QK + kk) * 8);
            for (int q = 0; q < P; q++) {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk[q] + 64 + kk * 8)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, m_lo));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_and_si512(v, m_hi));
                for (int r = 0; r < MR; r++) {
                    alo[r][q] = _mm512_fmadd_ps(lo, xv[r], alo[r][q]);
                    ahi[r][q] = _mm512_fmadd_ps(hi, xv[r], ahi[r][q]);
                }
            }
        }
        for (int q = 0; q < P; q++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk[q]));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[q] + 32)));
            for (int r = 0; r < MR; r++) {
                const __m256 slo = _mm256_add_ps(_mm512_castps512_ps256(alo[r][q]), _mm512_extractf32x8_ps(alo[r][q], 1));
                const __m256 shi = _mm256_mul_ps(
                    _mm256_add_ps(_mm512_castps512_ps256(ahi[r][q]), _mm512_extractf32x8_ps(ahi[r][q], 1)),
                    _mm256_set1_ps(0.0625f));
                const __m512 sum = _mm512_insertf32x8(_mm512_castps256_ps512(slo), shi, 1);
                const __m512 t = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), _mm512_mul_ps(d, sum));
                tot[r][q] = _mm512_add_ps(tot[r][q], t);
            }
        }
    }
    store_tile(MR, P, tot, bias, y, ldy, nvalid_last);
}

/* MR rows x P consecutive Q8_0 panels: a column's 16 int8 codes widen to 16 lanes (rows 0-15) */
static inline __attribute__((always_inline)) void f8tile(int MR, int P, const float *x, int K, const uint8_t *pan,
                                                         size_t pstride, const float *bias, float *y, int ldy,
                                                         int nvalid_last) {
    const int nb = K / QK, pb = 544;
    __m512 tot[FMR][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < P; q++) tot[r][q] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 ae[FMR][4], ao[FMR][4];
        const uint8_t *blk[4];
        for (int q = 0; q < P; q++) {
            blk[q] = pan + q * pstride + (size_t)b * pb;
            prefetch_block(blk[q], pb);
            for (int r = 0; r < MR; r++) { ae[r][q] = _mm512_setzero_ps(); ao[r][q] = _mm512_setzero_ps(); }
        }
        for (int kk = 0; kk < QK; kk += 2) {
            const int k = b * QK + kk;
            for (int q = 0; q < P; q++) {
                const uint8_t *c = blk[q] + 32 + kk * 16;
                const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
                const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
                for (int r = 0; r < MR; r++) {
                    ae[r][q] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[(size_t)r * K + k]), ae[r][q]);
                    ao[r][q] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[(size_t)r * K + k + 1]), ao[r][q]);
                }
            }
        }
        for (int q = 0; q < P; q++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk[q]));
            for (int r = 0; r < MR; r++) tot[r][q] = _mm512_fmadd_ps(d, _mm512_add_ps(ae[r][q], ao[r][q]), tot[r][q]);
        }
    }
    store_tile(MR, P, tot, bias, y, ldy, nvalid_last);
}

#define FT(MR, P)                                                                                   \
static void f4_##MR##_##P(const float *xp, const float *sx, const float *x, int K, const uint8_t *pan,  \
                          size_t ps, const float *bias, float *y, int ldy, int nv) {                \
    (void)x; f4tile(MR, P, xp, sx, K, pan, ps, bias, y, ldy, nv);                                   \
}                                                                                                   \
static void f8_##MR##_##P(const float *xp, const float *sx, const float *x, int K, const uint8_t *pan,  \
                          size_t ps, const float *bias, float *y, int ldy, int nv) {                \
    (void)xp; (void)sx; f8tile(MR, P, x, K, pan, ps, bias, y, ldy, nv);                             \
}
FT(1, 4) FT(1, 1) FT(2, 2) FT(2, 1) FT(3, 2) FT(3, 1) FT(4, 2) FT(4, 1)
typedef void (*ft_fn)(const float *, const float *, const float *, int, const uint8_t *, size_t, const float *, float *,
                      int, int);
static const ft_fn F4[2][FMR + 1] = {{0, f4_1_1, f4_2_1, f4_3_1, f4_4_1}, {0, f4_1_4, f4_2_2, f4_3_2, f4_4_2}};
static const ft_fn F8[2][FMR + 1] = {{0, f8_1_1, f8_2_1, f8_3_1, f8_4_1}, {0, f8_1_4, f8_2_2, f8_3_2, f8_4_2}};

static int qlinear_factorized(int type, const float *x, int M, int K, const uint8_t *panels, int N, const float *bias,
                              float *y, int n_threads) {
    const int np = (N + NR - 1) / NR, nb = K / QK;
    const size_t pstride = (size_t)nb * panel_block_bytes(type);
    const ft_fn(*tiles)[FMR + 1] = type == T_Q4_1 ? F4 : F8;
    int rc = 0;
    #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((long long)np * t / nt), p1 = (int)((long long)np * (t + 1) / nt);
        float *xp = NULL, *sx = NULL;
        if (type == T_Q4_1) {
            xp = malloc((size_t)FMR * K * 8 * sizeof(float));
            sx = malloc((size_t)FMR * nb * sizeof(float));
        }
        if (type == T_Q4_1 && (!xp || !sx)) {
            #pragma omp atomic write
            rc = -3;
        } else
            for (int r0 = 0; r0 < M; r0 += FMR) {
                const int mr = M - r0 < FMR ? M - r0 : FMR, wide = mr == 1 ? 4 : 2;
                const float *xr = x + (size_t)r0 * K;
                float *yr = y + (size_t)r0 * N;
                if (xp)
                    for (int r = 0; r < mr; r++) row_pairs(xr + (size_t)r * K, K, xp + (size_t)r * K * 8, sx + r * nb);
                int p = p0;
                for (; p + wide <= p1 && (p + wide) * NR <= N; p += wide)
                    tiles[1][mr](xp, sx, xr, K, panels + p * pstride, pstride, bias ? bias + p * NR : NULL, yr + p * NR,
                                 N, NR);
                for (; p < p1; p++)
                    tiles[0][mr](xp, sx, xr, K, panels + p * pstride, pstride, bias ? bias + p * NR : NULL, yr + p * NR,
                                 N, N - p * NR < NR ? N - p * NR : NR);
            }
        free(xp);
        free(sx);
    }
    return rc;
}
#endif

/* 1: this build's kernel for `type` sums the widened weights in linear.c's order (bitwise the fp32
 * kernel's outputs); 0: it factorizes by block (the same value up to fp32 rounding); -1: no kernel */
int kvscope_qlinear_bitwise(int type) {
    if (!panel_block_bytes(type)) return -1;
#ifdef QL_AVX512
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
    const int pb = panel_block_bytes(type);
    if (!pb || M < 0 || N < 1 || K < QK || K % QK) return -1;
    if (M == 0) return 0;
    const int np = (N + NR - 1) / NR, nb = K / QK;
    const size_t pstride = (size_t)nb * pb;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > np) n_threads = np;
    int rc = 0;
#ifdef QL_AVX512
    if (type == T_Q4_1 || type == T_Q8_0) return qlinear_factorized(type, x, M, K, panels, N, bias, y, n_threads);
#endif
#ifdef QL_AVX2
    const qt_fn *tiles = type == T_Q4_1 ? QT4 : type == T_Q8_0 ? QT8 : type == T_F16 ? QTF16 : QTBF16;
    if (M == 1) {
        const qt_fn g4 = type == T_Q4_1 ? qt_3_1_4 : type == T_Q8_0 ? qt_8_1_4 : type == T_F16 ? qt_1_1_4 : qt_30_1_4;
        const qt_fn g2 = type == T_Q4_1 ? qt_3_1_2 : type == T_Q8_0 ? qt_8_1_2 : type == T_F16 ? qt_1_1_2 : qt_30_1_2;
        #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int p1 = (int)((long long)np * (t + 1) / nt);
            int p = (int)((long long)np * t / nt);
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
        float *scratch = malloc((size_t)K * NR * sizeof(float));
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
