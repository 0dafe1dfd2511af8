// The CPU linear op: activations prepared once per call, then rows of W split across threads.
#include "linear.h"

#include "checked.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace kt {

namespace {
constexpr int kGroup = 16;  // tokens per pass over a chunk of weight rows
// Formats whose kernel blocks rows and tokens itself (the 16-bit floats): tokens per call of it
// over a whole chunk, and the rows a chunk has at least when a call has that many tokens (the
// AMX-BF16 tiles take blocks of 32 rows or more).
constexpr int kRowsGroup = 64, kRowsChunk = 64;
}

Linear::Linear(std::shared_ptr<Runtime> runtime, int in_features, int out_features, int type, const void* weight,
               size_t weight_bytes, int max_tokens, Bf16Kernel bf16)
    : rt_(std::move(runtime)), in_(in_features), out_(out_features), max_tokens_(max_tokens), fmt_(find_format(type, bf16)),
      w_((const uint8_t*)weight) {
    if (!fmt_) throw std::invalid_argument("Linear: ggml type " + std::to_string(type) + " is not computed on here; supported: " + supported_formats());
    if (in_ <= 0 || out_ <= 0 || max_tokens_ <= 0 || !w_) throw std::invalid_argument("Linear: sizes must be positive and weight non-null");
    if (in_ % fmt_->block_elems)
        throw std::invalid_argument("Linear: " + std::to_string(in_) + " inputs are not a whole number of " + fmt_->name + " blocks");
    if (rows_step(fmt_) > 1 && out_ % kTileRows)
        throw std::invalid_argument("Linear: tiled weights need out_features % 16 == 0, got " + std::to_string(out_));
    row_ = (size_t)(in_ / fmt_->block_elems) * fmt_->block_bytes;
    const size_t want = checked_product("Linear: weight", {row_, (size_t)out_});
    if (weight_bytes != want)
        throw std::invalid_argument("Linear: weight holds " + std::to_string(weight_bytes) + " bytes, expected " + std::to_string(want));
    act_ = act_row_bytes(fmt_->act, in_);
    const size_t x_bytes = checked_product("Linear: scratch", {(size_t)max_tokens_, (size_t)in_, sizeof(float)});
    off_act_ = checked_sum("Linear: scratch", {x_bytes, 63}) / 64 * 64;
    rt_->reserve_scratch(checked_sum("Linear: scratch", {off_act_, checked_product("Linear: scratch", {(size_t)max_tokens_, act_})}));
}

void Linear::forward(int tokens, const void* x, void* y, Dtype dtype) {
    if (tokens < 0) throw std::invalid_argument("Linear: negative token count");
    rt_->run_inline([&] { run(tokens, x, y, dtype); });
}

void Linear::submit(int tokens, const void* x, void* y, Dtype dtype) {
    if (tokens < 0) throw std::invalid_argument("Linear: negative token count");
    rt_->submit([=] { run(tokens, x, y, dtype); });
}

void Linear::run(int tokens, const void* x, void* y, Dtype dtype) {
    float* x_f32 = (float*)rt_->scratch();
    uint8_t* x_act = rt_->scratch() + off_act_;
    const size_t elem = dtype == Dtype::F32 ? 4 : 2;
    for (int start = 0; start < tokens; start += max_tokens_) {
        const int n = std::min(max_tokens_, tokens - start);
        const uint8_t* xs = (const uint8_t*)x + (size_t)start * in_ * elem;
        uint8_t* ys = (uint8_t*)y + (size_t)start * out_ * elem;
        rt_->pool().parallel_for(n, [&](int t, int) {
            float* row = &x_f32[(size_t)t * in_];
            if (dtype == Dtype::F32) std::copy((const float*)xs + (size_t)t * in_, (const float*)xs + (size_t)(t + 1) * in_, row);
            else for (int i = 0; i < in_; i++) row[i] = bf16_to_f32(((const bf16_t*)xs)[(size_t)t * in_ + i]);
            prepare_act(fmt_->act, row, &x_act[t * act_], in_);
        });
        const int step = rows_step(fmt_);
        const int least = fmt_->rows && n >= kAmxBf16MinTokens ? kRowsChunk : 16;
        const int chunk = (std::max(least, out_ / (8 * rt_->pool().size())) + 15) / 16 * 16;  // whole tile groups
        rt_->pool().parallel_for((out_ + chunk - 1) / chunk, [&](int task, int) {
            const int r0 = task * chunk, r1 = std::min(out_, (task + 1) * chunk);
            // tokens a group at a time against each row: several tokens share each weight load
            // (dot_rows_block's blocks of rows, the tiles' four-token kernels) while the chunk's
            // rows stay in cache across groups
            const void* xg[kGroup];
            float v[kGroup * kTileRows];
            auto put = [&](int i, int r, float value) {  // token i's output r
                const size_t at = (size_t)i * out_ + r;
                if (dtype == Dtype::F32) ((float*)ys)[at] = value;
                else ((bf16_t*)ys)[at] = f32_to_bf16(value);
            };
            if (fmt_->rows) {  // the chunk against up to kRowsGroup tokens a call, through a float buffer
                thread_local std::vector<float> buf;
                const int nb = r1 - r0;
                if (buf.size() < (size_t)kRowsGroup * nb) buf.resize((size_t)kRowsGroup * nb);
                const void* xr[kRowsGroup];
                for (int g0 = 0; g0 < n; g0 += kRowsGroup) {
                    const int m = std::min(kRowsGroup, n - g0);
                    for (int i = 0; i < m; i++) xr[i] = &x_act[(size_t)(g0 + i) * act_];
                    fmt_->rows(in_, w_ + (size_t)r0 * row_, row_, 0, nb, xr, m, buf.data(), nb);
                    for (int i = 0; i < m; i++)
                        for (int k = 0; k < nb; k++) put(g0 + i, r0 + k, buf[(size_t)i * nb + k]);
                }
                return;
            }
            for (int g0 = 0; g0 < n; g0 += kGroup) {
                const int m = std::min(kGroup, n - g0);
                for (int i = 0; i < m; i++) xg[i] = &x_act[(size_t)(g0 + i) * act_];
                if (step == 1) {  // rows as stored: blocks of rows against the tokens (dot_rows_block)
                    for (int rb = r0; rb < r1; rb += kTileRows) {
                        const int nb = std::min(kTileRows, r1 - rb);
                        dot_rows_block(fmt_, in_, w_ + (size_t)rb * row_, row_, 0, nb, xg, m, v, kTileRows);
                        for (int i = 0; i < m; i++)
                            for (int k = 0; k < nb; k++) put(g0 + i, rb + k, v[i * kTileRows + k]);
                    }
                    continue;
                }
                for (int r = r0; r < r1; r += step) {
                    dot_step(fmt_, in_, w_, row_, r, xg, m, v);
                    for (int i = 0; i < m; i++)
                        for (int k = 0; k < step; k++) put(g0 + i, r + k, v[i * step + k]);
                }
            }
        });
    }
}

}  // namespace kt
