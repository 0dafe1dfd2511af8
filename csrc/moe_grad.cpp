#include "moe_grad.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "checked.h"
#include "dequant.h"
#include "simd.h"

namespace kt {
namespace {

// Bytes of one stored row of n values of `type` (whole blocks), or invalid_argument naming `which`.
size_t grad_row_bytes(int type, int n, const char* which, int& elems, int& block) {
    elems = dequant_block_elems(type), block = dequant_block_bytes(type);
    if (elems == 0)
        throw std::invalid_argument(std::string("MoEGrad: ") + which + " weights of ggml type " + std::to_string(type) +
                                    " have no decoder here (the backward reads stored rows, not tiled layouts)");
    if (n % elems)
        throw std::invalid_argument(std::string("MoEGrad: ") + which + " rows of " + std::to_string(n) +
                                    " values are not whole blocks of " + std::to_string(elems));
    return checked_product("MoEGrad: row bytes", {(size_t)(n / elems), (size_t)block});
}

int round_up(int n, int step) { return (n + step - 1) / step * step; }

inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

}  // namespace

MoEGrad::MoEGrad(std::shared_ptr<Runtime> runtime, const MoEConfig& c, const MoEGradInt8& int8)
    : rt_(std::move(runtime)), cfg_(c), q_(int8) {
    if (c.experts <= 0 || c.top_k <= 0 || c.top_k > c.experts || c.hidden <= 0 || c.intermediate <= 0 || c.max_tokens <= 0)
        throw std::invalid_argument("MoEGrad: experts, top_k (<= experts), hidden, intermediate and max_tokens must be positive");
    if (!c.gate || !c.up || !c.down)
        throw std::invalid_argument("MoEGrad: the stored gate, up and down weights are needed (not int8/int4 copies alone)");
    const int biases = (c.gate_bias != nullptr) + (c.up_bias != nullptr) + (c.down_bias != nullptr);
    if (biases != 0 && biases != 3) throw std::invalid_argument("MoEGrad: pass the gate, up and down biases together, or none");
    if (!(c.swiglu_limit >= 0.f) || !std::isfinite(c.swiglu_limit) || !std::isfinite(c.swiglu_alpha))
        throw std::invalid_argument("MoEGrad: swiglu_limit must be finite and >= 0 (0: plain SwiGLU), swiglu_alpha finite");
    const size_t E = c.experts, H = c.hidden, I = c.intermediate;
    gate_row_ = grad_row_bytes(c.gate_type, c.hidden, "gate", gate_elems_, gate_blk_);
    up_row_ = grad_row_bytes(c.up_type, c.hidden, "up", up_elems_, up_blk_);
    down_row_ = grad_row_bytes(c.down_type, c.intermediate, "down", down_elems_, down_blk_);
    auto need = [](size_t got, size_t want, const char* which) {
        if (got < want)
            throw std::invalid_argument(std::string("MoEGrad: ") + which + " holds " + std::to_string(got) + " bytes, needs " +
                                        std::to_string(want));
    };
    need(c.gate_bytes, checked_product("MoEGrad: gate", {gate_row_, I, E}), "gate");
    need(c.up_bytes, checked_product("MoEGrad: up", {up_row_, I, E}), "up");
    need(c.down_bytes, checked_product("MoEGrad: down", {down_row_, H, E}), "down");
    // tasks: runs of whole blocks, at least 128 columns of I and 256 of H
    i_step_ = round_up(128, down_elems_);
    const int gate_up = std::lcm(gate_elems_, up_elems_);
    h_step_ = round_up(256, gate_up);
    const size_t P = checked_product("MoEGrad: max_tokens * top_k", {(size_t)c.max_tokens, (size_t)c.top_k});
    const size_t chunks_i = (I + i_step_ - 1) / i_step_, T = c.max_tokens;
    per_thread_ = std::max({2 * H, 2 * I, (size_t)i_step_, 2 * (size_t)h_step_});
    pair_token_.resize(P), pair_slot_.resize(P), slot_pair_.resize(P);
    expert_start_.resize(E + 1), fill_.resize(E), active_.reserve(E);
    if (int8.gate.values() || int8.up.values() || int8.down_t.values() || int8.gate_t.values() || int8.up_t.values()) {
        if (!int8.set() || int8.gate.values() != int8.up.values())
            throw std::invalid_argument("MoEGrad: pass the int8 copies D^T, G^T and U^T (with gate and up together, or "
                                        "neither), or none");
        if (!int8_gemm_available()) throw std::invalid_argument("MoEGrad: this build has no int8 GEMM (needs AVX2 or newer)");
        if (H % 64 || I % 64)
            throw std::invalid_argument("MoEGrad: the int8 copies need hidden and intermediate sizes divisible by 64");
        for (const Int8Weights* w : {&int8.gate, &int8.up, &int8.down_t, &int8.gate_t, &int8.up_t})
            if (w->values() && (!w->scale || !w->row_sum))
                throw std::invalid_argument("MoEGrad: an int8 copy lacks its scales or row sums");
        if (int8.down.values() && (!int8.down.scale || !int8.down.row_sum))
            throw std::invalid_argument("MoEGrad: the int8 copy of down lacks its scales or row sums");
    } else if (int8.down.values()) {
        throw std::invalid_argument("MoEGrad: an int8 copy of down needs those of D^T, G^T and U^T");
    }
    // the buffers, in the runtime's scratch arena (which every kernel of the runtime shares: its
    // jobs run one at a time), each part 64-byte aligned, every size checked against overflow
    size_t at = 0;
    auto take = [&](std::initializer_list<size_t> factors) {
        const size_t offset = at;
        at = checked_sum("MoEGrad: scratch", {at, checked_sum("MoEGrad: scratch", {checked_product("MoEGrad: scratch", factors), 63}) / 64 * 64});
        return offset;
    };
    const size_t f = sizeof(float), q = int8.set() ? 1 : 0;
    off_g_ = take({P, I, f}), off_u_ = take({P, I, f}), off_dhr_ = take({P, I, f}), off_dxp_ = take({P, H, f});
    off_dwp_ = take({P, chunks_i, f}), off_rows_ = take({(size_t)rt_->pool().size(), per_thread_, f});
    off_dxp_up_ = take({q, P, H, f});
    off_x8_ = take({q, T, H}), off_dy8_ = take({q, T, H}), off_dg8_ = take({q, P, I}), off_du8_ = take({q, P, I});
    off_x8s_ = take({q, T, f}), off_dy8s_ = take({q, T, f}), off_dg8s_ = take({q, P, f}), off_du8s_ = take({q, P, f});
    off_o8_ = take({q, P, H}), off_o8s_ = take({q, P, f});
    rt_->reserve_scratch(at);
}

void MoEGrad::bind_scratch() {
    uint8_t* base = rt_->scratch();
    g_ = (float*)(base + off_g_), u_ = (float*)(base + off_u_), dhr_ = (float*)(base + off_dhr_);
    dxp_ = (float*)(base + off_dxp_), dwp_ = (float*)(base + off_dwp_), rows_ = (float*)(base + off_rows_);
    dxp_up_ = (float*)(base + off_dxp_up_);
    x8_ = base + off_x8_, dy8_ = base + off_dy8_, dg8_ = base + off_dg8_, du8_ = base + off_du8_;
    x8s_ = (float*)(base + off_x8s_), dy8s_ = (float*)(base + off_dy8s_);
    dg8s_ = (float*)(base + off_dg8s_), du8s_ = (float*)(base + off_du8s_);
    o8_ = base + off_o8_, o8s_ = (float*)(base + off_o8s_);
}

void MoEGrad::check_ids(int tokens, const int64_t* ids) const {
    if (tokens < 0) throw std::invalid_argument("MoEGrad: tokens must be >= 0");
    const size_t K = cfg_.top_k;
    for (size_t i = 0, n = (size_t)tokens * K; i < n; i++)
        if (ids[i] < -1 || ids[i] >= cfg_.experts)
            throw std::invalid_argument("MoEGrad: expert id " + std::to_string(ids[i]) + " at [" + std::to_string(i / K) +
                                        ", " + std::to_string(i % K) + "] is outside [-1, " +
                                        std::to_string(cfg_.experts) + ")");
}

void MoEGrad::backward(int tokens, const int64_t* ids, const float* w, const float* x, const float* dy, float* dx,
                       float* dw, const float* gate_up) {
    check_ids(tokens, ids);
    const size_t K = cfg_.top_k, H = cfg_.hidden, I = cfg_.intermediate;
    rt_->run_inline([&] {
        bind_scratch();  // (the arena may have moved since the last call)
        for (int t0 = 0; t0 < tokens; t0 += cfg_.max_tokens) {
            const int n = std::min(cfg_.max_tokens, tokens - t0);
            chunk(n, ids + t0 * K, w + t0 * K, x + t0 * H, dy + t0 * H, dx + t0 * H, dw + t0 * K,
                  gate_up ? gate_up + t0 * K * 2 * I : nullptr);
        }
    });
}

void MoEGrad::activation_grad(int p, int i0, int i1, float wt, const float* gate_up) {
    const size_t at = (size_t)p * cfg_.intermediate;
    float *g = g_ + at, *u = u_ + at, *dr = dhr_ + at;
    // g and u: the forward's row of this pair where it handed them over (read in place), else g_, u_
    const float* gi = gate_up ? gate_up + (size_t)pair_slot_[p] * 2 * cfg_.intermediate : g;
    const float* ui = gate_up ? gi + cfg_.intermediate : u;
    const float limit = cfg_.swiglu_limit, alpha = cfg_.swiglu_alpha;
    float part = 0.f;
    int i = i0;
#if defined(__AVX2__)
    // the loop below eight columns at a time: with a scalar expf it took a sixth of the backward
    const __m256 one = _mm256_set1_ps(1.f), w8 = _mm256_set1_ps(wt);
    const __m256 lim = _mm256_set1_ps(limit), neg = _mm256_set1_ps(-limit), a = _mm256_set1_ps(alpha);
    __m256 part8 = _mm256_setzero_ps();
    for (; i + 8 <= i1; i += 8) {
        const __m256 gv = _mm256_loadu_ps(gi + i), uv = _mm256_loadu_ps(ui + i), dri = _mm256_loadu_ps(dr + i);
        const __m256 dh = _mm256_mul_ps(w8, dri);
        if (limit > 0.f) {
            const __m256 gc = _mm256_min_ps(gv, lim), uc = _mm256_min_ps(_mm256_max_ps(uv, neg), lim);
            const __m256 sg = sigmoid_ps(_mm256_mul_ps(a, gc)), glu = _mm256_mul_ps(gc, sg);
            const __m256 u1 = _mm256_add_ps(uc, one);
            part8 = _mm256_add_ps(part8, _mm256_mul_ps(_mm256_mul_ps(dri, glu), u1));
            const __m256 d = _mm256_add_ps(sg, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(gc, a), sg),
                                                             _mm256_sub_ps(one, sg)));
            const __m256 g_in = _mm256_cmp_ps(gv, lim, _CMP_LE_OQ);
            const __m256 u_in = _mm256_and_ps(_mm256_cmp_ps(uv, neg, _CMP_GE_OQ), _mm256_cmp_ps(uv, lim, _CMP_LE_OQ));
            _mm256_storeu_ps(g + i, _mm256_and_ps(g_in, _mm256_mul_ps(_mm256_mul_ps(dh, u1), d)));
            _mm256_storeu_ps(u + i, _mm256_and_ps(u_in, _mm256_mul_ps(dh, glu)));
        } else {
            const __m256 sg = sigmoid_ps(gv), silu = _mm256_mul_ps(gv, sg);
            part8 = _mm256_add_ps(part8, _mm256_mul_ps(_mm256_mul_ps(dri, silu), uv));
            const __m256 d = _mm256_add_ps(one, _mm256_mul_ps(gv, _mm256_sub_ps(one, sg)));
            _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dh, uv), sg), d));
            _mm256_storeu_ps(u + i, _mm256_mul_ps(dh, silu));
        }
    }
    part = hsum_f32(part8);
