/* kvscope CPU kernel: one whole Llama-family decoder layer in one call (engine/fused_decode.py).
 *
 *   h += o_proj(attn(rope(q), rope(k) -> pool, v -> pool))   with q/k/v = qkv(rmsnorm(h))
 *   h += down(silu(gate(x2)) * up(x2))                         with x2 = rmsnorm(h)
 *
 * The Linears are the packed panels engine/linear.py made (linear.c's fp32 panels, or
 * quant_linear.c's GGUF Q4_1 / Q8_0 / F16 / BF16 panels read in place), the attention is
 * paged_attention.c's read-in-place kernel over the block tables (every query row attends to
 * positions 0..len-1 of its sequence, which is the causal mask for ragged rows), the new K/V
 * are written to the fp32 pool at the slot mapping before attention reads them. cos / sin are
 * the model's own rotary tables for these positions ([T, D], rotate-half convention), computed
 * once per step by the model's rotary module from its inv_freq and scaling.
 * An optional per-op timer (prof != NULL) adds each op's seconds to prof[0..7]:
 * norm1, qkv, rope+kv write, attention, o_proj+residual, norm2, gate_up+silu, down+residual.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int kvscope_linear(const float *x, int M, int K, const float *panels, int N, const float *bias, float *y,
                   int n_threads);
int kvscope_qlinear(int type, const float *x, int M, int K, const uint8_t *panels, int N, const float *bias,
                    float *y, int n_threads);
int kvscope_paged_decode_kv(const float *q, float *out, const void *k_pool, const void *v_pool,
                            const int32_t *q_rows, const int32_t *ctx_lens, const int32_t *tables, int n_seqs,
                            int max_blocks, int bs, int H, int Hkv, int D, float scale, int max_ctx, int n_threads,
                            int kv_format);

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

static int lin(const kv_lin *l, const float *x, int M, float *y, int nt) {
    if (l->type < 0) return kvscope_linear(x, M, l->k, (const float *)l->panels, l->n, l->bias, y, nt);
    return kvscope_qlinear(l->type, x, M, l->k, (const uint8_t *)l->panels, l->n, l->bias, y, nt);
}

/* transformers' LlamaRMSNorm in fp32: w * (x * rsqrt(mean(x^2) + eps)) */
static void rmsnorm(const float *x, const float *w, float eps, int n, float *y) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

static void rope(float *v, const float *cos, const float *sin, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * cos[i] - b * sin[i];
        v[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

static double now(void) { return omp_get_wtime(); }

long long kvscope_layer_scratch_floats(int T, int hidden, int H, int Hkv, int D, int inter) {
    const long long qkv = (long long)(H + 2 * Hkv) * D;
    return (long long)T * (hidden + qkv + (long long)H * D * 2 + 3LL * inter + hidden);
}

/* h [T, hidden] updated in place. slots [T] int64 flat pool slots; q_rows/lens/tables as
   kvscope_paged_decode_kv (one entry per query row). scratch: kvscope_layer_scratch_floats. */
int kvscope_layer_forward(const kv_layer *L, float *h, int T, const float *cos, const float *sin,
                          const int64_t *slots, const int32_t *q_rows, const int32_t *lens, const int32_t *tables,
                          int n_seqs, int max_blocks, int bs, float scale, int max_ctx, int n_threads,
                          float *scratch, double *prof) {
    const int Hd = L->hidden, H = L->H, Hkv = L->Hkv, D = L->D, I = L->inter;
    const int nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv;
    if (D % 2 || L->qkv.n != nqkv || L->o.n != Hd || L->gate_up.n != 2 * I || L->down.n != Hd) return -10;
    float *x = scratch, *qkv = x + (size_t)T * Hd, *q = qkv + (size_t)T * nqkv, *att = q + (size_t)T * nq;
    float *gu = att + (size_t)T * nq, *act = gu + (size_t)T * 2 * I, *tmp = act + (size_t)T * I;
    double t0 = prof ? now() : 0, t1;
    int rc;
#define TICK(i) if (prof) { t1 = now(); prof[i] += t1 - t0; t0 = t1; }
    for (int t = 0; t < T; t++) rmsnorm(h + (size_t)t * Hd, L->norm1, L->eps, Hd, x + (size_t)t * Hd);
    TICK(0)
    if ((rc = lin(&L->qkv, x, T, qkv, n_threads))) return rc;
    TICK(1)
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
    if ((long long)max_ctx * H * n_seqs < 4096) at = 1; /* a fork costs more than a short context's heads */
    if ((rc = kvscope_paged_decode_kv(q, att, L->k_pool, L->v_pool, q_rows, lens, tables, n_seqs, max_blocks, bs, H,
                                      Hkv, D, scale, max_ctx, at, 0)))
        return rc;
    TICK(3)
    if ((rc = lin(&L->o, att, T, tmp, n_threads))) return rc;
    for (size_t i = 0; i < (size_t)T * Hd; i++) h[i] = h[i] + tmp[i];
    TICK(4)
    for (int t = 0; t < T; t++) rmsnorm(h + (size_t)t * Hd, L->norm2, L->eps, Hd, x + (size_t)t * Hd);
    TICK(5)
    if ((rc = lin(&L->gate_up, x, T, gu, n_threads))) return rc;
    for (int t = 0; t < T; t++) {
        float *g = gu + (size_t)t * 2 * I, *u = g + I, *o = act + (size_t)t * I;
        for (int i = 0; i < I; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
    TICK(6)
    if ((rc = lin(&L->down, act, T, tmp, n_threads))) return rc;
    for (size_t i = 0; i < (size_t)T * Hd; i++) h[i] = h[i] + tmp[i];
    TICK(7)
#undef TICK
    return 0;
}

/* The whole stack: n_layers kv_layer descriptors, one call per step. */
int kvscope_stack_forward(const kv_layer *Ls, int n_layers, float *h, int T, const float *cos, const float *sin,
                          const int64_t *slots, const int32_t *q_rows, const int32_t *lens, const int32_t *tables,
                          int n_seqs, int max_blocks, int bs, float scale, int max_ctx, int n_threads,
                          float *scratch, double *prof) {
    for (int l = 0; l < n_layers; l++) {
        int rc = kvscope_layer_forward(Ls + l, h, T, cos, sin, slots, q_rows, lens, tables, n_seqs, max_blocks, bs,
                                       scale, max_ctx, n_threads, scratch, prof);
        if (rc) return rc;
    }
    return 0;
}
