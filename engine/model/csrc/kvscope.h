/* kvscope CPU kernels: what the csrc/*.c files share (one copy each): the 8-lane vector type (and
 * with AVX-512 the 16-lane one; vw, the widest of them) and its load / store / broadcast, the entry points one file calls in another, and e^x's constants
 * and polynomial. engine/model/cpu_kernels.py hashes this header with the sources. */
#ifndef KVSCOPE_H
#define KVSCOPE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
#ifdef __AVX512F__
/* the 16-lane type where AVX-512 keeps it in one register (linear.c's tiles, the prefill kernel) */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16 ld16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat16(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#endif
/* a kernel's scratch, on a 64-byte line (free() releases it): malloc's 16-byte alignment put
 * every other vector load across two cache lines, which Intel cores pay as two loads (the Q4_1
 * scratch tiles 0.8x, a Xeon with AVX-512, 1 thread; see quant_linear.c's scratch_panels) */
static inline void *kv_alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }
/* n things split into `parts` near-equal shares: share i's size (the first n % parts one larger:
   7 rows in 2 tiles = 4 + 3) and where share i starts when cut by floor(n i / parts) (a thread's
   panel range) */
static inline int share_size(int n, int parts, int i) { return n / parts + (i < n % parts); }
static inline int share_start(int n, int parts, int i) { return (int)((long long)n * i / parts); }
/* sx [M][K / 32]: every row's per-block sums of x, left to right (the factorized Q4_1 finish's
   m * sum x, on the AVX paths and on AMX tiles alike). Its `omp for` shares the rows among the
   threads of the enclosing parallel region (and ends in its barrier); called outside one, one
   thread does them all. used = 0 writes zeros instead (Q8_0's finish does not use them). */
static inline void kv_block_sums(const float *x, int M, int K, float *sx, int used) {
    const int nb = K / 32;
    #pragma omp for schedule(static)
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            float t = 0.f;
            if (used)
                for (int k = 0; k < 32; k++) t += x[(size_t)r * K + b * 32 + k];
            sx[(size_t)r * nb + b] = t;
        }
}
/* the widest of the two: for lane-wise loops whose bits do not depend on the width */
#ifdef __AVX512F__
#define VW_LANES 16
typedef v16 vw;
#define ldw ld16
#define stw st16
#define splatw splat16
#else
#define VW_LANES 8
typedef v8 vw;
#define ldw ld
#define stw st
#define splatw splat
#endif

/* The K/V the next layer's attention will read, prefetched from inside the Linears before it
 * (layer.c plans it, quant_linear.c's tiles take `step` lines a weight block): one cursor per
 * thread over its share of the blocks (each block's K span, then its V span). */
#define KV_SIDE_THREADS 64
typedef struct {
    const char *p, *end;   /* the span being prefetched */
    const char *k, *v;     /* the next layer's pools */
    const int32_t *blocks; /* the blocks it reads */
    size_t bytes;          /* one block of one pool */
    int i, i1, step;       /* this thread's spans i..i1-1 (span 2b: block b's K, 2b + 1: its V) */
} __attribute__((aligned(64))) kv_side_cursor;
typedef struct {
    kv_side_cursor cur[KV_SIDE_THREADS];
    const int32_t *blocks; /* the step's blocks, n of them (block size bs), shared by nt threads */
    int n, bs, nt, on;     /* on: this step's rows are ones the plan serves (layer.c) */
} kv_side_plan;

/* linear.c */
int kvscope_linear(const float *x, int M, int K, const float *panels, int N, const float *bias, float *y,
                   int n_threads);
void kvscope_linear_panel(const float *x, int M, int K, const float *panel, const float *bias, float *y, int ldy,
                          int nvalid);
/* quant_linear.c */
/* amx_linear.c: Q4_1 on AMX tiles once kvscope_amx(1) turned it on (then every Q4_1 call of
 * kvscope_amx_min_rows rows or more) */
int kvscope_amx(int on);
int kvscope_amx_min_rows(int rows);
int kvscope_amx_takes(int M);
int kvscope_amx_qlinear(const float *x, int M, int K, const uint8_t *panels, int N, const float *bias, float *y,
                        int n_threads);
int kvscope_qlinear(int type, const float *x, int M, int K, const uint8_t *panels, int N, const float *bias,
                    float *y, int n_threads);
int kvscope_qlinear_side(int type, const float *x, int M, int K, const uint8_t *panels, int N, const float *bias,
                         float *y, int n_threads, kv_side_plan *side);
/* paged_attention.c */
int kvscope_paged_decode_kv(const float *q, float *out, const void *k_pool, const void *v_pool,
                            const int32_t *q_rows, const int32_t *ctx_lens, const int32_t *tables, int n_seqs,
                            int max_blocks, int bs, int H, int Hkv, int D, float scale, int max_ctx, int n_threads,
                            int kv_format);
int kvscope_paged_attention_rows(const float *q, float *out, const float *k_pool, const float *v_pool,
                                 const int32_t *q_rows, const int32_t *ctx_lens, const int32_t *tables, int n_seqs,
                                 int max_blocks, int bs, int H, int Hkv, int D, float scale, int max_ctx,
                                 int n_threads, int decode_threads);

/* e^x = 2^n e^r with x = n ln2 + r: log2(e), and ln2 in two parts (hi exact in few bits, so n * hi
 * is exact); e^r ~ 1 + r + r^2 p(r) with Cephes' expf polynomial p, evaluated by KV_EXP_POLY into p
 * (any GCC vector type; r a variable). The callers (layer.c's SiLU, paged_attention.c's softmax)
 * differ only in how they round n and clamp x. */
#define KV_LOG2E 1.44269504088896341f
#define KV_LN2_HI 0.693359375f
#define KV_LN2_LO -2.12194440e-4f
#define KV_EXP_POLY(p, r)                                                                          \
    do {                                                                                           \
        (p) = (r) * 1.9875691500e-4f + 1.3981999507e-3f;                                           \
        (p) = (p) * (r) + 8.3334519073e-3f;                                                        \
        (p) = (p) * (r) + 4.1665795894e-2f;                                                        \
        (p) = (p) * (r) + 1.6666665459e-1f;                                                        \
        (p) = (p) * (r) + 5.0000001201e-1f;                                                        \
    } while (0)

#endif