#endif
    for (; i < i1; i++) {
        const float gv = gi[i], uv = ui[i], dh = wt * dr[i];
        if (limit > 0.f) {  // gpt-oss: g' = min(g, L), u' = clamp(u, -L, L), h = g' sigmoid(alpha g') (u' + 1)
            const float gc = std::min(gv, limit), uc = std::min(std::max(uv, -limit), limit);
            const float s = sigmoid(alpha * gc), glu = gc * s;
            part += dr[i] * glu * (uc + 1.f);
            g[i] = gv <= limit ? dh * (uc + 1.f) * (s + gc * alpha * s * (1.f - s)) : 0.f;
            u[i] = (uv >= -limit && uv <= limit) ? dh * glu : 0.f;
        } else {  // h = silu(g) u
            const float s = sigmoid(gv), silu = gv * s;
            part += dr[i] * silu * uv;
            g[i] = dh * uv * s * (1.f + gv * (1.f - s));
            u[i] = dh * silu;
        }
    }
    const int chunks_i = (cfg_.intermediate + i_step_ - 1) / i_step_;
    dwp_[(size_t)p * chunks_i + i0 / i_step_] = part;
}

void MoEGrad::int8_pairs(const Int8Weights& all, int rows, int k, int e, int r0, int r1, int p0, int p1,
                         const uint8_t* act, const float* scale, bool by_token, float* out, size_t stride) const {
    constexpr int kGroup = 64;  // pairs whose activations stay in L2 while a block of rows passes
    const Int8Weights w = all.expert(e, rows, k);
    const uint8_t* xs[kGroup];
    float sx[kGroup];
    for (int g0 = p0; g0 < p1; g0 += kGroup) {
        const int m = std::min(kGroup, p1 - g0);
        for (int i = 0; i < m; i++) {
            const int row = by_token ? pair_token_[g0 + i] : g0 + i;
            xs[i] = act + (size_t)row * k, sx[i] = scale[row];
        }
        int8_rows(w, k, r0, r1, xs, sx, m, out + (size_t)g0 * stride, stride);
    }
}

