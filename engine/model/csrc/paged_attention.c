/* kvscope CPU kernel: decode attention read straight from the paged K/V pool.
 *
 * For each decode sequence s (one query token at row q_rows[s] of the flattened batch) and each
 * query head, attends over positions 0..ctx_lens[s]-1, whose keys/values live in the blocks
 * tables[s][0..]. Nothing is gathered: keys and values are read in place from their blocks.
 * Softmax is exact up to fp32 rounding (max-subtracted, one exp per score, divided by the sum).
 * fp32 pools with head dim 64 or 128 go head by head (attend_seq_fp32: the head's query and
 * accumulators in registers, 8 keys' scores summed together, each position's pool row looked up
 * once per sequence), at head dim 64 a KV group's query heads together (attend_group64: the same
 * per-head arithmetic, each row loaded once for the group); other pools token by token
 * (attend_seq: each row read once and widened).
 *
 * Layouts (contiguous): q, out [T, H, D] fp32; k_pool, v_pool [num_blocks, block_size, Hkv, row]
 * where a row is one (token, KV head) in the pool's format (engine/model/kv_quant.py): fp32 / bf16 /
 * fp16 numbers (row = D of them), or int8 / fp8 e4m3 codes followed by their float32 scale
 * (row = D + 4 bytes). Non-fp32 rows are widened to fp32 once per token as they are read (one
 * token's Hkv rows into a small buffer), then the arithmetic is the fp32 kernel's, unchanged.
 * tables [n_seqs, max_blocks] int32. Grouped-query heads share a KV head (H % Hkv == 0).
 * Work is split over sequences on n_threads OpenMP threads (fp32 path: a context of 2,048+
 * positions in 2 or 4 position segments merged after, kv_segments; ranges of query heads when
 * there are fewer of those items than threads). Built by
 * engine/model/cpu_kernels.py with the host compiler; portable C with GCC vector extensions (8 x fp32),
 * no intrinsics.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvscope.h"

#define KV_MAX_HEAD_DIM 256
#define KV_MAX_HEADS 256

static inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }
#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif
/* lane j = the sum of a[j]'s 8 lanes, for 8 vectors at once (three rounds of pairing halves; the
 * arguments go in as 0 4 2 6 1 5 3 7 so that the sums come out in order) */
static inline v8 sum_lanes8(const v8 *a) {
#define PAIR1(x, y) (SHUF(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(x, y, 4, 5, 6, 7, 12, 13, 14, 15))
#define PAIR2(x, y) (SHUF(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(x, y, 2, 3, 10, 11, 6, 7, 14, 15))
#define PAIR3(x, y) (SHUF(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(x, y, 1, 9, 3, 11, 5, 13, 7, 15))
    const v8 s0 = PAIR1(a[0], a[4]), s1 = PAIR1(a[2], a[6]), s2 = PAIR1(a[1], a[5]), s3 = PAIR1(a[3], a[7]);
    return PAIR3(PAIR2(s0, s1), PAIR2(s2, s3));
#undef PAIR1
#undef PAIR2
#undef PAIR3
}
static inline v8 sel(v8i m, v8 a, v8 b) { return (v8)(((v8i)a & m) | ((v8i)b & ~m)); }

enum { KV_FP32 = 0, KV_INT8 = 1, KV_FP8_E4M3 = 2, KV_BF16 = 3, KV_FP16 = 4 };

static float fp8_e4m3_table[256];          /* code -> value (float8_e4m3fn: bias 7, no inf, 0x7f/0xff NaN) */

__attribute__((constructor)) static void fp8_table_init(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        fp8_e4m3_table[c] = (c & 0x80) ? -v : v;
    }
}

static inline float fp16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, f;
    if (e == 0) {                                   /* zero or subnormal: m * 2^-24 */
        float v = ldexpf((float)m, -24);
        return s ? -v : v;
    }
    f = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
    float r;
    memcpy(&r, &f, sizeof r);
    return r;
}

/* The Hkv rows of token l of a sequence, as fp32 [Hkv, D]: in place for fp32 pools, otherwise
   widened into buf. int8: code * scale; fp8: table[code] * scale; bf16/fp16: exact widening. */
static inline const float *kv_token(const unsigned char *pool, int fmt, size_t row, size_t blk, int bs,
                                    const int32_t *tb, int l, int Hkv, int D, float *buf) {
    const unsigned char *t = pool + (size_t)tb[l / bs] * blk + (size_t)(l % bs) * row * Hkv;
    if (fmt == KV_FP32) return (const float *)t;
    for (int h = 0; h < Hkv; h++) {
        const unsigned char *r = t + (size_t)h * row;
        float *o = buf + (size_t)h * D;
        if (fmt == KV_INT8 || fmt == KV_FP8_E4M3) {
            float sc;
            memcpy(&sc, r + D, sizeof sc);
            if (fmt == KV_INT8)
                for (int i = 0; i < D; i++) o[i] = (float)(int8_t)r[i] * sc;
            else
                for (int i = 0; i < D; i++) o[i] = fp8_e4m3_table[r[i]] * sc;
        } else if (fmt == KV_BF16) {
            for (int i = 0; i < D; i++) {
                uint16_t b;
                memcpy(&b, r + 2 * i, 2);
                uint32_t f = (uint32_t)b << 16;
                memcpy(o + i, &f, 4);
            }
        } else {
            for (int i = 0; i < D; i++) {
                uint16_t b;
                memcpy(&b, r + 2 * i, 2);
                o[i] = fp16_to_f32(b);
            }
        }
    }
    return buf;
}

static size_t kv_row_bytes(int fmt, int D) {
    return fmt == KV_FP32 ? (size_t)D * 4 : (fmt == KV_INT8 || fmt == KV_FP8_E4M3) ? (size_t)D + 4 : (size_t)D * 2;
}

/* e^x for x <= 0 (scores minus their max): n = floor(x log2 e + 1/2), kvscope.h's polynomial. */
static inline v8 exp_nonpos(v8 x) {
    x = sel(x < splat(-87.f), splat(-87.f), x);
    v8 t = x * KV_LOG2E + 0.5f;
    v8 n = __builtin_convertvector(__builtin_convertvector(t, v8i), v8);
    n = sel(n > t, n - 1.0f, n);                                   /* floor(t) */
    v8 r = x - n * KV_LN2_HI;
    r = r - n * KV_LN2_LO;
    v8 p;
    KV_EXP_POLY(p, r);
    p = p * r * r + r + 1.0f;
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8 s;
    memcpy(&s, &e, sizeof s);
    return p * s;
}

/* One decode sequence: all H query heads attend over its context. Keys and values are read token
   row by token row ([Hkv, D] contiguous in the pool), each row once, so a block is read front to
   back. sc holds H * (L + 8) scores; acc holds H * D accumulators; buf Hkv * D floats (one
   widened token when the pool is not fp32). */
