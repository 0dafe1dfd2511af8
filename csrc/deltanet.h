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

}  // namespace kt
