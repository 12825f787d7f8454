/* kvscope CPU kernel: one whole Llama-family decoder layer in one call (engine/model/fused_decode.py).
 *
 *   h += o_proj(attn(rope(q), rope(k) -> pool, v -> pool))   with q/k/v = qkv(rmsnorm(h))
 *   h += down(silu(gate(x2)) * up(x2))                         with x2 = rmsnorm(h)
 *
 * The Linears are the packed panels engine/model/linear.py made (linear.c's fp32 panels, or
 * quant_linear.c's GGUF Q4_1 / Q8_0 / F16 / BF16 panels read in place), the attention is
 * paged_attention.c's read-in-place kernel over the block tables (every query row attends to
 * positions 0..len-1 of its sequence, which is the causal mask for ragged rows), the new K/V
 * are written to the fp32 pool at the slot mapping before attention reads them. cos / sin are
 * the model's own rotary tables for these positions ([T, D], rotate-half convention), computed
 * once per step by the model's rotary module from its inv_freq and scaling.
 * An optional per-op timer (prof != NULL) adds each op's seconds to prof[0..7]:
 * norm1, qkv, rope+kv write, attention, o_proj, residual+norm2, gate_up+silu, down+residual.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvscope.h"
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define GU_ROWS 64 /* rows per gate_up + SiLU chunk (see layer_forward) */
#else
#define GU_ROWS 128
#endif
static long long gu_rows(int T) { return T < GU_ROWS ? T : GU_ROWS; } /* rows of gate/up held */

typedef struct {
    int type; /* -1: fp32 panels (linear.c); else a ggml type id (quant_linear.c) */
    int n, k;
    const void *panels;
    const float *bias;
} kv_lin;

typedef struct {
    const float *norm1, *norm2; /* RMSNorm weights [hidden] */
    float eps;
    int hidden, H, Hkv, D, inter;
    kv_lin qkv, o, gate_up, down;
    float *k_pool, *v_pool; /* fp32 [num_blocks * bs, Hkv, D] */
} kv_layer;

static int lin(const kv_lin *l, const float *x, int M, float *y, int nt, kv_side_plan *side) {
    if (l->type < 0) return kvscope_linear(x, M, l->k, (const float *)l->panels, l->n, l->bias, y, nt);
    return kvscope_qlinear_side(l->type, x, M, l->k, (const uint8_t *)l->panels, l->n, l->bias, y, nt, side);
}