static void attend_seq(const float *q, float *out, const unsigned char *k_pool, const unsigned char *v_pool,
                       const int32_t *q_rows, const int32_t *ctx_lens, const int32_t *tables,
                       int max_blocks, int bs, int H, int Hkv, int D, float scale, int s, float *sc, v8 *acc,
                       int fmt, float *buf) {
    const int G = H / Hkv, nv = D / 8, L = ctx_lens[s], Lp = L + 8;
    const size_t row = kv_row_bytes(fmt, D), blk = (size_t)bs * Hkv * row;
    const int32_t *tb = tables + (size_t)s * max_blocks;
    const float *qp = q + (size_t)q_rows[s] * H * D;
    float m[KV_MAX_HEADS], total[KV_MAX_HEADS];
    v8 *qv = acc;                                       /* the scaled queries, then the accumulators */
    for (int i = 0; i < H * nv; i++) qv[i] = ld(qp + 8 * i) * scale;
    for (int hq = 0; hq < H; hq++) m[hq] = -INFINITY;
    for (int l = 0; l < L; l++) {                       /* scores = q . k, one pass over the keys */
        const float *krow = kv_token(k_pool, fmt, row, blk, bs, tb, l, Hkv, D, buf);
        for (int hq = 0; hq < H; hq++) {
            const float *k = krow + (size_t)(hq / G) * D;
            const v8 *qh = qv + hq * nv;
            v8 a = qh[0] * ld(k);
            for (int i = 1; i < nv; i++) a += qh[i] * ld(k + 8 * i);
            float v = hsum(a);
            sc[hq * Lp + l] = v;
            m[hq] = v > m[hq] ? v : m[hq];
        }
    }
    for (int hq = 0; hq < H; hq++) {                    /* p = exp(score - max), total = sum p */
        float *row = sc + hq * Lp;
        v8 tot = splat(0.f);
        int l = 0;
        for (; l + 8 <= L; l += 8) {
            v8 e = exp_nonpos(ld(row + l) - m[hq]);
            st(row + l, e);
            tot += e;
        }
        float t = hsum(tot);
        for (; l < L; l++) {
            float e = exp_nonpos(splat(row[l] - m[hq]))[0];
            row[l] = e;
            t += e;
        }
        total[hq] = t;
    }
    for (int i = 0; i < H * nv; i++) acc[i] = splat(0.f);
    for (int l = 0; l < L; l++) {                       /* out = sum p v, one pass over the values */
        const float *vrow = kv_token(v_pool, fmt, row, blk, bs, tb, l, Hkv, D, buf);
        for (int hq = 0; hq < H; hq++) {
            const float *v = vrow + (size_t)(hq / G) * D;
            const float p = sc[hq * Lp + l];
            v8 *a = acc + hq * nv;
            for (int i = 0; i < nv; i++) a[i] += p * ld(v + 8 * i);
        }
    }
    float *o = out + (size_t)q_rows[s] * H * D;
    for (int hq = 0; hq < H; hq++) {
        const float inv = 1.0f / total[hq];
        for (int i = 0; i < nv; i++) st(o + hq * D + 8 * i, acc[hq * nv + i] * inv);
    }
}

/* Software prefetch into L2, KV_PF positions ahead, of the head's K (scores) and V (sum) rows: a
   head's rows are D floats out of every Hkv * D, block after scattered block, which the hardware
   prefetchers follow badly, and a decode step reads them from DRAM (a W16 step's K/V is ~4 MB a
   layer, 147 MB for the stack). Measured on 16 sequences x 162 positions x 30 layers' pools:
   1.18x at 1 thread, 1.12x at 2 (48 ahead; 16 gave 1.07x, 96 was slower than 48). */
#ifndef KV_PF
#define KV_PF 48
#endif
static inline void prefetch_row(const float *p, int D) {
    for (int i = 0; i < D; i += 16) __builtin_prefetch(p + i, 0, 1);
}
/* the rows of positions j0 .. min(j1, L) - 1 of the head whose rows start at base */
static inline void prefetch_positions(const float *base, const int32_t *rows, int j0, int j1, int L, int Hkv, int D) {
    for (int j = j0; j < j1 && j < L; j++) prefetch_row(base + (size_t)rows[j] * Hkv * D, D);
}

/* One head of an fp32-pool sequence, NV = D / 8 known at compile time so that the query and the
   accumulators stay in registers: scores 8 keys at a time (sum_lanes8), then p = exp(score - max)
   and their total, then out = sum p v / total, the keys and values read in place, block by block. */
static inline __attribute__((always_inline)) void attend_head_fp32(int NV, const float *qp, float *o, const float *kp,
                                                                   const float *vp, int Hkv, const int32_t *rows,
                                                                   int L, float scale, float *sc, int own_pf,
                                                                   const float *nk, const float *nv, int pl0, int pl1) {
    const int D = NV * 8, cnt = pl1 - pl0;
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    v8 q[16], acc[16];
    for (int i = 0; i < NV; i++) q[i] = ld(qp + 8 * i) * scale;
    v8 top = splat(-INFINITY);
    for (int l0 = 0; l0 < L; l0 += 8) {
        const int n = L - l0 < 8 ? L - l0 : 8;
        if (own_pf) prefetch_positions(kp, rows, l0 + KV_PF, l0 + KV_PF + 8, L, Hkv, D);
        if (nk)
            prefetch_positions(nk, rows, pl0 + (int)((long long)l0 * cnt / L), pl0 + (int)((long long)(l0 + n) * cnt / L),
                               L, Hkv, D);
        v8 a[8];
        for (int j = 0; j < 8; j++) {                   /* past the end: key l0 again, its lane unused */
            const int l = l0 + (j < n ? j : 0);
            const float *k = kp + (size_t)rows[l] * Hkv * D;
            a[j] = q[0] * ld(k);
            for (int i = 1; i < NV; i++) a[j] += q[i] * ld(k + 8 * i);
        }
        const v8 v = sum_lanes8(a);
        st(sc + l0, v);                                 /* sc holds L + 8 floats */
        const v8 vm = sel(lane < n, v, splat(-INFINITY));
        top = sel(vm > top, vm, top);
    }
    float m = top[0];
    for (int j = 1; j < 8; j++) m = top[j] > m ? top[j] : m;
    v8 tot = splat(0.f);
    for (int l = 0; l < L; l += 8) {                    /* the last group's dead lanes count 0 */
        const v8 e = exp_nonpos(ld(sc + l) - m);
        const v8 ev = L - l >= 8 ? e : sel(lane < L - l, e, splat(0.f));
        st(sc + l, ev);
        tot += ev;
    }
    const float total = hsum(tot);
    for (int i = 0; i < NV; i++) acc[i] = splat(0.f);
    for (int l = 0; l < L; l++) {
        const float *v = vp + (size_t)rows[l] * Hkv * D;
        if (own_pf) prefetch_positions(vp, rows, l + KV_PF, l + KV_PF + 1, L, Hkv, D);
        if (nv && (l & 7) == 0)
            prefetch_positions(nv, rows, pl0 + (int)((long long)l * cnt / L),
                               pl0 + (int)((long long)(l + 8 < L ? l + 8 : L) * cnt / L), L, Hkv, D);
        const v8 p = splat(sc[l]);
        for (int i = 0; i < NV; i++) acc[i] += p * ld(v + 8 * i);
    }
    const v8 inv = splat(1.0f / total);
    for (int i = 0; i < NV; i++) st(o + 8 * i, acc[i] * inv);
}

/* The GQ query heads of one KV group (head dim 64) at once: each key and value row is loaded once
   for the group (from DRAM once, where head by head read it again from cache per head), with
   exactly attend_head_fp32's arithmetic per head (the same chains, sum_lanes8, max, exp, sums),
   so the same bits. sc holds GQ x (L + 8) scores. nk / nv: the next KV head's rows (or NULL),
   prefetched at the same positions, so that its group starts warm; own_pf: prefetch this
   group's own rows KV_PF ahead (the first group of a call). */