void MoEGrad::quantize_inputs(int tokens, const float* x, const float* dy) {
    const size_t H = cfg_.hidden;
    rt_->pool().parallel_for(tokens, [&](int t, int) {
        if (x) x8s_[t] = quantize_row_u8(x + t * H, x8_ + t * H, (int)H);
        dy8s_[t] = quantize_row_u8(dy + t * H, dy8_ + t * H, (int)H);
    });
}

void MoEGrad::group(int tokens, const int64_t* ids) {
    const int E = cfg_.experts, K = cfg_.top_k;
    std::fill(expert_start_.begin(), expert_start_.end(), 0);
    for (int s = 0; s < tokens * K; s++)
        if (ids[s] >= 0) expert_start_[ids[s] + 1]++;
    std::partial_sum(expert_start_.begin(), expert_start_.end(), expert_start_.begin());
    std::copy(expert_start_.begin(), expert_start_.end() - 1, fill_.begin());
    active_.clear();
    for (int e = 0; e < E; e++)
        if (expert_start_[e + 1] > expert_start_[e]) active_.push_back(e);
    for (int s = 0; s < tokens * K; s++) {
        if (ids[s] < 0) {
            slot_pair_[s] = -1;
            continue;
        }
        const int p = fill_[ids[s]]++;
        pair_token_[p] = s / K, pair_slot_[p] = s, slot_pair_[s] = p;
    }
}

