#include "deltanet.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <stdexcept>
#include <vector>

#include "checked.h"
#include "quants.h"
#include "simd.h"

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

// out[j] = decay in[j] + ki d[j], and o[j] += out[j] qi, for j < n. `stream`: out by
// non-temporal stores (64-byte aligned, n a multiple of 16 where AVX-512 runs): a state row that
// the next step reads from RAM anyway is written without first reading its lines in.
inline void decay_add_row(float* out, const float* in, float decay, float ki, const float* d, float qi, float* o,
                          int n, bool stream) {
    int j = 0;
#if defined(__AVX512F__)
    const __m512 dc = _mm512_set1_ps(decay), kk = _mm512_set1_ps(ki), qq = _mm512_set1_ps(qi);
    for (; j + 16 <= n; j += 16) {
        const __m512 s = _mm512_fmadd_ps(_mm512_loadu_ps(in + j), dc, _mm512_mul_ps(kk, _mm512_loadu_ps(d + j)));
        if (stream) _mm512_stream_ps(out + j, s);
        else _mm512_storeu_ps(out + j, s);
        _mm512_storeu_ps(o + j, _mm512_fmadd_ps(s, qq, _mm512_loadu_ps(o + j)));
    }
#elif defined(__AVX2__)
    const __m256 dc = _mm256_set1_ps(decay), kk = _mm256_set1_ps(ki), qq = _mm256_set1_ps(qi);
    for (; j + 8 <= n; j += 8) {
        const __m256 s = _mm256_fmadd_ps(_mm256_loadu_ps(in + j), dc, _mm256_mul_ps(kk, _mm256_loadu_ps(d + j)));
        if (stream) _mm256_stream_ps(out + j, s);
        else _mm256_storeu_ps(out + j, s);
        _mm256_storeu_ps(o + j, _mm256_fmadd_ps(s, qq, _mm256_loadu_ps(o + j)));
    }
#endif
    for (; j < n; j++) {
        out[j] = in[j] * decay + ki * d[j];
        o[j] += out[j] * qi;
    }
}

// Whether decay_add_row may stream rows of n floats to every row of a state at S.
inline bool streamable(const float* S, int n) {
#if defined(__AVX512F__)
    return reinterpret_cast<uintptr_t>(S) % 64 == 0 && n % 16 == 0;
#elif defined(__AVX2__)
    return reinterpret_cast<uintptr_t>(S) % 32 == 0 && n % 8 == 0;
#else
    return false;
#endif
}

// A head's state starts from `from` (nullptr: zeros) at S, which `from` may already be.
void start_state(float* S, const float* from, size_t n) {
    if (from == nullptr) std::fill(S, S + n, 0.f);
    else if (from != S) std::copy(from, from + n, S);
}