static inline __attribute__((always_inline)) void attend_group64(int GQ, const float *qp, float *o, const float *kp,
                                                                 const float *vp, int Hkv, const int32_t *rows, int L,
                                                                 float scale, float *sc, int own_pf, const float *nk,
                                                                 const float *nv) {
    enum { NV = 8, D = 64 };
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const int Lp = L + 8;
    v8 q[4][NV];
    for (int g = 0; g < GQ; g++)
        for (int i = 0; i < NV; i++) q[g][i] = ld(qp + g * D + 8 * i) * scale;
    v8 top[4];
    for (int g = 0; g < GQ; g++) top[g] = splat(-INFINITY);
    /* the first KV_PF rows' keys now, and their values before the softmax: the loops below prefetch
       KV_PF positions ahead, so these were read cold (16 sequences of 70-200 positions from memory,
       scripts/decode_attention_ab.py --seqs 16, Zen 5: 1.04-1.12x at 1 and 2 threads, AVX2
       1.03-1.17x; 0.98x where the K/V sit in cache) */
    if (own_pf) prefetch_positions(kp, rows, 0, KV_PF, L, Hkv, D);
    for (int l0 = 0; l0 < L; l0 += 8) {
        const int n = L - l0 < 8 ? L - l0 : 8;
        if (own_pf) prefetch_positions(kp, rows, l0 + KV_PF, l0 + KV_PF + 8, L, Hkv, D);
        if (nk) prefetch_positions(nk, rows, l0, l0 + n, L, Hkv, D);
        v8 a[4][8];
        for (int j = 0; j < 8; j++) {                   /* past the end: key l0 again, its lane unused */
            const int l = l0 + (j < n ? j : 0);
            const float *k = kp + (size_t)rows[l] * Hkv * D;
            v8 kv[NV];
            for (int i = 0; i < NV; i++) kv[i] = ld(k + 8 * i);
            for (int g = 0; g < GQ; g++) {
                v8 t = q[g][0] * kv[0];
                for (int i = 1; i < NV; i++) t += q[g][i] * kv[i];
                a[g][j] = t;
            }
        }
        for (int g = 0; g < GQ; g++) {
            const v8 v = sum_lanes8(a[g]);
            st(sc + g * Lp + l0, v);
            const v8 vm = sel(lane < n, v, splat(-INFINITY));
            top[g] = sel(vm > top[g], vm, top[g]);
        }
    }
    float total[4];
    if (own_pf) prefetch_positions(vp, rows, 0, KV_PF, L, Hkv, D);
    for (int g = 0; g < GQ; g++) {
        float m = top[g][0];
        for (int j = 1; j < 8; j++) m = top[g][j] > m ? top[g][j] : m;
        float *sg = sc + g * Lp;
        v8 tot = splat(0.f);
        for (int l = 0; l < L; l += 8) {
            const v8 e = exp_nonpos(ld(sg + l) - m);
            const v8 ev = L - l >= 8 ? e : sel(lane < L - l, e, splat(0.f));
            st(sg + l, ev);
            tot += ev;
        }
        total[g] = hsum(tot);
    }
    /* P.V in the widest vector (16 lanes with AVX-512): each output lane's chain is the same at any
       width, so the same bits; 1.07-1.11x at 70-230 positions with the K/V in cache (1 thread, Zen 5) */
    enum { NW = D / VW_LANES };
    vw acc[4][NW];
    for (int g = 0; g < GQ; g++)
        for (int i = 0; i < NW; i++) acc[g][i] = splatw(0.f);
    for (int l = 0; l < L; l++) {
        const float *v = vp + (size_t)rows[l] * Hkv * D;
        if (own_pf) prefetch_positions(vp, rows, l + KV_PF, l + KV_PF + 1, L, Hkv, D);
        if (nv) prefetch_row(nv + (size_t)rows[l] * Hkv * D, D);
        for (int g = 0; g < GQ; g++) {
            const vw p = splatw(sc[g * Lp + l]);
            for (int i = 0; i < NW; i++) acc[g][i] += p * ldw(v + VW_LANES * i);
        }
    }
    for (int g = 0; g < GQ; g++) {
        const vw inv = splatw(1.0f / total[g]);
        for (int i = 0; i < NW; i++) stw(o + g * D + VW_LANES * i, acc[g][i] * inv);
    }
}

/* Long contexts (L >= KV_CHUNK_MIN_CTX): the same per-head arithmetic as attend_head_fp32 (the
   same chains, sum_lanes8, max, exp, sums, in the same order: the same bits), in another loop
   order: positions outer in chunks of KV_CHUNK, the call's query heads inner. Head by head over
   the whole context reads each KV head's rows (D of every Hkv * D floats) in its own pass, G times
   over from cache at best; chunked, a chunk's rows are read from DRAM once (the KV heads of one
   position side by side, a block's positions one contiguous span) and every head reads them from
   cache, while the next chunk's rows are prefetched. The output accumulators live in `acc`
   between chunks (stored and reloaded exactly; the same bits, checked against head by head).
   The next chunk's rows are prefetched as the chunk's work goes on (pf_rows), in position order.
   Measured in one process, 30 layers'
   pools, randomly placed blocks, AVX2, 1 thread: 5.8 -> 9.7 GB/s at 8,000 positions, 6.2 ->
   10.2 at 2,048, 11.3 -> 14.8 at 512 (torch.sum read 27 GB/s then); chunks of 32 beat 64 and 128.
   p0..p1: the positions of one segment (kv_segments); part: its unnormalized sums, max and total.
   2026-12-04, same set-up, load ~3: 11.5 GB/s at 8,000, 10.8-11.9 at 2,048 (torch.sum 16-18). What
   bounds it at 1 thread, measured: the arithmetic (144 vector FMAs per position at D = 64, H = 9)
   runs at 17-19 GB/s with the pools in L2; reading the same rows in the same order with no
   arithmetic, 14 GB/s (random blocks) to 19 (consecutive); the two only partly overlap. Tried and
   slower or no better there: one pass per chunk with online softmax (P.V while the chunk is hot:
   9.2 vs 10.7; its K + V chunk overflows L1), a KV group's heads per loaded row (8.0 vs 11.1), the
   group's P.V as 12 chains (10.1 vs 11.7), prefetch 2-4 chunks ahead or at other hints, prefetching
   every 2nd / 4th line, chunks of 8 / 16, huge pages. 2026-12-05, AVX-512 Zen 4, 1 thread
   (scripts/decode_attention_ab.py --sequential, blocks in order as a fresh pool hands them out):
   the next chunk's rows were prefetched head by head, head h taking positions h, h + nh, ...; in
   position order instead, with blocks in order the prefetches run through memory in address order
   and the hardware's L2 stream prefetcher runs on ahead of them: 17.4 -> 19.8 GB/s at 8,000
   positions, 17.0 -> 19.3 at 2,048, 20.8 -> 21.1 at 512 (from L3); AVX2 17.8 -> 20.4 at 8,000.
   With randomly placed blocks, the same as before. Per line in address order (a cursor over lines)
   was as fast at 8,000 but 0.86x at 512, where the pools sit in L3 and its bookkeeping showed.
   2026-12-05, Zen 5, 1 thread: P.V in 16-lane vectors (the same bits) was 1.08-1.13x with the K/V
   in cache (300-1,000 positions) but 0.95x from memory at 2,048 and 8,000, so it stays 8 lanes
   here (attend_group64, below KV_CHUNK_MIN_CTX, uses the wide vectors). */
#ifndef KV_CHUNK
#define KV_CHUNK 32
#endif
#ifndef KV_CHUNK_MIN_CTX
#define KV_CHUNK_MIN_CTX 256
#endif
static inline void prefetch_span(const float *p, size_t nfloats) {
    for (size_t i = 0; i < nfloats; i += 16) __builtin_prefetch(p + i, 0, 1);
}
/* The next chunk's rows prefetched in position order (so, with blocks in order, in address order)
   as the chunk's `steps` steps go on, `n` positions over `steps` steps (Bresenham: no division) */