void MoEGrad::inner_int8(int e, int i0, int i1, const float* w, const float* x, const float* gate_up, float* buf) {
    const int H = cfg_.hidden, I = cfg_.intermediate, p0 = expert_start_[e], p1 = expert_start_[e + 1];
    const bool products = !gate_up && q_.gate_up();  // (else g, u with their biases from the forward or the blocks)
    if (products) {
        int8_pairs(q_.gate, I, H, e, i0, i1, p0, p1, x8_, x8s_, true, g_, I);
        int8_pairs(q_.up, I, H, e, i0, i1, p0, p1, x8_, x8s_, true, u_, I);
    } else if (!gate_up) {
        gate_up_blocks(e, i0, i1, x, true, buf);
    }
    int8_pairs(q_.down_t, I, H, e, i0, i1, p0, p1, dy8_, dy8s_, true, dhr_, I);
    for (int p = p0; p < p1; p++) {
        if (cfg_.gate_bias && products) {
            const size_t row = (size_t)e * I;
            for (int i = i0; i < i1; i++) g_[(size_t)p * I + i] += cfg_.gate_bias[row + i];
            for (int i = i0; i < i1; i++) u_[(size_t)p * I + i] += cfg_.up_bias[row + i];
        }
        activation_grad(p, i0, i1, w[pair_slot_[p]], gate_up);
    }
}

