// GGML block decoders (the layouts of blocks.h), scalar: the compiler vectorizes the inner loops
// at each ISA level, and the backward that uses them spends its time on the FMAs after them.
#include "dequant.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "blocks.h"
#include "checked.h"
#include "pool.h"
#include "quants.h"

namespace kt {
namespace {

constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes
inline void k4_scale_min(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

void q4_0(const block_q4_0& b, float* y) {
    const float d = fp16_to_f32(b.d);
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * ((b.qs[j] & 0xF) - 8);
        y[j + QK / 2] = d * ((b.qs[j] >> 4) - 8);
    }
}

void q8_0(const block_q8_0& b, float* y) {
    const float d = fp16_to_f32(b.d);
    for (int j = 0; j < QK; j++) y[j] = d * b.qs[j];
}

void mxfp4(const block_mxfp4& b, float* y) {
    const float d = e8m0_half(b.e);  // (the code book is doubled)
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * kMxfp4Values[b.qs[j] & 0xF];
        y[j + QK / 2] = d * kMxfp4Values[b.qs[j] >> 4];
    }
}

void q2_k(const block_q2_k& b, float* y) {
    const float d = fp16_to_f32(b.d), dmin = fp16_to_f32(b.dmin);
    const uint8_t* q = b.qs;
    int s = 0;
    for (int n = 0; n < QK_K; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2)
            for (int half = 0; half < 2; half++, s++) {
                const float dl = d * (b.scales[s] & 0xF), ml = dmin * (b.scales[s] >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * ((q[l + 16 * half] >> shift) & 3) - ml;
            }
}

void q3_k(const block_q3_k& b, float* y) {
    // 16 6-bit scales: low 4 bits in bytes 0..7 (two each), high 2 bits in bytes 8..11
    int8_t sc[16];
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? b.scales[j] & 0xF : b.scales[j - 8] >> 4;
        const int high = (b.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (int8_t)((low | (high << 4)) - 32);
    }
    const float d = fp16_to_f32(b.d);
    const uint8_t* q = b.qs;
    int s = 0;
    uint8_t m = 1;
    for (int n = 0; n < QK_K; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2, m <<= 1)
            for (int half = 0; half < 2; half++, s++) {
                const float dl = d * sc[s];
                for (int l = 16 * half; l < 16 * half + 16; l++)
                    *y++ = dl * (((q[l] >> shift) & 3) - ((b.hmask[l] & m) ? 0 : 4));
            }
}

template <typename Block, bool five>
void k4(const Block& b, float* y) {
    const float d = fp16_to_f32(b.d), dmin = fp16_to_f32(b.dmin);
    const uint8_t* q = b.qs;
    for (int j = 0; j < QK_K / 64; j++, q += 32) {
        int sc1, m1, sc2, m2;
        k4_scale_min(2 * j, b.scales, sc1, m1);
        k4_scale_min(2 * j + 1, b.scales, sc2, m2);
        const float d1 = d * sc1, n1 = dmin * m1, d2 = d * sc2, n2 = dmin * m2;
        for (int l = 0; l < 32; l++) {
            int lo = q[l] & 0xF, hi = q[l] >> 4;
            if constexpr (five) {
                const uint8_t* qh = reinterpret_cast<const uint8_t*>(&b) + offsetof(block_q5_k, qh);
                lo += (qh[l] >> (2 * j)) & 1 ? 16 : 0;
                hi += (qh[l] >> (2 * j + 1)) & 1 ? 16 : 0;
            }
            y[64 * j + l] = d1 * lo - n1;
            y[64 * j + 32 + l] = d2 * hi - n2;
        }
    }
}

void q6_k(const block_q6_k& b, float* y) {
    const float d = fp16_to_f32(b.d);
    const uint8_t *ql = b.ql, *qh = b.qh;
    const int8_t* sc = b.scales;
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8)
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            y[l] = d * sc[is] * ((int)((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
            y[l + 32] = d * sc[is + 2] * ((int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = d * sc[is + 4] * ((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = d * sc[is + 6] * ((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
}

void iq4_xs(const block_iq4_xs& b, float* y) {
    const float d = fp16_to_f32(b.d);
    for (int ib = 0; ib < QK_K / 32; ib++, y += 32) {
        const int ls = ((b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((b.scales_h >> (2 * ib)) & 3) << 4);
        const float dl = d * (ls - 32);
        const uint8_t* qs = b.qs + 16 * ib;
        for (int j = 0; j < 16; j++) {
            y[j] = dl * kIq4nlValues[qs[j] & 0xF];
            y[j + 16] = dl * kIq4nlValues[qs[j] >> 4];
        }
    }
}

template <typename Block, typename Fn>
void each_block(const void* src, int blocks, float* out, int elems, Fn fn) {
    const Block* b = static_cast<const Block*>(src);
    for (int i = 0; i < blocks; i++) fn(b[i], out + (size_t)i * elems);
}

}  // namespace

int dequant_block_elems(int type) {
    switch (type) {
        case F32: case F16: case BF16: return 1;
        case Q4_0: case Q8_0: case MXFP4: return QK;
        case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: return QK_K;
        default: return 0;
    }
}

int dequant_block_bytes(int type) {
    switch (type) {
        case F32: return 4;
        case F16: case BF16: return 2;
        case Q4_0: return sizeof(block_q4_0);
        case Q8_0: return sizeof(block_q8_0);
        case MXFP4: return sizeof(block_mxfp4);
        case Q2_K: return sizeof(block_q2_k);
        case Q3_K: return sizeof(block_q3_k);
        case Q4_K: return sizeof(block_q4_k);
        case Q5_K: return sizeof(block_q5_k);
        case Q6_K: return sizeof(block_q6_k);
        case IQ4_XS: return sizeof(block_iq4_xs);
        default: return 0;
    }
}

void dequant_blocks(int type, const void* src, int blocks, float* out) {
    switch (type) {
        case F32: std::memcpy(out, src, (size_t)blocks * sizeof(float)); return;
        case F16: {
            const fp16_t* h = static_cast<const fp16_t*>(src);
            for (int i = 0; i < blocks; i++) out[i] = fp16_to_f32(h[i]);
            return;
        }
        case BF16: {
            const bf16_t* h = static_cast<const bf16_t*>(src);
            for (int i = 0; i < blocks; i++) out[i] = bf16_to_f32(h[i]);
            return;
        }
        case Q4_0: return each_block<block_q4_0>(src, blocks, out, QK, q4_0);
        case Q8_0: return each_block<block_q8_0>(src, blocks, out, QK, q8_0);
        case MXFP4: return each_block<block_mxfp4>(src, blocks, out, QK, mxfp4);
        case Q2_K: return each_block<block_q2_k>(src, blocks, out, QK_K, q2_k);
        case Q3_K: return each_block<block_q3_k>(src, blocks, out, QK_K, q3_k);
        case Q4_K: return each_block<block_q4_k>(src, blocks, out, QK_K, k4<block_q4_k, false>);
        case Q5_K: return each_block<block_q5_k>(src, blocks, out, QK_K, k4<block_q5_k, true>);
        case Q6_K: return each_block<block_q6_k>(src, blocks, out, QK_K, q6_k);
        case IQ4_XS: return each_block<block_iq4_xs>(src, blocks, out, QK_K, iq4_xs);
        default: return;  // (callers check dequant_block_elems first)
    }
}

void int8_copies(ThreadPool& pool, int type, const void* src, size_t src_bytes, int E, int rows, int cols,
                 bool transpose, int8_t* w, float* scale, int32_t* row_sum) {
    const int elems = dequant_block_elems(type), block = dequant_block_bytes(type);
    if (elems == 0) throw std::invalid_argument("int8_copies: no decoder for ggml type " + std::to_string(type));
    if (E <= 0 || rows <= 0 || cols <= 0 || cols % elems)
        throw std::invalid_argument("int8_copies: E, rows and cols must be positive, cols whole blocks of " +
                                    std::to_string(elems));
    const int out_rows = transpose ? cols : rows, out_cols = transpose ? rows : cols;
    if (out_cols % 8) throw std::invalid_argument("int8_copies: output rows of " + std::to_string(out_cols) +
                                                  " values, not a multiple of 8");
    const size_t per_expert = checked_product("int8_copies: bytes", {(size_t)rows, (size_t)(cols / elems), (size_t)block});
    if (src_bytes < checked_product("int8_copies: bytes", {per_expert, (size_t)E}))
        throw std::invalid_argument("int8_copies: " + std::to_string(src_bytes) + " bytes hold fewer than " +
                                    std::to_string(E) + " experts of " + std::to_string(per_expert));
    const size_t values = checked_product("int8_copies: values", {(size_t)rows, (size_t)cols});
    pool.parallel_for(E, [&](int e, int) {
        std::vector<float> m(values), line(out_cols);
        dequant_blocks(type, static_cast<const uint8_t*>(src) + (size_t)e * per_expert, (int)(values / elems), m.data());
        for (int r = 0; r < out_rows; r++) {
            for (int c = 0; c < out_cols; c++) line[c] = transpose ? m[(size_t)c * cols + r] : m[(size_t)r * cols + c];
            const float d = row_absmax(line.data(), out_cols) / 127.f, inv = d ? 1.f / d : 0.f;
            const size_t at = (size_t)e * out_rows + r;
            int8_t* q = w + at * out_cols;
            row_round_i8(line.data(), inv, q, out_cols);
            int32_t sum = 0;
            for (int c = 0; c < out_cols; c++) sum += q[c];
            scale[at] = d, row_sum[at] = sum;
        }
    });
}

}  // namespace kt