typedef struct {
    const float *base;
    const int32_t *rows;
    size_t stride, seg;
    int pos, end, q, r, steps, err;
} pf_rows;
static inline pf_rows pf_rows_start(const float *base, const int32_t *rows, size_t stride, size_t seg, int from,
                                    int to, int steps) {
    const int n = to > from ? to - from : 0;
    return (pf_rows){base, rows, stride, seg, from, to, n / steps, n % steps, steps, 0};
}
static inline void pf_rows_step(pf_rows *c) {
    int n = c->q;
    if ((c->err += c->r) >= c->steps) c->err -= c->steps, n++;
    for (; n > 0 && c->pos < c->end; n--, c->pos++)
        prefetch_span(c->base + (size_t)c->rows[c->pos] * c->stride, c->seg);
}
static inline __attribute__((always_inline)) void attend_chunked(int NV, const float *qp, float *op,
                                                                 const float *k_pool, const float *v_pool, int Hkv,
                                                                 int G, const int32_t *rows, int L, float scale,
                                                                 int h0, int h1, float *sc, v8 *acc, int p0, int p1,
                                                                 float *part) {
    const int D = NV * 8, Lp = L + 8, nh = h1 - h0;
    const int g0 = h0 / G, g1 = (h1 - 1) / G;
    const size_t seg = (size_t)(g1 - g0 + 1) * D, stride = (size_t)Hkv * D;
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    v8 top[KV_MAX_HEADS];
    float total[KV_MAX_HEADS];
    for (int h = h0; h < h1; h++) top[h - h0] = splat(-INFINITY);
    for (int c0 = p0; c0 < p1; c0 += KV_CHUNK) {        /* scores, chunk by chunk */
        const int c1 = c0 + KV_CHUNK < p1 ? c0 + KV_CHUNK : p1, n1 = c1 + KV_CHUNK < L ? c1 + KV_CHUNK : L;
        pf_rows pc = pf_rows_start(k_pool + (size_t)g0 * D, rows, stride, seg, c1, n1, nh * ((c1 - c0 + 7) / 8));
        for (int h = h0; h < h1; h++) {
            const float *kp = k_pool + (size_t)(h / G) * D;
            v8 q[16];
            for (int i = 0; i < NV; i++) q[i] = ld(qp + (size_t)h * D + 8 * i) * scale;
            float *sh = sc + (size_t)(h - h0) * Lp;
            v8 t = top[h - h0];
            for (int l0 = c0; l0 < c1; l0 += 8) {
                const int n = p1 - l0 < 8 ? p1 - l0 : 8;
                pf_rows_step(&pc);
                v8 a[8];
                for (int j = 0; j < 8; j++) {
                    const int l = l0 + (j < n ? j : 0);
                    const float *k = kp + (size_t)rows[l] * stride;
                    a[j] = q[0] * ld(k);
                    for (int i = 1; i < NV; i++) a[j] += q[i] * ld(k + 8 * i);
                }
                const v8 v = sum_lanes8(a);
                st(sh + l0, v);
                const v8 vm = sel(lane < n, v, splat(-INFINITY));
                t = sel(vm > t, vm, t);
            }
            top[h - h0] = t;
        }
    }
    for (int h = h0; h < h1; h++) {                     /* p = e^(s - max), and the total */
        float m = top[h - h0][0];
        for (int j = 1; j < 8; j++) m = top[h - h0][j] > m ? top[h - h0][j] : m;
        float *sh = sc + (size_t)(h - h0) * Lp;
        v8 tot = splat(0.f);
        for (int l = p0; l < p1; l += 8) {
            const v8 e = exp_nonpos(ld(sh + l) - m);
            const v8 ev = p1 - l >= 8 ? e : sel(lane < p1 - l, e, splat(0.f));
            st(sh + l, ev);
            tot += ev;
        }
        total[h - h0] = hsum(tot);
        if (part) part[(size_t)h * (D + 2) + D] = m;
        for (int i = 0; i < NV; i++) acc[(size_t)(h - h0) * NV + i] = splat(0.f);
    }
    for (int c0 = p0; c0 < p1; c0 += KV_CHUNK) {        /* out = sum p v, chunk by chunk */
        const int c1 = c0 + KV_CHUNK < p1 ? c0 + KV_CHUNK : p1, n1 = c1 + KV_CHUNK < L ? c1 + KV_CHUNK : L;
        pf_rows pc = pf_rows_start(v_pool + (size_t)g0 * D, rows, stride, seg, c1, n1, nh * (c1 - c0));
        for (int h = h0; h < h1; h++) {
            const float *vp = v_pool + (size_t)(h / G) * D;
            const float *ph = sc + (size_t)(h - h0) * Lp;
            v8 a[16];
            for (int i = 0; i < NV; i++) a[i] = acc[(size_t)(h - h0) * NV + i];
            for (int l = c0; l < c1; l++) {
                pf_rows_step(&pc);
                const float *v = vp + (size_t)rows[l] * stride;
                const v8 p = splat(ph[l]);
                for (int i = 0; i < NV; i++) a[i] += p * ld(v + 8 * i);
            }
            for (int i = 0; i < NV; i++) acc[(size_t)(h - h0) * NV + i] = a[i];
        }
    }
    for (int h = h0; h < h1; h++) {
        if (part) {                                     /* a segment: its sums, max and total, for kv_merge */
            float *ph = part + (size_t)h * (D + 2);
            for (int i = 0; i < NV; i++) st(ph + 8 * i, acc[(size_t)(h - h0) * NV + i]);
            ph[D + 1] = total[h - h0];
            continue;
        }
        const v8 inv = splat(1.0f / total[h - h0]);
        for (int i = 0; i < NV; i++) st(op + (size_t)h * D + 8 * i, acc[(size_t)(h - h0) * NV + i] * inv);
    }
}

/* Position segments of a long context (fp32 path): a context of at least 2 * KV_SEG positions is
   split into 2 segments, of 4 * KV_SEG into 4, each a whole number of chunks, computed as separate
   work items (each with its own max: the scores, e^x and the sums of attend_chunked over its
   positions) and merged by kv_merge: o = sum_g e^(m_g - m) acc_g / sum_g e^(m_g - m) total_g.
   The split depends on L alone, so a row's bits do not depend on the thread count; at 2 threads
   a batch-1 decode's positions go half to each (the head ranges otherwise cut a KV group, whose
   rows both threads then read). */
#ifndef KV_SEG
#define KV_SEG 1024
#endif
static inline int kv_segments(int L) { return L >= 4 * KV_SEG ? 4 : L >= 2 * KV_SEG ? 2 : 1; }
static inline int kv_segment_start(int L, int g, int ns) {
    return g >= ns ? L : share_start(L, ns, g) / KV_CHUNK * KV_CHUNK;
}
/* parts: ns blocks of H x (D sums, max, total), one per segment, in position order */
static void kv_merge(const float *parts, int ns, int H, int D, float *o) {
    const size_t pf = (size_t)H * (D + 2);
    for (int h = 0; h < H; h++) {
        float m = -INFINITY;
        for (int g = 0; g < ns; g++) {
            const float mg = parts[pf * g + (size_t)h * (D + 2) + D];
            m = mg > m ? mg : m;
        }
        float w[4], tot = 0.f;
        for (int g = 0; g < ns; g++) {
            const float *ph = parts + pf * g + (size_t)h * (D + 2);
            w[g] = exp_nonpos(splat(ph[D] - m))[0];
            tot += w[g] * ph[D + 1];
        }
        const float inv = 1.0f / tot;
        for (int d = 0; d < D; d += 8) {
            v8 a = splat(0.f);
            for (int g = 0; g < ns; g++) a += w[g] * ld(parts + pf * g + (size_t)h * (D + 2) + d);
            st(o + (size_t)h * D + d, a * inv);
        }
    }
}

/* Query heads h0..h1-1 of an fp32-pool sequence: whole KV groups at once where D = 64
   (attend_group64), the other heads one by one (each head's query and accumulators in registers;
   its KV head's keys and values re-read per query head from cache). D = 64 or 128.
   rows: L ints, the pool row (block * bs + offset) of each position, looked up once for the heads. */