void MoEGrad::gate_up_blocks(int e, int i0, int i1, const float* x, bool bias, float* buf) {
    const int H = cfg_.hidden, I = cfg_.intermediate, p0 = expert_start_[e], p1 = expert_start_[e + 1];
    const uint8_t *gate = static_cast<const uint8_t*>(cfg_.gate), *up = static_cast<const uint8_t*>(cfg_.up);
    for (int i = i0; i < i1; i++) {  // g, u: rows of G and U against x
        const size_t row = (size_t)e * I + i;
        dequant_blocks(cfg_.gate_type, gate + row * gate_row_, H / gate_elems_, buf);
        dequant_blocks(cfg_.up_type, up + row * up_row_, H / up_elems_, buf + H);
        const float bg = bias && cfg_.gate_bias ? cfg_.gate_bias[row] : 0.f;
        const float bu = bias && cfg_.up_bias ? cfg_.up_bias[row] : 0.f;
        for (int p = p0; p < p1; p++) {
            const float* xt = pair_row(x, p, true, H);
            g_[(size_t)p * I + i] = fdot(buf, xt, H) + bg;
            u_[(size_t)p * I + i] = fdot(buf + H, xt, H) + bu;
        }
    }
}

void MoEGrad::down_t_blocks(int e, int i0, int i1, const float* src, bool by_token, float* buf) {
    const int H = cfg_.hidden, I = cfg_.intermediate, p0 = expert_start_[e], p1 = expert_start_[e + 1];
    const uint8_t* down = static_cast<const uint8_t*>(cfg_.down);
    for (int p = p0; p < p1; p++) std::fill_n(dhr_ + (size_t)p * I + i0, i1 - i0, 0.f);
    for (int r = 0; r < H; r++) {  // D^T src: each row of D's run [i0, i1) times src[r]
        dequant_blocks(cfg_.down_type, down + ((size_t)e * H + r) * down_row_ + (size_t)(i0 / down_elems_) * down_blk_,
                       (i1 - i0) / down_elems_, buf);
        for (int p = p0; p < p1; p++) {
            const float a = pair_row(src, p, by_token, H)[r];
            float* out = dhr_ + (size_t)p * I + i0;
            for (int j = 0; j < i1 - i0; j++) out[j] += a * buf[j];
        }
    }
}

