// The gated delta rule of gated-DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE): a recurrent
// state per sequence and value head, updated token by token, beside transformers' torch path
// (torch_recurrent_gated_delta_rule), which the tests compare it with.
#pragma once
#include <cstdint>

#include "pool.h"

namespace kt {

// For each of B sequences and each value head h (key/query head h / (Hv / Hk)), over its T
// tokens in order, with S = state[b, h] [Dk, Dv]:
//   S = S * exp(g[t, h]);  d = (v[t, h] - S^T k) * beta[t, h];  S += k d^T;  out[t, h] = S^T q / sqrt(Dk)
// where q, k are the token's query and key rows, L2-normalized first (eps 1e-6) when `l2norm`.
// Shapes (float32, contiguous): q, k [B, T, Hk, Dk]; v, out [B, T, Hv, Dv]; g, beta [B, T, Hv];
// state [B, Hv, Dk, Dv], updated in place. Hv must be a multiple of Hk (std::invalid_argument
// otherwise, or when a size overflows). Runs on the pool, a task per (sequence, value head).
void gated_delta_rule(ThreadPool& pool, const float* q, const float* k, const float* v, const float* g,
                      const float* beta, float* state, float* out, int B, int T, int Hk, int Hv, int Dk, int Dv,
                      bool l2norm);

// The same over rows of a state table `states` [n_rows, Hv, Dk, Dv] (a cache's ring of copies):
// sequence b starts from row rows_in[b] (-1: zero states) and leaves its state in row rows_out[b]
// (the same row: in place), so no state is copied outside the kernel. Rows out of range, or two
// sequences writing one row, throw before anything is touched.
void gated_delta_rule_rows(ThreadPool& pool, const float* q, const float* k, const float* v, const float* g,
                           const float* beta, float* states, int64_t n_rows, const int64_t* rows_in,
                           const int64_t* rows_out, float* out, int B, int T, int Hk, int Hv, int Dk, int Dv,
                           bool l2norm);

// One decode token of n sequences through a gated DeltaNet layer after its projections, fused:
// for sequence b (all float32, contiguous):
//   the causal conv step: window = [conv row conv_in[b] (-1: zeros), mixed[b]] per channel c,
//     x[c] = SiLU(sum_j conv_w[c, j] window[c, j]), and the row conv_out[b] = window[c, 1:];
//   x = [q (Hk x Dk), k (Hk x Dk), v (Hv x Dv)]; value head h reads key head h % Hk where `tiled`
//     (Qwen3.5's stored order), else h / (Hv / Hk); the L2-normed gated delta rule as above over
//     the state rows ssm_in[b] (-1: zeros) -> ssm_out[b];
//   the gated RMSNorm of each head's output o: out[b, h] = o / sqrt(mean(o^2) + eps) * norm_w
//     * SiLU(z[b, h]).
// Shapes: mixed [n, C], C = 2 Hk Dk + Hv Dv; conv_w [C, K]; conv [rows, C, K-1]; g, beta [n, Hv];
// ssm [rows, Hv, Dk, Dv]; z, out [n, Hv, Dv]; norm_w [Dv]. Rows out of range, two sequences
// writing one row, or one reading a row another writes, throw before anything is touched.
void gated_delta_decode(ThreadPool& pool, int n, int Hk, int Hv, int Dk, int Dv, int K, bool tiled,
                        const float* mixed, const float* conv_w, float* conv, int64_t rows, const int64_t* conv_in,
                        const int64_t* conv_out, const float* g, const float* beta, float* ssm, const int64_t* ssm_in,
                        const int64_t* ssm_out, const float* z, const float* norm_w, float eps, float* out);

}  // namespace kt