static void attend_seq_fp32(const float *q, float *out, const float *k_pool, const float *v_pool, const int32_t *q_rows,
                            const int32_t *ctx_lens, const int32_t *tables, int max_blocks, int bs, int H, int Hkv,
                            int D, float scale, int s, int h0, int h1, float *sc, int32_t *rows, v8 *acc,
                            int p0, int p1, float *part) {
    const int G = H / Hkv, L = ctx_lens[s];
    const int32_t *tb = tables + (size_t)s * max_blocks;
    const int r1 = p1 + KV_CHUNK < L ? p1 + KV_CHUNK : L; /* a segment's rows and the next chunk's */
    for (int l = p0, b = p0 / bs, off = p0 % bs; l < r1; l++) {
        rows[l] = tb[b] * bs + off;
        if (++off == bs) { off = 0; b++; }
    }
    const float *qp = q + (size_t)q_rows[s] * H * D;
    float *op = out + (size_t)q_rows[s] * H * D;
    if (L >= KV_CHUNK_MIN_CTX) {
        if (D == 64)
            attend_chunked(8, qp, op, k_pool, v_pool, Hkv, G, rows, L, scale, h0, h1, sc, acc, p0, p1, part);
        else
            attend_chunked(16, qp, op, k_pool, v_pool, Hkv, G, rows, L, scale, h0, h1, sc, acc, p0, p1, part);
        return;
    }
    int hq = h0;
    if (D == 64 && G >= 2 && G <= 4)                    /* whole groups at once, then any remainder */
        for (; hq % G == 0 && hq + G <= h1; hq += G) {
            const int g = hq / G, nxt = g + 1 < Hkv && hq + G < h1;
            const size_t hoff = (size_t)g * D;
            const float *nk = nxt ? k_pool + hoff + D : NULL, *nvp = nxt ? v_pool + hoff + D : NULL;
            if (G == 3)
                attend_group64(3, qp + hq * D, op + hq * D, k_pool + hoff, v_pool + hoff, Hkv, rows, L, scale, sc,
                               hq == h0, nk, nvp);
            else if (G == 2)
                attend_group64(2, qp + hq * D, op + hq * D, k_pool + hoff, v_pool + hoff, Hkv, rows, L, scale, sc,
                               hq == h0, nk, nvp);
            else
                attend_group64(4, qp + hq * D, op + hq * D, k_pool + hoff, v_pool + hoff, Hkv, rows, L, scale, sc,
                               hq == h0, nk, nvp);
        }
    for (; hq < h1; hq++) {
        const int g = hq / G, gi = hq % G;
        const size_t hoff = (size_t)g * D;
        /* the call's first head prefetches its own rows ahead; every head of a group also
           prefetches its share (1 / G) of the next KV head's rows, so that group starts warm */
        const int nxt = g + 1 < Hkv && (g + 1) * G < h1;
        const float *nk = nxt ? k_pool + hoff + D : NULL, *nvp = nxt ? v_pool + hoff + D : NULL;
        const int pl0 = share_start(L, G, gi), pl1 = share_start(L, G, gi + 1);
        const int own = hq == h0; /* later groups were prefetched by the one before */
        if (D == 64)
            attend_head_fp32(8, qp + hq * D, op + hq * D, k_pool + hoff, v_pool + hoff, Hkv, rows, L, scale, sc, own,
                             nk, nvp, pl0, pl1);
        else
            attend_head_fp32(16, qp + hq * D, op + hq * D, k_pool + hoff, v_pool + hoff, Hkv, rows, L, scale, sc, own,
                             nk, nvp, pl0, pl1);
    }
}

int kvscope_abi_version(void) { return 5; }

/* Returns 0 on success, a negative code for unsupported shapes or a failed allocation.
   kv_format: KV_FP32 / KV_INT8 / KV_FP8_E4M3 / KV_BF16 / KV_FP16 (engine/kv_quant.KERNEL_CODES). */
int kvscope_paged_decode_kv(const float *q, float *out, const void *k_pool, const void *v_pool,
                            const int32_t *q_rows, const int32_t *ctx_lens, const int32_t *tables,
                            int n_seqs, int max_blocks, int bs, int H, int Hkv, int D, float scale,
                            int max_ctx, int n_threads, int kv_format) {
    if (D % 8 || D > KV_MAX_HEAD_DIM || Hkv < 1 || H % Hkv || H > KV_MAX_HEADS || bs < 1
        || kv_format < KV_FP32 || kv_format > KV_FP16)
        return -1;
    if (n_seqs == 0) return 0;
    if (n_threads < 1) n_threads = 1;
    /* work items: (sequence, position segment, head range). fp32 path only: a long context in
       kv_segments(L) segments (set by L alone, so the same bits at any thread count), merged after;
       head ranges when there are fewer (sequence, segment) items than threads */
    const int fast = kv_format == KV_FP32 && (D == 64 || D == 128);
    int segs = 0, split = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int ns = fast ? kv_segments(ctx_lens[s]) : 1;
        segs += ns;
        split += ns > 1 ? ns : 0;
    }
    const int parts = fast && segs < n_threads ? (n_threads < H ? n_threads : H) : 1;
    if (n_threads > segs * parts) n_threads = segs * parts;
    const size_t sc_floats = ((size_t)max_ctx + 8) * H, acc_vecs = (size_t)H * (D / 8);
    const size_t part_floats = (size_t)H * (D + 2);
    float *scores = (float *)kv_alloc(sizeof(float) * sc_floats * n_threads);
    v8 *accs = (v8 *)kv_alloc(sizeof(v8) * acc_vecs * n_threads);
    float *bufs = (float *)kv_alloc(sizeof(float) * (size_t)Hkv * D * n_threads);
    int32_t *rowbufs = (int32_t *)malloc(sizeof(int32_t) * ((size_t)max_ctx + 8) * n_threads);
    int32_t *item = (int32_t *)malloc(sizeof(int32_t) * 3 * (size_t)segs); /* (s, segment, part slot) */
    float *partials = split ? (float *)kv_alloc(sizeof(float) * part_floats * split) : NULL;
    if (!scores || !accs || !bufs || !rowbufs || !item || (split && !partials)) {
        free(scores); free(accs); free(bufs); free(rowbufs); free(item); free(partials);
        return -2;
    }
    for (int s = 0, i = 0, slot = 0; s < n_seqs; s++) {
        const int ns = fast ? kv_segments(ctx_lens[s]) : 1;
        for (int g = 0; g < ns; g++, i++) {
            item[3 * i] = s;
            item[3 * i + 1] = g;
            item[3 * i + 2] = ns > 1 ? slot++ : -1;
        }
    }
    /* OpenMP from the same libgomp that torch loaded (resolved by soname in-process): one pool of
       threads for torch's ops and this kernel, never two pools competing for the cores */
    #pragma omp parallel for num_threads(n_threads) schedule(dynamic, 1) if (n_threads > 1)
    for (int i = 0; i < segs * parts; i++) {
        const int it = i / parts, part = i % parts, s = item[3 * it], g = item[3 * it + 1], slot = item[3 * it + 2];
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        if (fast) {
            const int L = ctx_lens[s], ns = slot < 0 ? 1 : kv_segments(L);
            attend_seq_fp32(q, out, (const float *)k_pool, (const float *)v_pool, q_rows, ctx_lens, tables, max_blocks,
                            bs, H, Hkv, D, scale, s, share_start(H, parts, part), share_start(H, parts, part + 1),
                            scores + sc_floats * t, rowbufs + (size_t)(max_ctx + 8) * t, accs + acc_vecs * t,
                            kv_segment_start(L, g, ns), kv_segment_start(L, g + 1, ns),
                            slot < 0 ? NULL : partials + part_floats * slot);
        } else
            attend_seq(q, out, (const unsigned char *)k_pool, (const unsigned char *)v_pool, q_rows, ctx_lens, tables,
                       max_blocks, bs, H, Hkv, D, scale, s, scores + sc_floats * t, accs + acc_vecs * t, kv_format,
                       bufs + (size_t)Hkv * D * t);
    }
    for (int it = 0; it < segs; it++) /* the split sequences: their segments merged, in order */
        if (item[3 * it + 1] == 0 && item[3 * it + 2] >= 0) {
            const int s = item[3 * it];
            kv_merge(partials + part_floats * item[3 * it + 2], kv_segments(ctx_lens[s]), H, D,
                     out + (size_t)q_rows[s] * H * D);
        }
    free(scores);
    free(accs);
    free(bufs);
    free(rowbufs);
    free(item);
    free(partials);
    return 0;
}

int kvscope_paged_decode(const float *q, float *out, const float *k_pool, const float *v_pool,
                         const int32_t *q_rows, const int32_t *ctx_lens, const int32_t *tables,
                         int n_seqs, int max_blocks, int bs, int H, int Hkv, int D, float scale,
                         int max_ctx, int n_threads) {
    return kvscope_paged_decode_kv(q, out, k_pool, v_pool, q_rows, ctx_lens, tables, n_seqs, max_blocks, bs, H, Hkv,
                                   D, scale, max_ctx, n_threads, KV_FP32);
}