void MoEGrad::down_blocks(int e, int r0, int r1, const float* h, float* buf) {
    const int H = cfg_.hidden, I = cfg_.intermediate, p0 = expert_start_[e], p1 = expert_start_[e + 1];
    const uint8_t* down = static_cast<const uint8_t*>(cfg_.down);
    for (int r = r0; r < r1; r++) {  // o[r] = D's row r against each pair's h
        dequant_blocks(cfg_.down_type, down + ((size_t)e * H + r) * down_row_, I / down_elems_, buf);
        for (int p = p0; p < p1; p++) dxp_[(size_t)p * H + r] = fdot(buf, pair_row(h, p, false, I), I);
    }
}

void MoEGrad::inner_blocks(int e, int i0, int i1, const float* w, const float* x, const float* dy,
                           const float* gate_up, float* buf) {
    if (!gate_up) gate_up_blocks(e, i0, i1, x, true, buf);
    down_t_blocks(e, i0, i1, dy, true, buf);
    for (int p = expert_start_[e]; p < expert_start_[e + 1]; p++)
        activation_grad(p, i0, i1, w[pair_slot_[p]], gate_up);
}

void MoEGrad::outer_blocks(int e, int c0, int c1, float* buf) {
    const int H = cfg_.hidden, I = cfg_.intermediate, n = c1 - c0, p0 = expert_start_[e], p1 = expert_start_[e + 1];
    const uint8_t *gate = static_cast<const uint8_t*>(cfg_.gate), *up = static_cast<const uint8_t*>(cfg_.up);
    float *bg = buf, *bu = buf + h_step_;
    for (int p = p0; p < p1; p++) std::fill_n(dxp_ + (size_t)p * H + c0, n, 0.f);
    for (int i = 0; i < I; i++) {  // each row of G's and U's run [c0, c1) times dg[i], du[i]
        const size_t row = (size_t)e * I + i;
        dequant_blocks(cfg_.gate_type, gate + row * gate_row_ + (size_t)(c0 / gate_elems_) * gate_blk_, n / gate_elems_, bg);
        dequant_blocks(cfg_.up_type, up + row * up_row_ + (size_t)(c0 / up_elems_) * up_blk_, n / up_elems_, bu);
        for (int p = p0; p < p1; p++) {
            const float a = g_[(size_t)p * I + i], b = u_[(size_t)p * I + i];
            float* out = dxp_ + (size_t)p * H + c0;
            for (int j = 0; j < n; j++) out[j] += a * bg[j] + b * bu[j];
        }
    }
}

void MoEGrad::chunk(int tokens, const int64_t* ids, const float* w, const float* x, const float* dy, float* dx,
                    float* dw, const float* gate_up) {
    const int K = cfg_.top_k, H = cfg_.hidden, I = cfg_.intermediate;
    group(tokens, ids);
    if (int8()) quantize_inputs(tokens, !gate_up && q_.gate_up() ? x : nullptr, dy);  // (x: for g and u's products)
    const size_t per_thread = per_thread_;
    ThreadPool& pool = rt_->pool();

    // g, u (the forward's, or recomputed); D^T dy; then dw's parts and dg, du, by column runs of I
    const int chunks_i = (I + i_step_ - 1) / i_step_;
    pool.parallel_for((int)active_.size() * chunks_i, [&](int task, int thread) {
        const int e = active_[task / chunks_i], i0 = (task % chunks_i) * i_step_, i1 = std::min(I, i0 + i_step_);
        if (int8()) inner_int8(e, i0, i1, w, x, gate_up, rows_ + thread * per_thread);
        else inner_blocks(e, i0, i1, w, x, dy, gate_up, rows_ + thread * per_thread);
    });

    pairs_dx();

    // per token: the sum of its pairs' dx, and each slot's dw
    pool.parallel_for(tokens, [&](int t, int) {
        token_dx(t, dx + (size_t)t * H);
        for (int k = 0; k < K; k++) {
            const int s = t * K + k, p = slot_pair_[s];
            if (p < 0) {
                dw[s] = 0.f;
                continue;
            }
            float sum = 0.f;
            for (int c = 0; c < chunks_i; c++) sum += dwp_[(size_t)p * chunks_i + c];
            if (cfg_.down_bias) sum += fdot(dy + (size_t)t * H, cfg_.down_bias + (size_t)ids[s] * H, H);
            dw[s] = sum;
        }
    });
}

