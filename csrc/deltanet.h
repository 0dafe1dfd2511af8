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

// One decode token of n sequences through a gated DeltaNet layer from its input projections'
// rows, fused: for sequence b (all float32, contiguous):
//   the projections, as the layer's linears give them: `fused` (Qwen3-Next), qkv = in_proj_qkvz
//     [n, Hk (2 Dk + 2 r Dv)] (per key head: its q, k, then the v and z of its r = Hv / Hk value
//     heads) and b = in_proj_ba [n, Hk 2 r] (per key head: its value heads' b, then their a), z
//     and a null; else (Qwen3.5) qkv [n, C] (q, k, v side by side), z [n, Hv Dv], b and a [n, Hv];
//   beta = sigmoid(b), g = neg_A * softplus(a + dt_bias) per value head (torch's softplus: a
//     linear tail above 20);
//   the causal conv step: window = [conv row conv_in[b] (-1: zeros), x_in] per channel c, with
//     x_in the channels [q (Hk x Dk), k (Hk x Dk), v (Hv x Dv)], x[c] = SiLU(sum_j conv_w[c, j]
//     window[c, j]), and the row conv_out[b] = window[c, 1:];
//   value head h reads key head h % Hk where `tiled` (Qwen3.5's stored order), else h / r; the
//     L2-normed gated delta rule as above over the state rows ssm_in[b] (-1: zeros) -> ssm_out[b];
//   the gated RMSNorm of each head's output o: out[b, h] = o / sqrt(mean(o^2) + eps) * norm_w
//     * SiLU(z[b, h]).
// Shapes: conv_w [C, K], C = 2 Hk Dk + Hv Dv; conv [rows, C, K-1]; neg_A, dt_bias [Hv]; ssm [rows,
// Hv, Dk, Dv]; out [n, Hv, Dv]; norm_w [Dv]. Rows out of range, two sequences writing one row, or
// one reading a row another writes, throw before anything is touched.
void gated_delta_decode(ThreadPool& pool, int n, int Hk, int Hv, int Dk, int Dv, int K, bool tiled, bool fused,
                        const float* qkv, const float* z, const float* b, const float* a, const float* neg_A,
                        const float* dt_bias, const float* conv_w, float* conv, int64_t rows, const int64_t* conv_in,
                        const int64_t* conv_out, float* ssm, const int64_t* ssm_in, const int64_t* ssm_out,
                        const float* norm_w, float eps, float* out);

}  // namespace kt