/* ---------------------------------------------------------------------------------------------
 * Causal prefill attention, tiled (the flash-attention order): one sequence's run of T query rows
 * at consecutive positions start .. start + T - 1, over its context 0 .. start + T - 1, fp32 pool,
 * D = 64 or 128. Reading each key once per query row (the decode kernel, row by row) is a
 * matrix-vector product per row, bound by loads; here a tile of QT positions x G query heads
 * (the heads that share one KV head: R rows) meets a tile of PF_KT keys as a small matrix product,
 * each key and value loaded once per tile, the scores and the output accumulated in registers.
 *
 * Everything in a tile is held key-major or dimension-major with the R rows along the vector
 * lanes: Qt [D][R] (pre-scaled), St [PF_KT][R] (scores, then their exponentials), Ot [D][R], and
 * m, l, alpha [R]. So the online softmax is vertical, 8 rows per vector with no horizontal step:
 * m' = max(m, max_j S_j), alpha = e^(m - m'), P_j = e^(S_j - m'), l = l alpha + sum_j P_j, and
 * Ot = Ot alpha + sum_j V_j P_j with the rescale folded into the product's loads; out = O / l.
 * Keys past a row's own position are masked on the tiles that reach past the query tile's first
 * position only. Per call, each KV head's keys and values are copied once out of their blocks
 * into contiguous [PF_KT][D] tiles. Key tiles sit at absolute multiples of PF_KT, each score is
 * summed over d in order and each row's softmax runs over keys in order, so a row's arithmetic
 * depends on its position and context only, not on how the prompt was chunked or tiled into
 * queries or split over threads: the same bits at any chunk size and thread count. Within fp32
 * rounding of softmax(QK^T)V, not bitwise equal to the decode kernel (whose softmax is two-pass):
 * tests/engine/test_paged_prefill.py compares both with torch SDPA.
 * ------------------------------------------------------------------------------------------- */
#define PF_KT 64 /* keys per tile */
#define PF_MIN_ROWS 16 /* a run of at least this many rows goes to the tiled kernel */
#define PF_MAGIC 12582912.f /* 1.5 * 2^23: adding it rounds a float below 2^22 to an integer */

/* Query positions per tile for a context of L: a longer tile reads each key tile for more rows,
   a shorter one wastes less on the masked corner of the diagonal tiles (measured on Zen 4: 16 is
   best at 512 positions, 64 at 8,000). Any choice gives the same bits. */
static inline int pf_query_tile(int L) { return L < 1024 ? 16 : L < 4096 ? 32 : 64; }

/* a[j][i] <- a[i][j]: an 8 x 8 block transposed in three rounds of pairing (unpack, then pairs of
   pairs, then halves) */