// One token of the rule on a head's state, read from `in` [Dk, Dv] (nullptr: zeros) and written
// to S (which may be `in`), q and k normalized already, into o [Dv]: kv = (decay in)^T k, the
// delta d = (v - kv) beta, then S = decay in + k d^T and o = S^T q in the same pass. kv [Dv] is
// scratch. `stream`: S by non-temporal stores (a decode step's last write; streamable(S, Dv)).
void rule_step(float* S, const float* in, const float* qn, const float* kn, const float* vt, float decay, float bt,
               float* kv, float* o, int Dk, int Dv, bool stream) {
    if (in == nullptr) {
        start_state(S, nullptr, (size_t)Dk * Dv);
        in = S;
    }
    std::fill(kv, kv + Dv, 0.f);
    for (int i = 0; i < Dk; i++) {
        const float ki = kn[i];
        const float* Si = in + (size_t)i * Dv;
        for (int j = 0; j < Dv; j++) kv[j] += Si[j] * ki;
    }
    for (int j = 0; j < Dv; j++) kv[j] = (vt[j] - decay * kv[j]) * bt;
    std::fill(o, o + Dv, 0.f);
    for (int i = 0; i < Dk; i++)
        decay_add_row(S + (size_t)i * Dv, in + (size_t)i * Dv, decay, kn[i], kv, qn[i], o, Dv, stream);
#if defined(__AVX2__)
    if (stream) _mm_sfence();  // (the streamed rows are visible before the pool's barrier says done)
#endif
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
        if (T == 0) start_state(S, from, (size_t)Dk * Dv);
        std::vector<float> qn(Dk), kn(Dk), kv(Dv);
        for (int t = 0; t < T; t++) {
            const size_t row = (size_t)b * T + t;
            normalized(q + (row * Hk + hk) * Dk, Dk, l2norm, q_scale, qn.data());
            normalized(k + (row * Hk + hk) * Dk, Dk, l2norm, 1.f, kn.data());
            rule_step(S, t == 0 ? from : S, qn.data(), kn.data(), v + (row * Hv + h) * Dv, std::exp(g[row * Hv + h]),
                      beta[row * Hv + h], kv.data(), out + (row * Hv + h) * Dv, Dk, Dv, false);
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

namespace {

// Row indices must lie in [-1, rows) to read (-1: zeros) and [0, rows) to write; no two sequences
// may write one row, and none may read a row another writes (its read would race the write).
void check_rows(const char* what, int n, int64_t rows, const int64_t* in, const int64_t* out) {
    for (int b = 0; b < n; b++) {
        if (in[b] < -1 || in[b] >= rows || out[b] < 0 || out[b] >= rows)
            throw std::out_of_range(std::string("gated_delta_decode: sequence ") + std::to_string(b) + " reads " + what +
                                    " row " + std::to_string(in[b]) + " and writes row " + std::to_string(out[b]) +
                                    " of " + std::to_string(rows));
        for (int c = 0; c < n; c++)
            if (c != b && (out[c] == out[b] || in[c] == out[b]))
                throw std::invalid_argument(std::string("gated_delta_decode: sequences ") + std::to_string(c) + " and " +
                                            std::to_string(b) + " share " + what + " row " + std::to_string(out[b]));
    }
}

// The layer's step from the conv input `mixed` [n, C], g, beta [n, Hv] and z [n, Hv, Dv] (sizes
// and rows checked by the caller).
void decode_mixed(ThreadPool& pool, int n, int Hk, int Hv, int Dk, int Dv, int K, bool tiled, size_t C,
                  const float* mixed, const float* conv_w, float* conv, const int64_t* conv_in,
                  const int64_t* conv_out, const float* g, const float* beta, float* ssm, const int64_t* ssm_in,
                  const int64_t* ssm_out, const float* z, const float* norm_w, float eps, float* out) {
    // the conv step of every sequence, into x [n, C]
    static thread_local std::vector<float> x_buf;
    x_buf.resize((size_t)n * C);
    float* x = x_buf.data();
    const size_t taps = K - 1, span = 512, spans = (C + span - 1) / span;  // (channel spans: tasks for both threads)
    pool.parallel_for((int)checked_product("gated_delta_decode: conv tasks", {(size_t)n, spans}), [&](int task, int) {
        const int b = task / (int)spans;
        const size_t c0 = (task % spans) * span, c1 = std::min(C, c0 + span);
        const float* in = conv_in[b] < 0 ? nullptr : conv + conv_in[b] * C * taps;
        float* to = conv + conv_out[b] * C * taps;
        for (size_t c = c0; c < c1; c++) {
            const float* w = conv_w + c * K;
            const float now = mixed[b * C + c];
            float acc = w[taps] * now;
            float window[16];
            for (size_t j = 0; j < taps; j++) window[j] = in ? in[c * taps + j] : 0.f;
            for (size_t j = 0; j < taps; j++) acc += w[j] * window[j];
            x[b * C + c] = acc;
            for (size_t j = 0; j + 1 < taps; j++) to[c * taps + j] = window[j + 1];
            to[c * taps + taps - 1] = now;
        }
        silu_rows(x + b * C + c0, c1 - c0);  // (vector exp: a scalar one a channel was most of a step)
    });
    // the rule and the gated norm, a task per (sequence, value head)
    const int group = Hv / Hk;
    const size_t per_row = (size_t)Hv * Dk * Dv, q_at = 0, k_at = (size_t)Hk * Dk, v_at = 2 * (size_t)Hk * Dk;
    const float q_scale = 1.f / std::sqrt((float)Dk);
    pool.parallel_for(n * Hv, [&](int task, int) {
        const int b = task / Hv, h = task % Hv, hk = tiled ? h % Hk : h / group;
        const float* xb = x + b * C;
        float* S = ssm + ssm_out[b] * per_row + (size_t)h * Dk * Dv;
        const float* from = ssm_in[b] < 0 ? nullptr : ssm + ssm_in[b] * per_row + (size_t)h * Dk * Dv;
        std::vector<float> qn(Dk), kn(Dk), kv(Dv), o(Dv);
        normalized(xb + q_at + (size_t)hk * Dk, Dk, true, q_scale, qn.data());
        normalized(xb + k_at + (size_t)hk * Dk, Dk, true, 1.f, kn.data());
        rule_step(S, from, qn.data(), kn.data(), xb + v_at + (size_t)h * Dv, std::exp(g[(size_t)b * Hv + h]),
                  beta[(size_t)b * Hv + h], kv.data(), o.data(), Dk, Dv, from != S && streamable(S, Dv));
        float ss = 0.f;
        for (int j = 0; j < Dv; j++) ss += o[j] * o[j];
        const float inv = 1.f / std::sqrt(ss / Dv + eps);
        const float* zb = z + ((size_t)b * Hv + h) * Dv;
        float* dst = out + ((size_t)b * Hv + h) * Dv;
        for (int j = 0; j < Dv; j++) kv[j] = o[j] * inv * norm_w[j];
        std::copy(zb, zb + Dv, dst);
        silu_mul(dst, kv.data(), Dv);  // silu(z) times the normed row
    });
}

float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // (torch's, beta 1, threshold 20)

}  // namespace

void gated_delta_decode(ThreadPool& pool, int n, int Hk, int Hv, int Dk, int Dv, int K, bool tiled, bool fused,
                        const float* qkv, const float* z, const float* b, const float* a, const float* neg_A,
                        const float* dt_bias, const float* conv_w, float* conv, int64_t rows, const int64_t* conv_in,
                        const int64_t* conv_out, float* ssm, const int64_t* ssm_in, const int64_t* ssm_out,
                        const float* norm_w, float eps, float* out) {
    check_shapes(n, 1, Hk, Hv, Dk, Dv);
    if (K < 2 || K > 17) throw std::invalid_argument("gated_delta_decode: the convolution takes 2 to 17 taps");
    const size_t C = checked_sum("gated_delta_decode: channels",
                                 {checked_product("gated_delta_decode: q, k", {2, (size_t)Hk, (size_t)Dk}),
                                  checked_product("gated_delta_decode: v", {(size_t)Hv, (size_t)Dv})});
    checked_product("gated_delta_decode: conv", {(size_t)std::max<int64_t>(rows, 0), C, (size_t)K});
    checked_product("gated_delta_decode: states", {(size_t)std::max<int64_t>(rows, 0), (size_t)Hv, (size_t)Dk,
                                                    (size_t)Dv});
    const size_t VD = (size_t)Hv * Dv;
    checked_product("gated_delta_decode: projections", {(size_t)n, C + VD});
    if (!fused && (!z || !a)) throw std::invalid_argument("gated_delta_decode: Qwen3.5's layout takes z and a");
    check_rows("conv", n, rows, conv_in, conv_out);
    check_rows("state", n, rows, ssm_in, ssm_out);
    // beta and g per value head; the fused layout's channels and z into the four-projection order
    static thread_local std::vector<float> g_buf, beta_buf, mixed_buf, z_buf;
    g_buf.resize((size_t)n * Hv);
    beta_buf.resize((size_t)n * Hv);
    const int r = Hv / Hk;
    for (int t = 0; t < n; t++)
        for (int h = 0; h < Hv; h++) {
            // fused: value head h is the (h % r)-th of key head h / r
            const size_t at_b = fused ? (size_t)t * Hk * 2 * r + (size_t)(h / r) * 2 * r + h % r : (size_t)t * Hv + h;
            const float bv = b[at_b], av = fused ? b[at_b + r] : a[(size_t)t * Hv + h];
            beta_buf[(size_t)t * Hv + h] = 1.f / (1.f + std::exp(-bv));
            g_buf[(size_t)t * Hv + h] = neg_A[h] * softplus(av + dt_bias[h]);
        }
    const float *mixed = qkv, *zz = z;
    if (fused) {
        mixed_buf.resize((size_t)n * C);
        z_buf.resize((size_t)n * VD);
        const size_t width = 2 * (size_t)Dk + 2 * (size_t)r * Dv, kd = (size_t)Hk * Dk;
        for (int t = 0; t < n; t++)
            for (int hk = 0; hk < Hk; hk++) {
                const float* src = qkv + (size_t)t * Hk * width + hk * width;
                float* m = mixed_buf.data() + (size_t)t * C;
                std::copy(src, src + Dk, m + hk * Dk);
                std::copy(src + Dk, src + 2 * Dk, m + kd + hk * Dk);
                std::copy(src + 2 * Dk, src + 2 * Dk + r * Dv, m + 2 * kd + (size_t)hk * r * Dv);
                std::copy(src + 2 * Dk + r * Dv, src + width, z_buf.data() + (size_t)t * VD + (size_t)hk * r * Dv);
            }
        mixed = mixed_buf.data();
        zz = z_buf.data();
    }
    decode_mixed(pool, n, Hk, Hv, Dk, Dv, K, tiled, C, mixed, conv_w, conv, conv_in, conv_out, g_buf.data(),
                 beta_buf.data(), ssm, ssm_in, ssm_out, zz, norm_w, eps, out);
}

}  // namespace kt