void MoEGrad::pairs_dx() {
    const int H = cfg_.hidden, I = cfg_.intermediate;
    ThreadPool& pool = rt_->pool();
    const size_t per_thread = per_thread_;
    const int chunks_h = (H + h_step_ - 1) / h_step_;
    if (int8()) {
        pool.parallel_for(expert_start_[cfg_.experts], [&](int p, int) {  // dg, du as int8 rows
            const size_t at = (size_t)p * I;
            dg8s_[p] = quantize_row_u8(g_ + at, dg8_ + at, I);
            du8s_[p] = quantize_row_u8(u_ + at, du8_ + at, I);
        });
    }
    pool.parallel_for((int)active_.size() * chunks_h, [&](int task, int thread) {
        const int e = active_[task / chunks_h], c0 = (task % chunks_h) * h_step_, c1 = std::min(H, c0 + h_step_);
        const int p0 = expert_start_[e], p1 = expert_start_[e + 1];
        if (int8()) {
            int8_pairs(q_.gate_t, H, I, e, c0, c1, p0, p1, dg8_, dg8s_, false, dxp_, H);
            int8_pairs(q_.up_t, H, I, e, c0, c1, p0, p1, du8_, du8s_, false, dxp_up_, H);
        } else {
            outer_blocks(e, c0, c1, rows_ + thread * per_thread);
        }
    });
}

void MoEGrad::token_dx(int t, float* out) const {
    const int K = cfg_.top_k, H = cfg_.hidden;
    std::fill_n(out, H, 0.f);
    for (int k = 0; k < K; k++) {
        const int p = slot_pair_[t * K + k];
        if (p < 0) continue;
        const float* src = dxp_ + (size_t)p * H;
        for (int j = 0; j < H; j++) out[j] += src[j];
        if (int8()) {
            const float* more = dxp_up_ + (size_t)p * H;
            for (int j = 0; j < H; j++) out[j] += more[j];
        }
    }
}

void MoEGrad::pairs(PairOp op, int tokens, const int64_t* ids, const float* a, const float* b, float* out, float* out2) {
    if (op < kGateUp || op > kGateUpT) throw std::invalid_argument("MoEGrad: pairs op must be 0 to 3");
    if ((op == kGateUp) != (out2 != nullptr) || (op == kGateUpT) != (b != nullptr))
        throw std::invalid_argument("MoEGrad: pairs takes b with kGateUpT alone, and out2 with kGateUp alone");
    check_ids(tokens, ids);
    const size_t K = cfg_.top_k, H = cfg_.hidden, I = cfg_.intermediate;
    const size_t a_row = op == kGateUp ? H : op == kDownT ? K * H : K * I;  // floats per token
    const size_t out_row = op == kGateUpT ? H : op == kDown ? K * H : K * I;
    rt_->run_inline([&] {
        bind_scratch();
        for (int t0 = 0; t0 < tokens; t0 += cfg_.max_tokens) {
            const int n = std::min(cfg_.max_tokens, tokens - t0);
            pairs_chunk(op, n, ids + t0 * K, a + t0 * a_row, b ? b + t0 * a_row : nullptr, out + t0 * out_row,
                        out2 ? out2 + t0 * out_row : nullptr);
        }
    });
}

void MoEGrad::scatter_pairs(int tokens, const float* src, int n, float* dst) {
    rt_->pool().parallel_for(tokens * cfg_.top_k, [&](int s, int) {
        const int p = slot_pair_[s];
        float* d = dst + (size_t)s * n;
        if (p < 0) std::fill_n(d, n, 0.f);
        else std::copy_n(src + (size_t)p * n, n, d);
    });
}