static void rope(float *v, const float *cos, const float *sin, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * cos[i] - b * sin[i];
        v[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* SiLU(g) * u, VL lanes at a time (GCC vector extensions: 16 with AVX-512; 8 otherwise, as GCC
 * runs a 64-byte vector's compares one lane at a time through scalar code without AVX-512: SiLU
 * was 6x and RMSNorm 5.7x slower on the AVX2 path with 16). Every element gets the same
 * operations at either width, so the same bits.
 * e^x as x = n ln2 + r (|r| <= ln2 / 2, n rounded by the 1.5 * 2^23 trick), e^r by kvscope.h's
 * polynomial, 2^n written into the exponent bits; x clamped to
 * [-87.3, 88.3], where e^x stays a normal float. Within 1.4 ulp of e^x (checked against double
 * exp), the class of torch's own vectorized exp; glibc's scalar expf was 0.55 s of W16's 9 s. */
#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
static inline vf splatf(float v) {
    vf r;
    for (int j = 0; j < VL; j++) r[j] = v;
    return r;
}
static inline vf vmin(vf a, vf b) { const vi m = a < b; return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vmax(vf a, vf b) { const vi m = a > b; return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vexp(vf x) {
    x = vmax(vmin(x, splatf(88.3f)), splatf(-87.3f));
    const vf big = splatf(12582912.0f);
    const vf t = x * splatf(KV_LOG2E) + big;
    const vf n = t - big;
    vf r = x - n * splatf(KV_LN2_HI);
    r = r - n * splatf(KV_LN2_LO);
    vf p;
    KV_EXP_POLY(p, r);
    p = p * (r * r) + r + splatf(1.0f);
    return p * (vf)((((vi)t - (vi)big) + 127) << 23);
}
/* a * b + c rounded once where the CPU has FMA (written out: GCC fused `acc += v * v` at one
 * vector width and not at the other), else twice */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}
static inline vf silu_mul(vf g, vf u) { return g / (splatf(1.0f) + vexp(-g)) * u; }

/* n floats from p as VL lanes, the lanes past n (all where n <= 0) zero; and back (the first n) */
static inline vf ldv(const float *p, int n) {
    vf v;
    if (n >= VL) {
        memcpy(&v, p, sizeof v);
        return v;
    }
    float b[VL] = {0};
    if (n > 0) memcpy(b, p, sizeof(float) * n);
    memcpy(&v, b, sizeof v);
    return v;
}
static inline void stv(float *p, vf v, int n) {
    if (n >= VL) memcpy(p, &v, sizeof v);
    else memcpy(p, &v, sizeof(float) * n);
}

/* o[i] = silu(g[i]) * u[i]; the tail goes through the same vector code (padded), so an
 * element's value does not depend on where it falls in the row */
static void silu_mul_row(const float *g, const float *u, float *o, int n) {
    for (int i = 0; i < n; i += VL) stv(o + i, silu_mul(ldv(g + i, n - i), ldv(u + i, n - i)), n - i);
}

/* the residual: h[i] = h[i] + r[i] over one row */
static void add_row(float *h, const float *r, int n) {
    for (int i = 0; i < n; i++) h[i] = h[i] + r[i];
}

/* transformers' LlamaRMSNorm in fp32: w * (x * rsqrt(mean(x^2) + eps)); the sum of squares in
 * 16 lanes (a padded last group; 16 / VL vectors), the lanes then added in order: one fixed order
 * per row at either width, like torch's own vectorized reduction not left to right (a 576-term
 * serial chain was 0.7 us a row) */
static void rmsnorm(const float *x, const float *w, float eps, int n, float *y) {
    vf acc[16 / VL];
    for (int h = 0; h < 16 / VL; h++) acc[h] = splatf(0.f);
    for (int i = 0; i < n; i += 16)
        for (int h = 0; h < 16 / VL; h++) {
            const vf v = ldv(x + i + h * VL, n - i - h * VL);
            acc[h] = vfma(v, v, acc[h]);
        }
    float ss = 0.f;
    for (int h = 0; h < 16 / VL; h++)
        for (int j = 0; j < VL; j++) ss += acc[h][j];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* the final norm of the rows whose logits are wanted: y [nrows, n] = RMSNorm(x row rows[i]), the
 * layers' own rmsnorm (one call after the stack instead of ~7 torch ops, each slow after the step's
 * weight stream has left torch's dispatch cold: 0.17 ms a step on a 2-core Xeon) */
int kvscope_rmsnorm_rows(const float *x, const int32_t *rows, int nrows, const float *w, float eps, int n, float *y) {
    for (int i = 0; i < nrows; i++) rmsnorm(x + (size_t)rows[i] * n, w, eps, n, y + (size_t)i * n);
    return 0;
}

/* y [n, cols] = rows idx[i] of src [src_rows, cols]: the embedding lookup and the RoPE table's rows
 * of a step, one call each instead of torch ops (see kvscope_rmsnorm_rows). Returns -1 - i for the
 * first index i outside [0, src_rows), nothing written (the caller names it). */
int kvscope_gather_rows(const float *src, int src_rows, int cols, const int32_t *idx, int n, float *y) {
    for (int i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= src_rows) return -1 - i;
    for (int i = 0; i < n; i++) memcpy(y + (size_t)i * cols, src + (size_t)idx[i] * cols, sizeof(float) * cols);
    return 0;
}

static double now(void) { return omp_get_wtime(); }

/* The next layer's K/V, prefetched by the Linears between this layer's attention and the next's
 * (kv_side_plan, kvscope.h). A decode step's attention reads every context position's K and V once,
 * from memory (a step streams the weights and the whole batch's K/V through the caches), and gets a
 * fraction of the bandwidth there; the Linears around it, from KV_SIDE_MIN_ROWS rows, are bound by
 * their arithmetic and leave the memory idle. So the plan's lines are asked for there, KV_SIDE_STEP
 * per weight block, and the attention finds them in cache. Below that many rows the Linears stream
 * their weights at the memory's pace themselves and the prefetches only compete with them; above
 * KV_SIDE_ROWS_PER_SEQ query rows per sequence (prefill chunks) the attention is the tiled kernel,
 * bound by its arithmetic, and a 512- or 2,048-token prefill at 1 thread took 1-2% longer with the
 * plan. W16's decode steps (16 rows, 2 threads, Zen 5, AVX-512, one process alternating): median
 * 15.22 -> 14.35 ms a step in quiet minutes (attention 3.5 -> 1.8-2.4 ms, the Linears 0.3 ms
 * slower), but 1-4% slower in busy ones (the shared machine's other load evicting the lines before
 * the attention came to them; docs/BENCHMARKS.md, thirteenth session); 4 rows 0.98-1.01x, 8 rows
 * 1.02-1.05x; batch 1 0.90x with prefetches (hence the floor). Off on the AVX2
 * path: its 16-row tiles keep a group of panels in L2 for the next row tile, and the prefetched
 * lines pushed them out (attention 3.2 -> 2.7 ms, gate_up 7.2 -> 7.8, the step no faster at 2 or 8
 * lines a block; as non-temporal prefetches 23.5 -> 24.0 ms). Prefetches change no arithmetic: the
 * same bits whatever the setting. */
#ifndef KV_SIDE_STEP
#ifdef __AVX512F__
#define KV_SIDE_STEP 8
#else
#define KV_SIDE_STEP 0
#endif
#endif
#ifndef KV_SIDE_MIN_ROWS
#define KV_SIDE_MIN_ROWS 8
#endif
#ifndef KV_SIDE_ROWS_PER_SEQ
#define KV_SIDE_ROWS_PER_SEQ 8
#endif
static int side_step = KV_SIDE_STEP;
/* lines per weight block from now on (< 0: unchanged); returns the setting (A/B scripts) */
int kvscope_kv_side_step(int step) {
    if (step >= 0) side_step = step;
    return side_step;
}
/* the plan's cursors aimed at nx's pools (NULL, or a step the plan does not serve: nothing) */
static void side_aim(kv_side_plan *pl, const kv_layer *nx) {
    for (int t = 0; t < pl->nt; t++) {
        kv_side_cursor *c = &pl->cur[t];
        c->p = c->end = NULL;
        c->i = c->i1 = 0;
        c->step = pl->on && nx ? side_step : 0;
        if (!c->step) continue;
        c->k = (const char *)nx->k_pool;
        c->v = (const char *)nx->v_pool;
        c->blocks = pl->blocks;
        c->bytes = (size_t)pl->bs * nx->Hkv * nx->D * sizeof(float);
        c->i = share_start(2 * pl->n, pl->nt, t);
        c->i1 = share_start(2 * pl->n, pl->nt, t + 1);
    }
}

long long kvscope_layer_scratch_floats(int T, int hidden, int H, int Hkv, int D, int inter) {
    const long long qkv = (long long)(H + 2 * Hkv) * D;
    return (long long)T * (hidden + qkv + (long long)H * D * 2 + inter + hidden) + gu_rows(T) * 2LL * inter;
}

/* h [T, hidden] updated in place. slots [T] int64 flat pool slots; q_rows/lens/tables as
   kvscope_paged_decode_kv (one entry per query row). scratch: kvscope_layer_scratch_floats. */
static int layer_forward(const kv_layer *L, const kv_layer *nx, kv_side_plan *side, float *h, int T,
                         const float *cos, const float *sin, const int64_t *slots, const int32_t *q_rows,
                         const int32_t *lens, const int32_t *tables, int n_seqs, int max_blocks, int bs, float scale,
                         int max_ctx, int n_threads, float *scratch, double *prof) {
    const int Hd = L->hidden, H = L->H, Hkv = L->Hkv, D = L->D, I = L->inter;
    const int nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv;
    if (D % 2 || L->qkv.n != nqkv || L->o.n != Hd || L->gate_up.n != 2 * I || L->down.n != Hd) return -10;
    float *x = scratch, *qkv = x + (size_t)T * Hd, *q = qkv + (size_t)T * nqkv, *att = q + (size_t)T * nq;
    float *gu = att + (size_t)T * nq, *act = gu + (size_t)gu_rows(T) * 2 * I;
    float *tmp = act + (size_t)T * I;
    double t0 = prof ? now() : 0, t1;
    int rc;
#define TICK(i) if (prof) { t1 = now(); prof[i] += t1 - t0; t0 = t1; }
    /* the per-row ops (norms, rope + K/V write, residual adds, SiLU) split over threads by rows, the
       same static split each time, so that a row's h stays with one core from op to op. Below 8
       rows one thread is faster. The default model's decode steps, 2 threads, Zen 5, two layer.c
       builds alternating in one process, chat prompts of 30-300 tokens: 2 sequences 1.05x slower
       split, 4 even, 8 and 16 0.97-0.98x the time (W16's steps: the norms, rope and SiLU on one
       thread waited on lines the other core had just written, a few us per op and layer) */
    const int par = n_threads > 1 && T >= 8;
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (par)
    for (int t = 0; t < T; t++) rmsnorm(h + (size_t)t * Hd, L->norm1, L->eps, Hd, x + (size_t)t * Hd);
    TICK(0)
    if ((rc = lin(&L->qkv, x, T, qkv, n_threads, side))) return rc;
    TICK(1)
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (par)
    for (int t = 0; t < T; t++) {
        float *r = qkv + (size_t)t * nqkv;
        const float *c = cos + (size_t)t * D, *s = sin + (size_t)t * D;
        for (int j = 0; j < H; j++) rope(r + j * D, c, s, D);
        for (int j = 0; j < Hkv; j++) rope(r + nq + j * D, c, s, D);
        memcpy(q + (size_t)t * nq, r, sizeof(float) * nq);
        memcpy(L->k_pool + (size_t)slots[t] * nkv, r + nq, sizeof(float) * nkv);
        memcpy(L->v_pool + (size_t)slots[t] * nkv, r + nq + nkv, sizeof(float) * nkv);
    }
    TICK(2)
    int at = n_threads;
    /* below this many query-head x context positions a fork costs more than it saves (AMD Zen 4,
       one sequence, 2 threads: 1.19x at 540, 1.33x at 1053, 1.53x at 2700 positions) */
    if ((long long)max_ctx * H * n_seqs < 512) at = 1;
    /* a prefill chunk's rows through the tiled kernel, the others row by row (paged_attention.c) */
    if ((rc = kvscope_paged_attention_rows(q, att, L->k_pool, L->v_pool, q_rows, lens, tables, n_seqs, max_blocks, bs,
                                           H, Hkv, D, scale, max_ctx, n_threads, at)))
        return rc;
    side_aim(side, nx);
    TICK(3)
    if ((rc = lin(&L->o, att, T, tmp, n_threads, side))) return rc;
    TICK(4)
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (par)
    for (int t = 0; t < T; t++) { /* the residual, then norm2 of the row while it is in cache */
        add_row(h + (size_t)t * Hd, tmp + (size_t)t * Hd, Hd);
        rmsnorm(h + (size_t)t * Hd, L->norm2, L->eps, Hd, x + (size_t)t * Hd);
    }
    TICK(5)
    /* gate_up then SiLU-mul per chunk of GU_ROWS rows: the chunk's gate/up outputs are still in
     * cache when SiLU reads them (all T rows' were 25 MB at a 2078-token prefill). On the AVX2 path
     * 128 rows rather than 64: the Q4_1 kernel converts a panel's codes once per call, so a call's
     * rows share that work; a 512-token prefill, 1 thread, Zen 5: 1.017-1.042 -> 0.984-0.987 s
     * (gate_up 0.467-0.479 -> 0.445 s). With AVX-512 it measured the same alone (0.511-0.525 ->
     * 0.518-0.529 s at 512 tokens, 17.3-18.0 -> 17.3 s at 8,000) but bench scaling's 8,000-token
     * prefill read 18.4-18.7 s in both grids after it against 17.7 before: kept at 64 there. Any
     * chunking gives the same bits (each row's sums do not depend on the others). */
    for (int r0 = 0; r0 < T; r0 += GU_ROWS) {
        const int rows = T - r0 < GU_ROWS ? T - r0 : GU_ROWS;
        if ((rc = lin(&L->gate_up, x + (size_t)r0 * Hd, rows, gu, n_threads, side))) return rc;
        #pragma omp parallel for num_threads(n_threads) schedule(static) if (par)
        for (int t = 0; t < rows; t++)
            silu_mul_row(gu + (size_t)t * 2 * I, gu + (size_t)t * 2 * I + I, act + (size_t)(r0 + t) * I, I);
    }
    TICK(6)
    if ((rc = lin(&L->down, act, T, tmp, n_threads, side))) return rc;
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (par)
    for (int t = 0; t < T; t++) add_row(h + (size_t)t * Hd, tmp + (size_t)t * Hd, Hd);
    TICK(7)
#undef TICK
    return 0;
}

/* The whole stack: n_layers kv_layer descriptors, one call per step. */
int kvscope_stack_forward(const kv_layer *Ls, int n_layers, float *h, int T, const float *cos, const float *sin,
                          const int64_t *slots, const int32_t *q_rows, const int32_t *lens, const int32_t *tables,
                          int n_seqs, int max_blocks, int bs, float scale, int max_ctx, int n_threads,
                          float *scratch, double *prof) {
    /* the blocks every attention of this step reads: each sequence's, from its last query row (a
       sequence's rows are consecutive, each one position on, and the block that holds a row's last
       position, the one being written, is its own: no other sequence's table has it) */
#define LAST_ROW(i)                                                                                             \
    ((i) + 1 == n_seqs || lens[(i) + 1] <= lens[i]                                                            \
     || tables[(size_t)((i) + 1) * max_blocks + (lens[i] - 1) / bs] != tables[(size_t)(i) * max_blocks + (lens[i] - 1) / bs])
    int nb = 0, ns = 0;
    for (int i = 0; i < n_seqs; i++)
        if (LAST_ROW(i)) nb += (lens[i] + bs - 1) / bs, ns++;
    kv_side_plan *side = (kv_side_plan *)aligned_alloc(64, sizeof(kv_side_plan));
    const int on = side_step > 0 && T >= KV_SIDE_MIN_ROWS && T <= (long long)KV_SIDE_ROWS_PER_SEQ * ns;
    int32_t *blocks = on ? (int32_t *)malloc(sizeof(int32_t) * (nb ? nb : 1)) : NULL;
    if (!side || (on && !blocks)) {
        free(side);
        free(blocks);
        return -3;
    }
    if (on)
        for (int i = 0, j = 0; i < n_seqs; i++)
            if (LAST_ROW(i))
                for (int b = 0; b < (lens[i] + bs - 1) / bs; b++) blocks[j++] = tables[(size_t)i * max_blocks + b];
#undef LAST_ROW
    side->blocks = blocks;
    side->n = nb;
    side->bs = bs;
    side->nt = n_threads < KV_SIDE_THREADS ? n_threads : KV_SIDE_THREADS;
    side->on = on;
    side_aim(side, n_layers ? Ls : NULL); /* the first layer's, during its qkv */
    int rc = 0;
    for (int l = 0; l < n_layers && !rc; l++)
        rc = layer_forward(Ls + l, l + 1 < n_layers ? Ls + l + 1 : NULL, side, h, T, cos, sin, slots, q_rows, lens,
                           tables, n_seqs, max_blocks, bs, scale, max_ctx, n_threads, scratch, prof);
    free(side);
    free(blocks);
    return rc;
}