static inline void transpose8(v8 *a) {
    v8 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = SHUF(a[i], a[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = SHUF(a[i], a[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = SHUF(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = SHUF(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = SHUF(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = SHUF(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int i = 0; i < 4; i++) {
        a[i] = SHUF(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        a[i + 4] = SHUF(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* max(a, b) lane by lane (scores: no NaN): one vmaxps where there is AVX, not compare-and-select */
static inline v8 pf_max(v8 a, v8 b) {
#ifdef __AVX__
    return __builtin_ia32_maxps256(a, b);
#else
    return sel(a > b, a, b);
#endif
}

/* p x 2^n for pf_exp: 2^n's bits built from t's (PF_MAGIC's, 0x4B400000, plus n), then one multiply */
static inline v8 pf_scale(v8 p, v8 n, v8 t) {
    (void)n;
    v8i e;
    memcpy(&e, &t, sizeof e);
    e = (e - 0x4B400000 + 127) << 23;
    v8 s;
    memcpy(&s, &e, sizeof s);
    return p * s;
}

/* e^x for x <= 0: n = x log2 e rounded to nearest by the magic add (t = x log2 e + PF_MAGIC), then
   kvscope.h's reduction and polynomial, as exp_nonpos (which rounds n with converts), and p x 2^n by
   SCALE. One definition for any vector width (lane-wise: the same bits at any width; pf_exp16's
   SCALE below is vscalefps, the same float as pf_scale's). */
#define PF_EXP_DEF(NAME, VT, MAX, SPLAT, SCALE)                                                    \
    static inline VT NAME(VT x) {                                                                  \
        x = MAX(x, SPLAT(-87.f));                                                                  \
        const VT t = x * KV_LOG2E + PF_MAGIC, n = t - PF_MAGIC;                                    \
        VT r = x - n * KV_LN2_HI;                                                                  \
        r = r - n * KV_LN2_LO;                                                                     \
        VT p;                                                                                      \
        KV_EXP_POLY(p, r);                                                                         \
        p = p * r * r + r + 1.0f;                                                                  \
        return SCALE(p, n, t);                                                                     \
    }
PF_EXP_DEF(pf_exp, v8, pf_max, splat, pf_scale)

/* The tile's micro-kernel, 16 rows (two vectors of lanes) x NB outputs c (with AVX-512, pf_kernel_wide
   below does the same for 48 rows at a time):
   C[c][0 .. 16) = C[c][..] alpha[..] (zero where alpha is NULL) + sum_{i < n} A[c ac + i ai] B[i][..],
   the terms in order of i; rows of B and C are RP floats apart. Scores: c = key, i = d,
   A = K (ac = D, ai = 1), B = Qt, C = St. P.V: c = dim, i = key, A = V (ac = 1, ai = D), B = St,
   C = Ot. mt (unless NULL): the 16 rows' running max, raised to the results (max is exact in any
   order). */
static inline __attribute__((always_inline)) void pf_kernel(int NB, const float *A, int ac, int ai, const float *B,
                                                            int RP, int n, const float *alpha, float *C, float *mt) {
    v8 a[8][2];
    if (alpha) {
        const v8 al0 = ld(alpha), al1 = ld(alpha + 8);
        for (int c = 0; c < NB; c++) {
            a[c][0] = ld(C + (size_t)c * RP) * al0;
            a[c][1] = ld(C + (size_t)c * RP + 8) * al1;
        }
    } else
        for (int c = 0; c < NB; c++) a[c][0] = a[c][1] = splat(0.f);
    for (int i = 0; i < n; i++) {
        const v8 b0 = ld(B + (size_t)i * RP), b1 = ld(B + (size_t)i * RP + 8);
        for (int c = 0; c < NB; c++) {
            const v8 w = splat(A[(size_t)c * ac + (size_t)i * ai]);
            a[c][0] += w * b0;
            a[c][1] += w * b1;
        }
    }
    for (int c = 0; c < NB; c++) {
        st(C + (size_t)c * RP, a[c][0]);
        st(C + (size_t)c * RP + 8, a[c][1]);
    }
    if (mt) {
        v8 m0 = ld(mt), m1 = ld(mt + 8);
        for (int c = 0; c < NB; c++) {
            m0 = pf_max(a[c][0], m0);
            m1 = pf_max(a[c][1], m1);
        }
        st(mt, m0);
        st(mt + 8, m1);
    }
}

#ifdef __AVX512F__
/* With AVX-512: pf_kernel over 48 rows in three 16-lane vectors (3 x 8 accumulators + 3 + 1 of the
   32 registers), so each broadcast of A and each load of B serves three times the lanes of the
   16-row kernel. Every lane runs the same chain, so the same bits as pf_kernel on those rows.
   Measured against pf_kernel alone, in one process, 1 thread, Zen 4, 9 / 3 heads:
   1.03x at 512 and 8,000 positions, 1.02x at 2,048 (scripts/prefill_attention_ab.py); 32 rows
   in two vectors gave 1.01-1.02x. */
#define PF_WR 48
static inline v16 pf_max16(v16 a, v16 b) { return __builtin_ia32_maxps512_mask(a, b, a, (unsigned short)-1, 4); }
static inline v16 sel16(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }
/* p x 2^n for pf_exp16 by vscalefps: the exact product rounded once, as pf_scale's p x s (s = 2^n is
   exact and normal for n >= -126, which the clamp at -87 keeps), so the same bits, in one
   instruction instead of the exponent's add, shift and multiply */
static inline v16 pf_scale16(v16 p, v16 n, v16 t) {
    (void)t;
    return __builtin_ia32_scalefps512_mask(p, n, p, (unsigned short)-1, 4);
}
PF_EXP_DEF(pf_exp16, v16, pf_max16, splat16, pf_scale16) /* pf_exp on 16 lanes: the same bits */
static inline __attribute__((always_inline)) void pf_kernel_wide(int NB, const float *A, int ac, int ai,
                                                                 const float *B, int RP, int n, const float *alpha,
                                                                 float *C, float *mt) {
    enum { W = PF_WR / 16 };
    v16 a[8][W];
    if (alpha) {
        v16 al[W];
        for (int v = 0; v < W; v++) al[v] = ld16(alpha + 16 * v);
        for (int c = 0; c < NB; c++)
            for (int v = 0; v < W; v++) a[c][v] = ld16(C + (size_t)c * RP + 16 * v) * al[v];
    } else
        for (int c = 0; c < NB; c++)
            for (int v = 0; v < W; v++) a[c][v] = splat16(0.f);
    for (int i = 0; i < n; i++) {
        v16 b[W];
        for (int v = 0; v < W; v++) b[v] = ld16(B + (size_t)i * RP + 16 * v);
        for (int c = 0; c < NB; c++) {
            const v16 w = splat16(A[(size_t)c * ac + (size_t)i * ai]);
            for (int v = 0; v < W; v++) a[c][v] += w * b[v];
        }
    }
    for (int c = 0; c < NB; c++)
        for (int v = 0; v < W; v++) st16(C + (size_t)c * RP + 16 * v, a[c][v]);
    if (mt) {
        v16 m[W];
        for (int v = 0; v < W; v++) m[v] = ld16(mt + 16 * v);
        for (int c = 0; c < NB; c++)
            for (int v = 0; v < W; v++) m[v] = pf_max16(a[c][v], m[v]);
        for (int v = 0; v < W; v++) st16(mt + 16 * v, m[v]);
    }
}
#endif

#ifdef __AVX512F__
#define PF_B 8 /* outputs (keys / dims) a micro-kernel: 2 x 8 accumulators + 2 + 1 of the 32 registers */
#else
#define PF_B 6 /* 2 x 6 accumulators + 2 + 1 of the 16 registers */
#endif
#define PF_BLOCKS(n, STEP) /* STEP(b, i) for blocks of b = PF_B at i, then the last 1 .. PF_B - 1 */  \
    do {                                                                                           \
        int i_ = 0;                                                                                \
        for (; i_ + PF_B <= (n); i_ += PF_B) STEP(PF_B, i_);                                       \
        switch ((n) - i_) {                                                                        \
        case 7: STEP(7, i_); break;                                                                \
        case 6: STEP(6, i_); break;                                                                \
        case 5: STEP(5, i_); break;                                                                \
        case 4: STEP(4, i_); break;                                                                \
        case 3: STEP(3, i_); break;                                                                \
        case 2: STEP(2, i_); break;                                                                \
        case 1: STEP(1, i_); break;                                                                \
        default: break;                                                                            \
        }                                                                                          \
    } while (0)

/* C = (C alpha) + A B over a tile's RP rows and nout outputs (output c: A + c ac, C + c RP floats),
   in the micro-kernels' blocks: 48 rows at a time in pf_kernel_wide where it exists (AVX-512), the
   rest 16 at a time, each PF_B outputs a call. Scores: A = K, B = Qt, C = St (mt: the rows' running
   max, or NULL); P.V: A = V, B = St, C = Ot, alpha the rows' rescale. */
static inline __attribute__((always_inline)) void pf_product(const float *A, int ac, int ai, const float *B, int RP,
                                                             int n, const float *alpha, float *C, float *mt,
                                                             int nout) {
    int r = 0;
#define PF_STEP(KERNEL, NB, c)                                                                                 \
    KERNEL(NB, A + (size_t)(c) * ac, ac, ai, B + r, RP, n, alpha ? alpha + r : NULL, C + (size_t)(c) * RP + r, \
           mt ? mt + r : NULL)
#define PF_WIDE_STEP(NB, c) PF_STEP(pf_kernel_wide, NB, c)
#define PF_16_STEP(NB, c) PF_STEP(pf_kernel, NB, c)
#ifdef PF_WR
    for (; r + PF_WR <= RP; r += PF_WR) PF_BLOCKS(nout, PF_WIDE_STEP);
#endif
    for (; r < RP; r += 16) PF_BLOCKS(nout, PF_16_STEP);
#undef PF_16_STEP
#undef PF_WIDE_STEP
#undef PF_STEP
}

/* One (KV head g, query tile) item: positions p0 .. p0 + np - 1 (query rows qrow0 + p0 - start ..),
   rows r = i * G + gi for position p0 + i and query head g * G + gi, padded to RP (a multiple of
   16) with zero queries at the last position. K, V: the head's [PF_KT][D] tiles. */
static void pf_tile(const float *q, float *out, const float *Ktiles, const float *Vtiles, int qrow0, int start,
                    int p0, int np, int g, int G, int H, int D, float scale, float *Qt, float *St, float *Ot,
                    float *m, float *l, float *alpha, float *mt, int32_t *pos) {
    const int R = np * G, RP = (R + 15) & ~15, last = p0 + np - 1; /* the tile's last position: keys 0 .. last */
    for (int r0 = 0; r0 < RP; r0 += 8) { /* Qt [D][RP] from 8 rows at a time, 8 x 8 blocks transposed */
        const float *src[8];
        for (int i = 0; i < 8; i++) {
            const int r = r0 + i;
            src[i] = r < R ? q + ((size_t)(qrow0 + p0 - start + r / G) * H + g * G + r % G) * D : NULL;
            pos[r] = r < R ? p0 + r / G : last;
            m[r] = -INFINITY;
            l[r] = 0.f;
        }
        for (int d0 = 0; d0 < D; d0 += 8) {
            v8 a[8];
            for (int i = 0; i < 8; i++) a[i] = src[i] ? ld(src[i] + d0) * scale : splat(0.f);
            transpose8(a);
            for (int j = 0; j < 8; j++) st(Qt + (size_t)(d0 + j) * RP + r0, a[j]);
        }
    }
    memset(Ot, 0, sizeof(float) * (size_t)RP * D);
    for (int k0 = 0; k0 <= last; k0 += PF_KT) {
        const float *K = Ktiles + (size_t)(k0 / PF_KT) * PF_KT * D, *V = Vtiles + (size_t)(k0 / PF_KT) * PF_KT * D;
        const int nk = last + 1 - k0 < PF_KT ? last + 1 - k0 : PF_KT; /* keys any row of the tile sees */
        const int masked = k0 + nk - 1 > p0;                            /* some row sees fewer */
        if (k0 + PF_KT <= last) /* the next tile's keys and values toward L2 while this one runs */
            for (size_t c = 0; c < (size_t)PF_KT * D; c += 16) {
                __builtin_prefetch(K + (size_t)PF_KT * D + c, 0, 1);
                __builtin_prefetch(V + (size_t)PF_KT * D + c, 0, 1);
            }
        if (!masked) memcpy(mt, m, sizeof(float) * RP); /* the scores kernel raises it to the new max */
        pf_product(K, D, 1, Qt, RP, D, NULL, St, masked ? NULL : mt, nk);
        /* rows r .. r + lanes - 1: the new max (unmasked: the scores kernel's), rescale, e^(s - max)
           (0 where a key is past the row's position), the sums */
#define PF_SOFTMAX_ROWS(VT, VTI, LD, ST, MAX, EXP, SEL, SPLAT)                                             \
    do {                                                                                                   \
        const VT m0 = LD(m + r);                                                                           \
        VTI pv; /* key k0 + j is seen where j <= pv */                                                     \
        memcpy(&pv, pos + r, sizeof pv);                                                                   \
        pv -= k0;                                                                                          \
        VT mx = masked ? m0 : LD(mt + r);                                                                  \
        if (masked)                                                                                        \
            for (int j = 0; j < nk; j++)                                                                   \
                mx = MAX(SEL((VTI){0} + j <= pv, LD(St + (size_t)j * RP + r), SPLAT(-INFINITY)), mx);      \
        const VT al = EXP(m0 - mx);                                                                        \
        VT sum = LD(l + r) * al;                                                                           \
        for (int j = 0; j < nk; j++) {                                                                     \
            VT e = EXP(LD(St + (size_t)j * RP + r) - mx);                                                  \
            if (masked) e = SEL((VTI){0} + j <= pv, e, SPLAT(0.f));                                        \
            ST(St + (size_t)j * RP + r, e);                                                                \
            sum += e;                                                                                      \
        }                                                                                                  \
        ST(m + r, mx);                                                                                     \
        ST(l + r, sum);                                                                                    \
        ST(alpha + r, al);                                                                                 \
    } while (0)
        int r = 0;
#ifdef PF_WR /* 16 rows a vector where there is AVX-512 (the same lane-wise arithmetic: the same bits) */
        for (; r < RP; r += 16) PF_SOFTMAX_ROWS(v16, v16i, ld16, st16, pf_max16, pf_exp16, sel16, splat16);
#endif
        for (; r < RP; r += 8) PF_SOFTMAX_ROWS(v8, v8i, ld, st, pf_max, pf_exp, sel, splat);
#undef PF_SOFTMAX_ROWS
        pf_product(V, 1, D, St, RP, nk, alpha, Ot, NULL, D);
    }
    for (int r0 = 0; r0 < R; r0 += 8) { /* out = O / l, 8 x 8 blocks of Ot transposed back */
        const int n = R - r0 < 8 ? R - r0 : 8;
        float *dst[8], inv[8];
        for (int i = 0; i < n; i++) {
            const int r = r0 + i;
            dst[i] = out + ((size_t)(qrow0 + p0 - start + r / G) * H + g * G + r % G) * D;
            inv[i] = 1.0f / l[r];
        }
        for (int d0 = 0; d0 < D; d0 += 8) {
            v8 a[8];
            for (int j = 0; j < 8; j++) a[j] = ld(Ot + (size_t)(d0 + j) * RP + r0);
            transpose8(a);
            for (int i = 0; i < n; i++) st(dst[i] + d0, a[i] * inv[i]);
        }
    }
}

/* The run's T query rows qrow0 .. qrow0 + T - 1 at positions start .. start + T - 1; table: the
   sequence's block table (the blocks of positions 0 .. start + T - 1). Returns 0, or -1 for
   shapes outside the kernel, -2 for a failed allocation. */
int kvscope_paged_prefill(const float *q, float *out, const float *k_pool, const float *v_pool, int qrow0, int T,
                          int start, const int32_t *table, int bs, int H, int Hkv, int D, float scale, int n_threads) {
    if ((D != 64 && D != 128) || Hkv < 1 || H % Hkv || H > KV_MAX_HEADS || bs < 1 || T < 1 || start < 0) return -1;
    const int G = H / Hkv, L = start + T, ntiles = (L + PF_KT - 1) / PF_KT;
    const int QT = pf_query_tile(L), nq = (T + QT - 1) / QT, items = Hkv * nq, RP = (QT * G + 15) & ~15;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > items) n_threads = items;
    const size_t head_floats = (size_t)ntiles * PF_KT * D;
    float *kt = (float *)kv_alloc(sizeof(float) * head_floats * Hkv);
    float *vt = (float *)kv_alloc(sizeof(float) * head_floats * Hkv);
    const size_t per = (size_t)RP * D * 2 + (size_t)RP * PF_KT + 5 * (size_t)RP + 16; /* Qt Ot St m l alpha mt pos */
    float *work = (float *)kv_alloc(sizeof(float) * per * n_threads);
    if (!kt || !vt || !work) { free(kt); free(vt); free(work); return -2; }
    #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        /* keys and values into [tile][PF_KT][D], zero past L */
        #pragma omp for schedule(static)
        for (int x = 0; x < Hkv * ntiles; x++) {
            const int g = x / ntiles, t = x % ntiles;
            float *K = kt + head_floats * g + (size_t)t * PF_KT * D, *V = vt + head_floats * g + (size_t)t * PF_KT * D;
            for (int j = 0; j < PF_KT; j++) {
                const int p = t * PF_KT + j;
                if (p >= L) {
                    memset(K + (size_t)j * D, 0, sizeof(float) * D);
                    memset(V + (size_t)j * D, 0, sizeof(float) * D);
                    continue;
                }
                const size_t row = ((size_t)table[p / bs] * bs + p % bs) * Hkv + g;
                memcpy(K + (size_t)j * D, k_pool + row * D, sizeof(float) * D);
                memcpy(V + (size_t)j * D, v_pool + row * D, sizeof(float) * D);
            }
        }
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *Qt = work + per * t, *Ot = Qt + (size_t)RP * D, *St = Ot + (size_t)RP * D, *m = St + (size_t)RP * PF_KT;
        float *l = m + RP, *alpha = l + RP, *mt = alpha + RP;
        int32_t *pos = (int32_t *)(mt + RP);
        /* the longest query tiles (the last positions) first */
        #pragma omp for schedule(dynamic, 1)
        for (int x = 0; x < items; x++) {
            const int qi = nq - 1 - x / Hkv, g = x % Hkv;
            const int p0 = start + qi * QT, np = T - qi * QT < QT ? T - qi * QT : QT;
            pf_tile(q, out, kt + head_floats * g, vt + head_floats * g, qrow0, start, p0, np, g, G, H, D, scale, Qt,
                    St, Ot, m, l, alpha, mt, pos);
        }
    }
    free(kt);
    free(vt);
    free(work);
    return 0;
}

/* Every query row of a flattened batch (q_rows / ctx_lens / tables as kvscope_paged_decode_kv):
   runs of at least PF_MIN_ROWS rows of one sequence at consecutive positions (a prefill chunk:
   consecutive batch rows, lengths +1 each, each row's block table the next one's prefix) go to
   kvscope_paged_prefill, every other row to the decode kernel. fp32 pools. */
int kvscope_paged_attention_rows(const float *q, float *out, const float *k_pool, const float *v_pool,
                                 const int32_t *q_rows, const int32_t *ctx_lens, const int32_t *tables, int n_seqs,
                                 int max_blocks, int bs, int H, int Hkv, int D, float scale, int max_ctx,
                                 int n_threads, int decode_threads) {
    int s = 0, dec0 = 0, rc;
    if (D != 64 && D != 128) /* the tiled kernel's head dims; others row by row */
        return kvscope_paged_decode_kv(q, out, k_pool, v_pool, q_rows, ctx_lens, tables, n_seqs, max_blocks, bs, H,
                                       Hkv, D, scale, max_ctx, decode_threads, KV_FP32);
    while (s < n_seqs) {
        int e = s + 1;
        while (e < n_seqs && q_rows[e] == q_rows[e - 1] + 1 && ctx_lens[e] == ctx_lens[e - 1] + 1
               && !memcmp(tables + (size_t)e * max_blocks, tables + (size_t)(e - 1) * max_blocks,
                          sizeof(int32_t) * ((ctx_lens[e - 1] + bs - 1) / bs)))
            e++;
        if (e - s >= PF_MIN_ROWS) {
            if (s > dec0 && (rc = kvscope_paged_decode_kv(q, out, k_pool, v_pool, q_rows + dec0, ctx_lens + dec0,
                                                          tables + (size_t)dec0 * max_blocks, s - dec0, max_blocks, bs,
                                                          H, Hkv, D, scale, max_ctx, decode_threads, KV_FP32)))
                return rc;
            if ((rc = kvscope_paged_prefill(q, out, k_pool, v_pool, q_rows[s], e - s, ctx_lens[s] - 1,
                                            tables + (size_t)(e - 1) * max_blocks, bs, H, Hkv, D, scale, n_threads)))
                return rc;
            dec0 = e;
        }
        s = e;
    }
    if (n_seqs > dec0)
        return kvscope_paged_decode_kv(q, out, k_pool, v_pool, q_rows + dec0, ctx_lens + dec0,
                                       tables + (size_t)dec0 * max_blocks, n_seqs - dec0, max_blocks, bs, H, Hkv, D,
                                       scale, max_ctx, decode_threads, KV_FP32);
    return 0;
}