void MoEGrad::pairs_chunk(PairOp op, int tokens, const int64_t* ids, const float* a, const float* b, float* out,
                          float* out2) {
    constexpr int kRows = 16;  // rows of D a task computes (kDown)
    const int K = cfg_.top_k, H = cfg_.hidden, I = cfg_.intermediate;
    group(tokens, ids);
    ThreadPool& pool = rt_->pool();
    const size_t per_thread = per_thread_;
    const int chunks_i = (I + i_step_ - 1) / i_step_, active = (int)active_.size();
    // the pairs' rows of a [T*K, n] array as int8 rows (+ 128) in pair order, with their scales
    auto quantize_pairs = [&](const float* src, int n, uint8_t* q, float* scale) {
        pool.parallel_for(tokens * K, [&](int s, int) {
            const int p = slot_pair_[s];
            if (p >= 0) scale[p] = quantize_row_u8(src + (size_t)s * n, q + (size_t)p * n, n);
        });
    };
    switch (op) {
        case kGateUp:
            if (q_.gate_up())
                pool.parallel_for(tokens, [&](int t, int) {
                    x8s_[t] = quantize_row_u8(a + (size_t)t * H, x8_ + (size_t)t * H, H);
                });
            pool.parallel_for(active * chunks_i, [&](int task, int thread) {
                const int e = active_[task / chunks_i], i0 = (task % chunks_i) * i_step_, i1 = std::min(I, i0 + i_step_);
                const int p0 = expert_start_[e], p1 = expert_start_[e + 1];
                if (q_.gate_up()) {
                    int8_pairs(q_.gate, I, H, e, i0, i1, p0, p1, x8_, x8s_, true, g_, I);
                    int8_pairs(q_.up, I, H, e, i0, i1, p0, p1, x8_, x8s_, true, u_, I);
                } else {
                    gate_up_blocks(e, i0, i1, a, false, rows_ + thread * per_thread);
                }
            });
            scatter_pairs(tokens, g_, I, out);
            scatter_pairs(tokens, u_, I, out2);
            break;
        case kDown: {
            const bool q = q_.down.values();
            if (q) quantize_pairs(a, I, dg8_, dg8s_);
            const int chunks_r = (H + kRows - 1) / kRows;
            pool.parallel_for(active * chunks_r, [&](int task, int thread) {
                const int e = active_[task / chunks_r], r0 = (task % chunks_r) * kRows, r1 = std::min(H, r0 + kRows);
                if (q) int8_pairs(q_.down, H, I, e, r0, r1, expert_start_[e], expert_start_[e + 1], dg8_, dg8s_, false, dxp_, H);
                else down_blocks(e, r0, r1, a, rows_ + thread * per_thread);
            });
            scatter_pairs(tokens, dxp_, H, out);
            break;
        }
        case kDownT:
            if (int8()) quantize_pairs(a, H, o8_, o8s_);
            pool.parallel_for(active * chunks_i, [&](int task, int thread) {
                const int e = active_[task / chunks_i], i0 = (task % chunks_i) * i_step_, i1 = std::min(I, i0 + i_step_);
                if (int8()) int8_pairs(q_.down_t, I, H, e, i0, i1, expert_start_[e], expert_start_[e + 1], o8_, o8s_, false, dhr_, I);
                else down_t_blocks(e, i0, i1, a, false, rows_ + thread * per_thread);
            });
            scatter_pairs(tokens, dhr_, I, out);
            break;
        case kGateUpT:
            pool.parallel_for(tokens * K, [&](int s, int) {  // dg, du into g_, u_ in pair order
                const int p = slot_pair_[s];
                if (p < 0) return;
                std::copy_n(a + (size_t)s * I, I, g_ + (size_t)p * I);
                std::copy_n(b + (size_t)s * I, I, u_ + (size_t)p * I);
            });
            pairs_dx();
            pool.parallel_for(tokens, [&](int t, int) { token_dx(t, out + (size_t)t * H); });
            break;
    }
}

}  // namespace kt
