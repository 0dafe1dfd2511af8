#include "deltanet.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <stdexcept>
#include <vector>

#include "checked.h"

namespace kt {
namespace {

// x / ||x|| (eps 1e-6 under the root, as FLA and transformers), or x, into `out`.
void normalized(const float* x, int n, bool l2norm, float scale, float* out) {
    float inv = scale;
    if (l2norm) {
        float ss = 0.f;
        for (int i = 0; i < n; i++) ss += x[i] * x[i];
        inv = scale / std::sqrt(ss + 1e-6f);
    }
    for (int i = 0; i < n; i++) out[i] = x[i] * inv;
}

// The rule over T tokens of B sequences and Hv heads, sequence b's head h reading its state from
// state_in(b, h) (nullptr: zeros) and updating it at state_out(b, h), which may be the same.
template <class In, class Out>
void run_rule(ThreadPool& pool, const float* q, const float* k, const float* v, const float* g, const float* beta,
              In state_in, Out state_out, float* out, int B, int T, int Hk, int Hv, int Dk, int Dv, bool l2norm) {
    const int group = Hv / Hk;
    const float q_scale = 1.f / std::sqrt((float)Dk);
    pool.parallel_for(B * Hv, [&](int task, int) {
        const int b = task / Hv, h = task % Hv, hk = h / group;
        float* S = state_out(b, h);
        const float* from = state_in(b, h);
        if (from == nullptr)
            std::fill(S, S + (size_t)Dk * Dv, 0.f);
        else if (from != S)
            std::copy(from, from + (size_t)Dk * Dv, S);
        std::vector<float> qn(Dk), kn(Dk), kv(Dv), o(Dv);
        for (int t = 0; t < T; t++) {
            const size_t row = (size_t)b * T + t;
            normalized(q + (row * Hk + hk) * Dk, Dk, l2norm, q_scale, qn.data());
            normalized(k + (row * Hk + hk) * Dk, Dk, l2norm, 1.f, kn.data());
            const float decay = std::exp(g[row * Hv + h]), bt = beta[row * Hv + h];
            const float* vt = v + (row * Hv + h) * Dv;
            // kv = (decay S)^T k, then the delta d = (v - kv) beta
            std::fill(kv.begin(), kv.end(), 0.f);
            for (int i = 0; i < Dk; i++) {
                const float ki = kn[i];
                const float* Si = S + (size_t)i * Dv;
                for (int j = 0; j < Dv; j++) kv[j] += Si[j] * ki;
            }
            for (int j = 0; j < Dv; j++) kv[j] = (vt[j] - decay * kv[j]) * bt;
            // S = decay S + k d^T, and out = S^T q in the same pass
            std::fill(o.begin(), o.end(), 0.f);
            for (int i = 0; i < Dk; i++) {
                const float ki = kn[i], qi = qn[i];
                float* Si = S + (size_t)i * Dv;
                for (int j = 0; j < Dv; j++) {
                    Si[j] = Si[j] * decay + ki * kv[j];
                    o[j] += Si[j] * qi;
                }
            }
            std::copy(o.begin(), o.end(), out + (row * Hv + h) * Dv);
        }
    });
}

void check_shapes(int B, int T, int Hk, int Hv, int Dk, int Dv) {
    if (B < 0 || T < 0 || Hk <= 0 || Hv <= 0 || Dk <= 0 || Dv <= 0 || Hv % Hk)
        throw std::invalid_argument("gated_delta_rule: B, T >= 0; Hk, Hv, Dk, Dv > 0; Hv a multiple of Hk");
    // (every buffer's size, overflow-checked: the wrapper sized the tensors from the same numbers)
    checked_product("gated_delta_rule: q", {(size_t)B, (size_t)T, (size_t)Hk, (size_t)Dk});
    checked_product("gated_delta_rule: v", {(size_t)B, (size_t)T, (size_t)Hv, (size_t)Dv});
    checked_product("gated_delta_rule: state", {(size_t)B, (size_t)Hv, (size_t)Dk, (size_t)Dv});
}

}  // namespace

void gated_delta_rule(ThreadPool& pool, const float* q, const float* k, const float* v, const float* g,
                      const float* beta, float* state, float* out, int B, int T, int Hk, int Hv, int Dk, int Dv,
                      bool l2norm) {
    check_shapes(B, T, Hk, Hv, Dk, Dv);
    auto at = [&](int b, int h) { return state + ((size_t)b * Hv + h) * Dk * Dv; };
    run_rule(pool, q, k, v, g, beta, at, at, out, B, T, Hk, Hv, Dk, Dv, l2norm);
}

void gated_delta_rule_rows(ThreadPool& pool, const float* q, const float* k, const float* v, const float* g,
                           const float* beta, float* states, int64_t n_rows, const int64_t* rows_in,
                           const int64_t* rows_out, float* out, int B, int T, int Hk, int Hv, int Dk, int Dv,
                           bool l2norm) {
    check_shapes(B, T, Hk, Hv, Dk, Dv);
    checked_product("gated_delta_rule: states", {(size_t)std::max<int64_t>(n_rows, 0), (size_t)Hv, (size_t)Dk,
                                                  (size_t)Dv});
    for (int b = 0; b < B; b++) {
        if (rows_in[b] < -1 || rows_in[b] >= n_rows || rows_out[b] < 0 || rows_out[b] >= n_rows)
            throw std::out_of_range("gated_delta_rule: sequence " + std::to_string(b) + " reads state row " +
                                    std::to_string(rows_in[b]) + " and writes row " + std::to_string(rows_out[b]) +
                                    " of " + std::to_string(n_rows));
        for (int c = 0; c < b; c++)
            if (rows_out[c] == rows_out[b])
                throw std::invalid_argument("gated_delta_rule: two sequences write state row " +
                                            std::to_string(rows_out[b]));
    }
    const size_t per_row = (size_t)Hv * Dk * Dv;
    auto in = [&](int b, int h) -> const float* {
        return rows_in[b] < 0 ? nullptr : states + rows_in[b] * per_row + (size_t)h * Dk * Dv;
    };
    auto to = [&](int b, int h) { return states + rows_out[b] * per_row + (size_t)h * Dk * Dv; };
    run_rule(pool, q, k, v, g, beta, in, to, out, B, T, Hk, Hv, Dk, Dv, l2norm);
}

}  // namespace kt
