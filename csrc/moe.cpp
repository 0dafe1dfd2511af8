// MoE forward: prepare activations -> group (token, expert) pairs by expert -> gate/up rows ->
// (+ biases) act(g, u) -> down rows -> (+ bias) weighted sum per token. Each phase is one parallel_for (a decode call
// runs the middle three as one, gate_up_down); work is split by weight rows so that every thread
// streams its own part of the experts' bytes.
#include "moe.h"

#include "checked.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>
#include <thread>

namespace kt {
namespace {

const Format* need_format(int type, Bf16Kernel bf16, const char* which) {
    const Format* f = find_format(type, bf16);
    if (!f) throw std::invalid_argument(std::string("MoE: ") + which + " has ggml type " + std::to_string(type) +
                                        ", not computed on here; supported: " + supported_formats());
    return f;
}

size_t row_bytes(const Format* f, int n, const char* which) {
    if (n % f->block_elems)
        throw std::invalid_argument(std::string("MoE: ") + which + " rows of " + std::to_string(n) + " values are not a whole number of " +
                                    f->name + " blocks (" + std::to_string(f->block_elems) + ")");
    return (size_t)(n / f->block_elems) * f->block_bytes;
}

void need_bytes(size_t got, size_t want, const char* which) {
    if (got != want)
        throw std::invalid_argument(std::string("MoE: ") + which + " holds " + std::to_string(got) + " bytes, expected " + std::to_string(want));
}

// Quantized rows as stored (formats without tiles) get no software prefetch: their rows are read one
// after another, a stream the hardware prefetchers follow, and prefetches issued ahead of them
// (any distance, any locality hint) only slowed decode.

// Tokens of one expert computed together against each weight row (their activations stay in
// L1/L2 while the row streams once per group).
constexpr int kMaxGroup = 16;
constexpr int kMaxInt8Group = 64;  // int8 path: tokens whose activations stay in L2 per weight row block
// Formats without tiles: tokens a group, taken four at a time against a block of rows in L1
// (dot_rows_block), so the rows of a task stream from L2 once per group.
constexpr int kMaxRowGroup = 64;

// rows r0..r1 of w (an expert's matrix) against m tokens' activations a into dst[i * stride + r]:
// tiled formats 16 rows at a time through `out` (kMaxGroup tokens at most), the others directly
void rows_to(const Format* f, int n, const uint8_t* w, size_t row_bytes, int r0, int r1, const void* const* a, int m,
             float* out, float* dst, size_t stride) {
    if (rows_step(f) == 1) return dot_rows_block(f, n, w, row_bytes, r0, r1, a, m, dst, stride);
    for (int r = r0; r < r1; r += kTileRows) {
        dot_step(f, n, w, row_bytes, r, a, m, out);
        for (int i = 0; i < m; i++) std::copy(out + i * kTileRows, out + (i + 1) * kTileRows, dst + (size_t)i * stride + r);
    }
}

// A decode-sized call: about a token an expert (at most two, on average, over the experts hit).
bool decode_sized(int pairs, int experts_active) { return pairs <= 2 * experts_active; }

// Rows of one expert split into chunks: enough tasks for every thread, chunks big enough to stream.
// Decode: long runs of rows stream best, and a dynamic schedule still balances with a few tasks a
// thread (more, shorter runs read the weights no faster, even with most of a model's layers
// cycling through the caches). Prefill (experts with unequal token counts) needs more tasks a
// thread to balance.
constexpr int kDecodeTasksPerThread = 4, kPrefillTasksPerThread = 16;
int chunk_rows(int rows, int experts_active, int pairs, int threads) {
    const int active = std::max(1, experts_active);
    const int per_thread = decode_sized(pairs, experts_active) ? kDecodeTasksPerThread : kPrefillTasksPerThread;
    const int want_tasks = std::max(1, (per_thread * threads + active - 1) / active);
    const int chunk = std::max(16, (rows + want_tasks - 1) / want_tasks);
    return (chunk + 15) / 16 * 16;  // whole 16-row blocks (the AMX tiles' height)
}

}  // namespace

void MoE::check_stored(const MoEConfig& c) {
    if (!c.gate || !c.up || !c.down) throw std::invalid_argument("MoE: null weight pointer");
    gate_fmt_ = need_format(c.gate_type, c.bf16, "gate");
    up_fmt_ = need_format(c.up_type, c.bf16, "up");
    down_fmt_ = need_format(c.down_type, c.bf16, "down");
    gate_row_ = row_bytes(gate_fmt_, c.hidden, "gate");
    up_row_ = row_bytes(up_fmt_, c.hidden, "up");
    down_row_ = row_bytes(down_fmt_, c.intermediate, "down");
    const size_t I = c.intermediate, H = c.hidden, E = c.experts;
    need_bytes(c.gate_bytes, checked_product("MoE: gate", {gate_row_, I, E}), "gate");
    need_bytes(c.up_bytes, checked_product("MoE: up", {up_row_, I, E}), "up");
    need_bytes(c.down_bytes, checked_product("MoE: down", {down_row_, H, E}), "down");
    if ((rows_step(gate_fmt_) > 1 || rows_step(up_fmt_) > 1) && c.intermediate % kTileRows)
        throw std::invalid_argument("MoE: tiled gate/up weights need intermediate % 16 == 0, got " + std::to_string(c.intermediate));
    if (rows_step(down_fmt_) > 1 && c.hidden % kTileRows)
        throw std::invalid_argument("MoE: tiled down weights need hidden % 16 == 0, got " + std::to_string(c.hidden));
    gate_act_ = act_row_bytes(gate_fmt_->act, c.hidden);
    up_act_ = act_row_bytes(up_fmt_->act, c.hidden);
    down_act_ = act_row_bytes(down_fmt_->act, c.intermediate);
    separate_up_ = up_fmt_->act != gate_fmt_->act;
}

MoE::MoE(std::shared_ptr<Runtime> runtime, const MoEConfig& c) : rt_(std::move(runtime)), cfg_(c) {
    if (c.experts <= 0 || c.top_k <= 0 || c.top_k > c.experts || c.hidden <= 0 || c.intermediate <= 0 || c.max_tokens <= 0)
        throw std::invalid_argument("MoE: experts, top_k (<= experts), hidden, intermediate and max_tokens must be positive");
    const int biases = (c.gate_bias != nullptr) + (c.up_bias != nullptr) + (c.down_bias != nullptr);
    if (biases != 0 && biases != 3) throw std::invalid_argument("MoE: pass the gate, up and down biases together, or none");
    if (!(c.swiglu_limit >= 0.f) || !std::isfinite(c.swiglu_limit) || !std::isfinite(c.swiglu_alpha))
        throw std::invalid_argument("MoE: swiglu_limit must be finite and >= 0 (0: plain SwiGLU), swiglu_alpha finite");
    if (copies_only()) {  // no stored weights: every expert through the int8/int4 copies
        if (c.int8_min_tokens != 1)
            throw std::invalid_argument("MoE: without stored weights every expert must take the int8/int4 copies "
                                        "(int8_min_tokens 1)");
    } else {
        check_stored(c);
    }
    // the scratch's parts, each 64-byte aligned, every size and offset checked against overflow
    const size_t T = c.max_tokens, P = checked_product("MoE: max_tokens * top_k", {T, (size_t)c.top_k});
    auto part = [](std::initializer_list<size_t> factors) {
        return checked_sum("MoE: scratch", {checked_product("MoE: scratch", factors), 63}) / 64 * 64;
    };
    auto next = [](size_t at, size_t bytes) { return checked_sum("MoE: scratch", {at, bytes}); };
    off_gate_ = part({T, (size_t)c.hidden, sizeof(float)});
    off_x_up_ = next(off_gate_, part({T, gate_act_}));
    off_g_ = next(off_x_up_, separate_up_ ? part({T, up_act_}) : 0);
    off_u_ = next(off_g_, part({P, (size_t)c.intermediate, sizeof(float)}));
    off_h_ = next(off_u_, part({P, (size_t)c.intermediate, sizeof(float)}));
    off_y_ = next(off_h_, part({P, down_act_}));
    off_xu8_ = next(off_y_, part({P, (size_t)c.hidden, sizeof(float)}));
    off_hu8_ = next(off_xu8_, c.int8_min_tokens ? part({T, (size_t)c.hidden}) : 0);
    off_xs_ = next(off_hu8_, c.int8_min_tokens ? part({P, (size_t)c.intermediate}) : 0);
    off_hs_ = next(off_xs_, part({T, sizeof(float)}));
    rt_->reserve_scratch(next(off_hs_, part({P, sizeof(float)})));
    if (c.int8_min_tokens > 0) {
        if (!int8_gemm_available()) throw std::invalid_argument("MoE: this build has no int8 GEMM (needs AVX2 or newer)");
        if (c.gate4.q && !int4_gemm_available()) throw std::invalid_argument("MoE: this build has no int4 GEMM (needs AVX512-VNNI)");
        if (c.hidden % 64 || c.intermediate % 64)
            throw std::invalid_argument("MoE: int8/int4 prefill needs hidden and intermediate sizes divisible by 64");
        if (c.gate4.q) {
            const int g = c.gate4.group;
            for (const Int4Weights* w : {&c.gate4, &c.up4, &c.down4})
                if (!w->q || !w->scale || !w->corr || w->group != g)
                    throw std::invalid_argument("MoE: int4 prefill needs q, scale and corr of one group size for gate, up and down");
            if (g <= 0 || g % 64 || c.hidden % g || c.intermediate % g)
                throw std::invalid_argument("MoE: int4 group " + std::to_string(g) + " must be a multiple of 64 dividing hidden (" +
                                            std::to_string(c.hidden) + ") and intermediate (" +
                                            std::to_string(c.intermediate) + ")");
        } else if (!c.gate8.values() || !c.up8.values() || !c.down8.values() || !c.gate8.scale || !c.gate8.row_sum) {
            throw std::invalid_argument("MoE: int8 prefill asked for without int8 weights");
        }
    }
    pair_token_.resize(P);
    pair_slot_.resize(P);
    pair_expert_.resize(P);
    slot_pair_.resize(P);
    expert_start_.resize(c.experts + 1);
    fill_.resize(c.experts);
    active_.reserve(c.experts);
    chunks_left_.reset(new Countdown[c.experts]);
}

void MoE::check(int tokens, const int64_t* ids) const {
    if (tokens < 0) throw std::invalid_argument("MoE: negative token count");
    for (int64_t i = 0; i < (int64_t)tokens * cfg_.top_k; i++)
        if (ids[i] < -1 || ids[i] >= cfg_.experts)  // -1: the pair is computed elsewhere (GPU experts)
            throw std::invalid_argument("MoE: expert id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                                        " is outside [0, " + std::to_string(cfg_.experts) + ") (-1 skips a pair)");
}

void MoE::forward(int tokens, const int64_t* ids, const float* weights, const void* x, void* y, Dtype dtype,
                  bool hold_deferred) {
    check(tokens, ids);
    rt_->run_inline([&] {  // after anything queued before
        run(tokens, ids, weights, x, y, dtype);
        if (!hold_deferred) compute_deferred();
    });
}

void MoE::forward_keeping(int tokens, const int64_t* ids, const float* weights, const void* x, void* y, Dtype dtype,
                          float* gate_up) {
    check(tokens, ids);
    if (next_) throw std::invalid_argument("MoE: forward_keeping does not defer experts; set_deferral(0) first");
    const size_t row = 2 * (size_t)cfg_.intermediate, K = cfg_.top_k;
    rt_->run_inline([&] {
        for (size_t s = 0; s < (size_t)tokens * K; s++)
            if (ids[s] < 0) std::fill_n(gate_up + s * row, row, 0.f);
        keep_ = gate_up;
        try {
            run(tokens, ids, weights, x, y, dtype);
        } catch (...) {
            keep_ = nullptr;
            throw;
        }
        keep_ = nullptr;
    });
}

void MoE::submit(int tokens, const int64_t* ids, const float* weights, const void* x, void* y, Dtype dtype) {
    check(tokens, ids);
    rt_->submit([=] {
        run(tokens, ids, weights, x, y, dtype);
        compute_deferred();
    });
}

void MoE::run_deferred() {
    if (later_tokens_.load(std::memory_order_relaxed)) rt_->run_inline([&] { compute_deferred(); });
}

void MoE::set_deferral(int defer, std::shared_ptr<MoE> next) {
    if (defer < 0 || defer >= cfg_.top_k)
        throw std::invalid_argument("MoE: deferred experts must lie in [0, top_k - 1 = " + std::to_string(cfg_.top_k - 1) +
                                    "], got " + std::to_string(defer));
    if (defer > 0 && (!next || next.get() == this || next->cfg_.hidden != cfg_.hidden))
        throw std::invalid_argument("MoE: deferral needs the next layer's MoE, of the same hidden size");
    if (defer > 0) {
        next->carry_.assign(checked_product("MoE: carry", {(size_t)cfg_.max_tokens, (size_t)cfg_.hidden}), 0.f);
        const size_t slots = (size_t)cfg_.max_tokens * cfg_.top_k;
        ids_now_.resize(slots);
        ids_later_.resize(slots);
        w_later_.resize(slots);
        kept_.assign(cfg_.experts, 0);
        order_.resize(cfg_.top_k);
    }
    defer_ = defer;
    next_ = defer > 0 ? std::move(next) : nullptr;
}

MoE::Scratch MoE::bind_scratch() {
    uint8_t* base = rt_->scratch();
    Scratch s;
    s.x_f32 = (float*)base;
    s.x_gate = base + off_gate_;
    s.x_up = separate_up_ ? base + off_x_up_ : s.x_gate;
    s.g = (float*)(base + off_g_);
    s.u = (float*)(base + off_u_);
    s.h_act = base + off_h_;
    s.y_pairs = (float*)(base + off_y_);
    s.x_u8 = base + off_xu8_;
    s.h_u8 = base + off_hu8_;
    s.x_s = (float*)(base + off_xs_);
    s.h_s = (float*)(base + off_hs_);
    return s;
}

void MoE::run(int tokens, const int64_t* ids, const float* weights, const void* x, void* y, Dtype dtype) {
    const auto t0 = std::chrono::steady_clock::now();
    s_ = bind_scratch();
    const float* carry = take_carry(tokens);
    if (split_deferred(tokens, ids, weights)) ids = ids_now_.data();
    const size_t elem = dtype == Dtype::F32 ? 4 : 2;
    for (int start = 0; start < tokens; start += cfg_.max_tokens) {  // longer inputs in max_tokens chunks
        const int n = std::min(cfg_.max_tokens, tokens - start);
        chunk_slot0_ = (size_t)start * cfg_.top_k;
        prepare_inputs(n, (const uint8_t*)x + start * cfg_.hidden * elem, dtype);
        group_by_expert(n, ids + (size_t)start * cfg_.top_k);
        compute();
        combine(n, weights + (size_t)start * cfg_.top_k, (uint8_t*)y + start * cfg_.hidden * elem, dtype,
                carry ? carry + (size_t)start * cfg_.hidden : nullptr);
    }
    last_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                   std::memory_order_relaxed);
}

void MoE::compute() {
    bool decode = decode_sized(expert_start_[cfg_.experts], (int)active_.size());
    for (int e : active_) decode &= copies_only() || !use_int8(e);  // (mixed paths: the barriers)
    if (decode) {
        one_region_calls_.fetch_add(1, std::memory_order_relaxed);
        gate_up_down();
    } else {
        gate_up();
        activate();
        down();
    }
}

const float* MoE::take_carry(int tokens) {
    const int carried = carry_tokens_.exchange(0, std::memory_order_acquire);
    if (carried == 0) return nullptr;
    if (carried != tokens)  // (the previous layer's last call was for another batch: a caller's bug)
        throw std::invalid_argument("MoE: the previous layer deferred experts of " + std::to_string(carried) +
                                    " tokens, this call has " + std::to_string(tokens));
    return carry_.data();
}

bool MoE::split_deferred(int tokens, const int64_t* ids, const float* weights) {
    later_tokens_.store(0, std::memory_order_relaxed);
    if (!next_) return false;
    next_->carry_tokens_.store(0, std::memory_order_relaxed);  // (replaced below, or none)
    if (!deferring_.load(std::memory_order_relaxed) || tokens > cfg_.max_tokens || tokens > next_->cfg_.max_tokens)
        return false;
    const int K = cfg_.top_k;
    std::fill(kept_.begin(), kept_.end(), 0);
    // Each token keeps all but the `defer` lowest weights of its pairs here (ties: the earlier slot
    // stays). Pairs computed elsewhere (-1: hot experts, the bus share's lowest-weight columns)
    // are not counted: deferral moves this call's own work.
    for (int t = 0; t < tokens; t++) {
        const float* w = weights + (size_t)t * K;
        const int64_t* row = ids + (size_t)t * K;
        int n = 0;
        for (int k = 0; k < K; k++)
            if (row[k] >= 0) order_[n++] = k;
        std::stable_sort(order_.begin(), order_.begin() + n, [w](int a, int b) { return w[a] > w[b]; });
        for (int i = 0; i < n - defer_; i++) kept_[row[order_[i]]] = 1;
    }
    bool any = false;
    for (int64_t s = 0; s < (int64_t)tokens * K; s++) {
        const bool later = ids[s] >= 0 && !kept_[ids[s]];
        ids_now_[s] = later ? -1 : ids[s];
        ids_later_[s] = later ? ids[s] : -1;
        any |= later;
    }
    if (!any) return false;
    std::copy(weights, weights + (size_t)tokens * K, w_later_.begin());
    later_tokens_.store(tokens, std::memory_order_relaxed);
    return true;
}

void MoE::compute_deferred() {
    const int tokens = later_tokens_.exchange(0, std::memory_order_relaxed);
    if (tokens == 0) return;
    // the call's prepared input rows are still in the scratch (combine overwrote only x_f32)
    s_ = bind_scratch();
    group_by_expert(tokens, ids_later_.data());
    compute();
    combine(tokens, w_later_.data(), next_->carry_.data(), Dtype::F32);
    next_->carry_tokens_.store(tokens, std::memory_order_release);
}

void MoE::prepare_inputs(int tokens, const void* x, Dtype dtype) {
    const int H = cfg_.hidden;
    rt_->pool().parallel_for(tokens, [&](int t, int) {
        float* row = &s_.x_f32[(size_t)t * H];
        if (dtype == Dtype::F32) {
            std::copy((const float*)x + (size_t)t * H, (const float*)x + (size_t)(t + 1) * H, row);
        } else {
            const bf16_t* src = (const bf16_t*)x + (size_t)t * H;
            for (int i = 0; i < H; i++) row[i] = bf16_to_f32(src[i]);
        }
        if (gate_fmt_) prepare_act(gate_fmt_->act, row, &s_.x_gate[t * gate_act_], H);
        if (cfg_.int8_min_tokens) s_.x_s[t] = quantize_row_u8(row, &s_.x_u8[(size_t)t * H], H);
        if (separate_up_) prepare_act(up_fmt_->act, row, &s_.x_up[t * up_act_], H);
    });
}

void MoE::group_by_expert(int tokens, const int64_t* ids) {
    const int K = cfg_.top_k, E = cfg_.experts;
    std::fill(expert_start_.begin(), expert_start_.end(), 0);
    for (int s = 0; s < tokens * K; s++)
        if (ids[s] >= 0) expert_start_[ids[s] + 1]++;
    active_.clear();
    for (int e = 0; e < E; e++) {
        if (expert_start_[e + 1]) active_.push_back(e);
        expert_start_[e + 1] += expert_start_[e];
    }
    experts_read_.fetch_add(active_.size(), std::memory_order_relaxed);
    std::copy(expert_start_.begin(), expert_start_.end() - 1, fill_.begin());
    for (int s = 0; s < tokens * K; s++) {
        if (ids[s] < 0) {  // skipped pair: contributes nothing
            slot_pair_[s] = -1;
            continue;
        }
        const int p = fill_[ids[s]]++;
        pair_token_[p] = s / K;
        pair_slot_[p] = s;
        pair_expert_[p] = (int)ids[s];
        slot_pair_[s] = p;
    }
}

template <typename Fn>
void MoE::for_expert_rows(int rows, Fn fn) {
    const int chunk = chunk_rows(rows, (int)active_.size(), expert_start_[cfg_.experts], rt_->pool().size());
    const int per_expert = (rows + chunk - 1) / chunk;
    rt_->pool().parallel_for((int)active_.size() * per_expert, [&](int task, int) {
        const int r0 = (task % per_expert) * chunk;
        fn(active_[task / per_expert], r0, std::min(rows, r0 + chunk));
    });
}

void MoE::gate_up() {
    for_expert_rows(cfg_.intermediate, [&](int e, int r0, int r1) {
        if (use_int8(e)) gate_up_int8(e, r0, r1);
        else gate_up_rows(e, r0, r1);
    });
}

void MoE::gate_up_rows(int e, int r0, int r1) {
    const int I = cfg_.intermediate, H = cfg_.hidden;
    const uint8_t* gw = (const uint8_t*)cfg_.gate + ((size_t)e * I) * gate_row_;
    const uint8_t* uw = (const uint8_t*)cfg_.up + ((size_t)e * I) * up_row_;
    const int p0 = expert_start_[e], count = expert_start_[e + 1] - p0;
    const void* xg[kMaxRowGroup];
    const void* xu[kMaxRowGroup];
    float out[kMaxGroup * kTileRows];
    const int gs = rows_step(gate_fmt_), us = rows_step(up_fmt_);
    prefetch_prologue(gw + (size_t)r0 * gate_row_, (size_t)(r1 - r0) * gate_row_);
    prefetch_prologue(uw + (size_t)r0 * up_row_, (size_t)(r1 - r0) * up_row_);
    const int group = gs == 1 && us == 1 ? kMaxRowGroup : kMaxGroup;
    for (int g0 = 0; g0 < count; g0 += group) {  // tokens of this expert, a group at a time
        const int m = std::min(group, count - g0);
        for (int i = 0; i < m; i++) {
            const int t = pair_token_[p0 + g0 + i];
            xg[i] = &s_.x_gate[t * gate_act_];
            xu[i] = &s_.x_up[t * up_act_];
        }
        float* g = &s_.g[(size_t)(p0 + g0) * I];
        float* u = &s_.u[(size_t)(p0 + g0) * I];
        int from = r0;  // BF16 gate and up: the AMX tiles take both on one packing of the tokens
        if (gate_fmt_->bf16 == Bf16Kernel::Amx && up_fmt_->bf16 == Bf16Kernel::Amx) {
            const Bf16Matrix mats[2] = {{gw, g}, {uw, u}};
            from = amx_bf16_rows(H, mats, 2, gate_row_, r0, r1, xg, m, I);
        }
        rows_to(gate_fmt_, H, gw, gate_row_, from, r1, xg, m, out, g, I);
        rows_to(up_fmt_, H, uw, up_row_, from, r1, xu, m, out, u, I);
    }
}

void MoE::quant_rows(int proj, int e, int r0, int r1, const uint8_t* const* xs, const float* sx, int m, float* out,
                     size_t stride) const {
    const int rows = proj == 2 ? cfg_.hidden : cfg_.intermediate, cols = proj == 2 ? cfg_.intermediate : cfg_.hidden;
    const size_t at = (size_t)e * rows;  // the expert's first row
    if (cfg_.gate4.q) {
        const Int4Weights& all = proj == 0 ? cfg_.gate4 : proj == 1 ? cfg_.up4 : cfg_.down4;
        Int4Weights w = all;
        w.q = all.q + at * cols / 2;
        w.scale = all.scale + at * (cols / all.group);
        w.corr = all.corr + at;
        int4_rows(w, cols, r0, r1, xs, sx, m, out, stride);
        return;
    }
    const Int8Weights& all = proj == 0 ? cfg_.gate8 : proj == 1 ? cfg_.up8 : cfg_.down8;
    int8_rows(all.expert(e, rows, cols), cols, r0, r1, xs, sx, m, out, stride);
}

void MoE::gate_up_int8(int e, int r0, int r1) {
    const int I = cfg_.intermediate, H = cfg_.hidden;
    const int p0 = expert_start_[e], count = expert_start_[e + 1] - p0;
    const uint8_t* xs[kMaxInt8Group];
    float sx[kMaxInt8Group];
    for (int g0 = 0; g0 < count; g0 += kMaxInt8Group) {
        const int m = std::min(kMaxInt8Group, count - g0);
        for (int i = 0; i < m; i++) {
            const int t = pair_token_[p0 + g0 + i];
            xs[i] = &s_.x_u8[(size_t)t * H];
            sx[i] = s_.x_s[t];
        }
        const size_t at = (size_t)(p0 + g0) * I;
        quant_rows(0, e, r0, r1, xs, sx, m, &s_.g[at], I);
        quant_rows(1, e, r0, r1, xs, sx, m, &s_.u[at], I);
    }
}

void MoE::activate() {
    rt_->pool().parallel_for(expert_start_[cfg_.experts], [&](int p, int) { activate_pair(p); });
}

void MoE::activate_pair(int p) {
    const int I = cfg_.intermediate;
    float* g = &s_.g[(size_t)p * I];
    float* u = &s_.u[(size_t)p * I];
    if (cfg_.gate_bias) {
        const size_t at = (size_t)pair_expert_[p] * I;
        add_row(g, cfg_.gate_bias + at, I);
        add_row(u, cfg_.up_bias + at, I);
    }
    if (keep_) {
        float* row = keep_ + (chunk_slot0_ + pair_slot_[p]) * 2 * I;
        std::copy(g, g + I, row);
        std::copy(u, u + I, row + I);
    }
    if (cfg_.swiglu_limit > 0.f) swiglu_clamped(g, u, I, cfg_.swiglu_limit, cfg_.swiglu_alpha);
    else silu_mul(g, u, I);
    if (use_int8(pair_expert_[p])) s_.h_s[p] = quantize_row_u8(g, &s_.h_u8[(size_t)p * I], I);
    else prepare_act(down_fmt_->act, g, &s_.h_act[p * down_act_], I);
}

void MoE::down() {
    for_expert_rows(cfg_.hidden, [&](int e, int r0, int r1) {
        if (use_int8(e)) down_int8(e, r0, r1);
        else down_rows(e, r0, r1);
    });
}

void MoE::down_rows(int e, int r0, int r1) {
    const int I = cfg_.intermediate, H = cfg_.hidden;
    const uint8_t* dw = (const uint8_t*)cfg_.down + ((size_t)e * H) * down_row_;
    const int p0 = expert_start_[e], count = expert_start_[e + 1] - p0;
    const void* hs[kMaxRowGroup];
    float out[kMaxGroup * kTileRows];
    const int ds = rows_step(down_fmt_);
    prefetch_prologue(dw + (size_t)r0 * down_row_, (size_t)(r1 - r0) * down_row_);
    const int group = ds == 1 ? kMaxRowGroup : kMaxGroup;
    for (int g0 = 0; g0 < count; g0 += group) {
        const int m = std::min(group, count - g0);
        for (int i = 0; i < m; i++) hs[i] = &s_.h_act[(p0 + g0 + i) * down_act_];
        rows_to(down_fmt_, I, dw, down_row_, r0, r1, hs, m, out, &s_.y_pairs[(size_t)(p0 + g0) * H], H);
    }
}

void MoE::gate_up_down() {
    const int I = cfg_.intermediate, H = cfg_.hidden, threads = rt_->pool().size();
    const int active = (int)active_.size();
    const int pairs = expert_start_[cfg_.experts];
    const int gu_chunk = chunk_rows(I, active, pairs, threads), gu_per = (I + gu_chunk - 1) / gu_chunk;
    const int d_chunk = chunk_rows(H, active, pairs, threads), d_per = (H + d_chunk - 1) / d_chunk;
    const int gu_tasks = active * gu_per;
    for (int a = 0; a < active; a++) chunks_left_[a].left.store(gu_per, std::memory_order_relaxed);
    rt_->pool().parallel_for(gu_tasks + active * d_per, [&](int task, int) {
        if (task < gu_tasks) {
            const int a = task / gu_per, r0 = (task % gu_per) * gu_chunk;
            const int e = active_[a];
            if (use_int8(e)) gate_up_int8(e, r0, std::min(I, r0 + gu_chunk));
            else gate_up_rows(e, r0, std::min(I, r0 + gu_chunk));
            if (chunks_left_[a].left.fetch_sub(1, std::memory_order_acq_rel) == 1) {  // the expert's last chunk
                for (int p = expert_start_[e]; p < expert_start_[e + 1]; p++) activate_pair(p);
                chunks_left_[a].left.store(-1, std::memory_order_release);  // its down rows may start
            }
            return;
        }
        // Tasks are handed out in order, so every gate/up chunk is already taken by a running
        // thread: this wait ends without this thread doing anything.
        const int d = task - gu_tasks, a = d / d_per, r0 = (d % d_per) * d_chunk;
        // (More threads than cores: the chunk's thread may share this core, so yield now and then.)
        for (int spins = 1; chunks_left_[a].left.load(std::memory_order_acquire) != -1; spins++) {
            KT_PAUSE();
            if (spins % 1024 == 0) std::this_thread::yield();
        }
        if (use_int8(active_[a])) down_int8(active_[a], r0, std::min(H, r0 + d_chunk));
        else down_rows(active_[a], r0, std::min(H, r0 + d_chunk));
    });
}

void MoE::down_int8(int e, int r0, int r1) {
    const int I = cfg_.intermediate, H = cfg_.hidden;
    const int p0 = expert_start_[e], count = expert_start_[e + 1] - p0;
    const uint8_t* hs[kMaxInt8Group];
    float sh[kMaxInt8Group];
    for (int g0 = 0; g0 < count; g0 += kMaxInt8Group) {
        const int m = std::min(kMaxInt8Group, count - g0);
        for (int i = 0; i < m; i++) {
            hs[i] = &s_.h_u8[(size_t)(p0 + g0 + i) * I];
            sh[i] = s_.h_s[p0 + g0 + i];
        }
        quant_rows(2, e, r0, r1, hs, sh, m, &s_.y_pairs[(size_t)(p0 + g0) * H], H);
    }
}

void MoE::combine(int tokens, const float* weights, void* y, Dtype dtype, const float* carry) {
    const int H = cfg_.hidden, K = cfg_.top_k;
    rt_->pool().parallel_for(tokens, [&](int t, int) {
        float* acc = &s_.x_f32[(size_t)t * H];  // the input row is no longer needed
        if (carry) std::copy(carry + (size_t)t * H, carry + (size_t)(t + 1) * H, acc);
        else std::fill(acc, acc + H, 0.f);
        for (int k = 0; k < K; k++) {
            const int p = slot_pair_[t * K + k];
            if (p < 0) continue;
            const float w = weights[t * K + k];
            const float* src = &s_.y_pairs[(size_t)p * H];
            if (cfg_.down_bias) {
                const float* b = cfg_.down_bias + (size_t)pair_expert_[p] * H;
                for (int i = 0; i < H; i++) acc[i] += w * (src[i] + b[i]);
            } else {
                for (int i = 0; i < H; i++) acc[i] += w * src[i];
            }
        }
        if (dtype == Dtype::F32) std::copy(acc, acc + H, (float*)y + (size_t)t * H);
        else for (int i = 0; i < H; i++) ((bf16_t*)y)[(size_t)t * H + i] = f32_to_bf16(acc[i]);
    });
}

void moe_host_submit(void* data) {
    auto* call = static_cast<MoEHostCall*>(data);
    try {
        call->moe->submit(call->tokens, call->ids, call->weights, call->x, call->y, call->dtype);
    } catch (const std::exception& e) {
        call->fail(e.what());
    }
}

void moe_host_wait(void* data) {
    auto* call = static_cast<MoEHostCall*>(data);
    try {
        call->runtime->sync();
    } catch (const std::exception& e) {
        call->fail(e.what());
    }
}

Doorbell::Doorbell(std::shared_ptr<Runtime> runtime, int spin_us) : rt_(std::move(runtime)), spin_us_(spin_us) {
    thread_ = std::thread(&Doorbell::loop, this);
}

Doorbell::~Doorbell() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

uint32_t Doorbell::add(std::shared_ptr<MoEHostCall> call) {
    if (!call) throw std::invalid_argument("Doorbell: no call");
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back(std::move(call));
    return (uint32_t)calls_.size();
}

void Doorbell::watch(uint32_t* ring, uint32_t* done) {
    if (!ring || !done || ring == done || ((uintptr_t)ring | (uintptr_t)done) % alignof(uint32_t))
        throw std::invalid_argument("Doorbell: ring and done must be distinct, 4-byte aligned words");
    std::lock_guard<std::mutex> lock(mu_);
    slots_.push_back({ring, done});
    version_.fetch_add(1, std::memory_order_release);
}

std::shared_ptr<MoEHostCall> Doorbell::call(uint32_t number) {
    std::lock_guard<std::mutex> lock(mu_);
    return number <= calls_.size() ? calls_[number - 1] : nullptr;
}

void Doorbell::wake() {  // (wake and rest come from one thread: the later of the two wins)
    resting_.store(false, std::memory_order_release);
    woken_.store(true, std::memory_order_release);
    cv_.notify_one();
}

void Doorbell::rest() {  // (the pool is told by this object's thread, in the order it sees wakes and rests)
    woken_.store(false, std::memory_order_release);
    resting_.store(true, std::memory_order_release);
}

void Doorbell::loop() {
    block_terminal_signals();
    rt_->pool().pin_caller();  // where the dispatcher runs: this thread is the pool's thread 0 when serving
    std::vector<Slot> slots;
    uint64_t seen = ~uint64_t(0);
    using clock = std::chrono::steady_clock;
    auto last = clock::now();
    bool after_call = false;  // `last` is the end of a call (not a wake)
    const auto spin = std::chrono::microseconds(spin_us_);
    while (!stop_.load(std::memory_order_acquire)) {
        if (version_.load(std::memory_order_acquire) != seen) {
            std::lock_guard<std::mutex> lock(mu_);
            slots = slots_;
            seen = version_.load(std::memory_order_relaxed);
        }
        bool served = false;
        for (const Slot& s : slots) {
            const uint32_t number = __atomic_load_n(s.ring, __ATOMIC_ACQUIRE);
            if (number == 0) continue;
            __atomic_store_n(s.ring, 0u, __ATOMIC_RELAXED);  // before `done`: the stream rings again only after it
            const auto start = clock::now();
            if (after_call && start - last < spin) {  // rung while spinning after a call: a step's next layer
                between_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(start - last).count(),
                                      std::memory_order_relaxed);
                betweens_.fetch_add(1, std::memory_order_relaxed);
            }
            const auto c = call(number);
            if (c) {
                try {
                    c->moe->forward(c->tokens, c->ids, c->weights, c->x, c->y, c->dtype, true);
                } catch (const std::exception& ex) {
                    c->fail(ex.what());
                }
                served_.fetch_add(1, std::memory_order_relaxed);
            } else {
                bad_.fetch_add(1, std::memory_order_relaxed);
            }
            __atomic_store_n(s.done, 1u, __ATOMIC_RELEASE);
            if (c) {  // deferred experts: while the GPU runs on (the next layer's call waits for this thread)
                try {
                    c->moe->run_deferred();
                } catch (const std::exception& ex) {
                    c->fail(ex.what());
                }
            }
            last = clock::now();
            after_call = true;
            busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(last - start).count(),
                               std::memory_order_relaxed);
            served = true;
        }
        const auto now = clock::now();
        if (!served && resting_.exchange(false, std::memory_order_acq_rel)) {
            rt_->pool().rest();
            last = now - spin;  // idle from now
            after_call = false;
        }
        if (!served && woken_.exchange(false, std::memory_order_acq_rel)) {
            rt_->pool().rouse();  // here, not in wake(): waking the workers costs the caller (Python) nothing
            last = now;
            after_call = false;  // a new step: its first ring follows Python, not a GPU layer
        }
        if (now - last < spin) {
            for (int i = 0; i < 8; i++) KT_PAUSE();
            continue;
        }
        // idle: look every 100 us, after a second every millisecond (an idle server costs ~nothing)
        const auto nap = std::chrono::microseconds(now - last < std::chrono::seconds(1) ? 100 : 1000);
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, nap, [&] { return stop_.load() || woken_.load(); });
    }
}

}  // namespace kt
