// The int4 GEMM of the experts' int4 copies (layout in int8.h): weights two to a byte in 16-row x
// 64-column VNNI blocks, one step per row and group of columns; activations int8 with one scale per
// row. Each group's products add up in int32, then one float multiply-add by the 16 rows' steps.
// AVX512-VNNI: 16 rows in a vector against up to 8 tokens, the stored nibbles (w + 8) as vpdpbusd's
// unsigned operand and each token's 4 signed bytes broadcast (the + 8 off per group by the group's
// activation sum). AMX, 4 tokens or more: the blocks unpacked to signed bytes in 1 KiB of L1 a
// step, then the int8 kernel's tdpbusd on u8 activations (x + 128, whose offset comes off once a
// row at the end: corr).
#include "amx.h"
#include "int8.h"
#include "quants.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace kt {

#if defined(KT_INT8_GEMM)
namespace {
constexpr int kInt4Block = 512;  // bytes of a 16-row x 64-column block

// Tile rows c and c + 8 of a block as the stored nibbles (w + 8, 0..15).
inline void nibbles(const uint8_t* block, int c, __m512i& lo, __m512i& hi) {
    const __m512i v = _mm512_loadu_si512((const void*)(block + 64 * c)), mask = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(v, mask);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
}

// Tile rows c and c + 8 of a block as signed bytes w (the AMX kernel's B operand).
inline void unpack_pair(const uint8_t* block, int c, __m512i& lo, __m512i& hi) {
    nibbles(block, c, lo, hi);
    const __m512i eight = _mm512_set1_epi8(8);
    lo = _mm512_sub_epi8(lo, eight);
    hi = _mm512_sub_epi8(hi, eight);
}

// The VNNI path takes the weights as vpdpbusd's unsigned operand (the stored w + 8) and the
// activations as its signed one (the u8 rows less 128, in a thread's buffer that grows once), each
// token's 4 bytes broadcast: per 64 weight bytes a load, three logic ops, and two broadcasts and two
// vpdpbusd a token.
// The + 8 comes off per group: sum (w + 8) x = sum w x + 8 sum x, with sum x the group's.
struct SignedRows {
    std::vector<int8_t> x;     // [count, k]
    std::vector<int32_t> sum;  // [count, k / group]
};

void to_signed(const uint8_t* const* xs, int count, int k, int group, SignedRows& out) {
    out.x.resize((size_t)count * k);
    out.sum.resize((size_t)count * (k / group));
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    for (int t = 0; t < count; t++)
        for (int g = 0; g < k / group; g++) {
            __m512i sum = _mm512_setzero_si512();
            for (int i = g * group; i < (g + 1) * group; i += 64) {
                const __m512i v = _mm512_xor_si512(_mm512_loadu_si512((const void*)(xs[t] + i)), flip);
                _mm512_storeu_si512((void*)&out.x[(size_t)t * k + i], v);
                sum = _mm512_dpbusd_epi32(sum, ones, v);
            }
            out.sum[(size_t)t * (k / group) + g] = _mm512_reduce_add_epi32(sum);
        }
}

// Block b (rows 16b..16b+15) against T tokens: lane n of f[t] = sum_g scale[16b+n, g] * (the
// group's int32 dot of w's row with x[t]). Few tokens keep A accumulators a token (summed at the
// group's end) so that A chains of vpdpbusd are in flight, not one (8 tokens give 8 chains).
template <int T>
void vnni_block(const Int4Weights& w, int k, int b, const SignedRows& xs, int t0, __m512 f[T]) {
    constexpr int A = T >= 4 ? 1 : 4 / T;
    const int chunks = k / 64, per_group = w.group / 64, groups = k / w.group;
    const uint8_t* q = w.q + (size_t)b * chunks * kInt4Block;
    const float* scale = w.scale + (size_t)b * groups * 16;
    const int8_t* x[T];
    for (int t = 0; t < T; t++) x[t] = &xs.x[(size_t)(t0 + t) * k], f[t] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i acc[A][T];
        for (int a = 0; a < A; a++)
            for (int t = 0; t < T; t++) acc[a][t] = _mm512_setzero_si512();
        for (int ch = g * per_group; ch < (g + 1) * per_group; ch++) {
            const uint8_t* block = q + (size_t)ch * kInt4Block;
            for (int c = 0; c < 8; c++) {
                __m512i lo, hi;
                nibbles(block, c, lo, hi);
                const int a_lo = (2 * c) % A, a_hi = (2 * c + 1) % A;
                for (int t = 0; t < T; t++) {  // tile row c: columns 4c..4c+3 of the chunk; row c + 8: 4c+32..
                    const int8_t* xc = x[t] + ch * 64 + 4 * c;
                    int32_t x_lo, x_hi;
                    std::memcpy(&x_lo, xc, 4);
                    std::memcpy(&x_hi, xc + 32, 4);
                    acc[a_lo][t] = _mm512_dpbusd_epi32(acc[a_lo][t], lo, _mm512_set1_epi32(x_lo));
                    acc[a_hi][t] = _mm512_dpbusd_epi32(acc[a_hi][t], hi, _mm512_set1_epi32(x_hi));
                }
            }
        }
        const __m512 s = _mm512_loadu_ps(scale + g * 16);
        for (int t = 0; t < T; t++) {
            __m512i sum = _mm512_set1_epi32(-8 * xs.sum[(size_t)(t0 + t) * groups + g]);
            for (int a = 0; a < A; a++) sum = _mm512_add_epi32(sum, acc[a][t]);
            f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, f[t]);
        }
    }
}

// out[t][r] = (f[t] lane r - 16b - corr[r]) * sx[t] for the rows of block b inside [r0, r1); corr
// null: none (the VNNI path's activations carry no offset).
inline void store_block(const float* corr, int b, int r0, int r1, const float* f, int count, const float* sx,
                        float* out, size_t stride) {
    const int lo = std::max(r0 - 16 * b, 0), hi = std::min(r1 - 16 * b, 16);
    const __mmask16 rows = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
    const __m512 c = corr ? _mm512_loadu_ps(corr + 16 * b) : _mm512_setzero_ps();
    for (int t = 0; t < count; t++)
        _mm512_mask_storeu_ps(out + (size_t)t * stride + 16 * b, rows,
                              _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(f + 16 * t), c), _mm512_set1_ps(sx[t])));
}

template <int T>
void vnni_step(const Int4Weights& w, int k, int b, int r0, int r1, const SignedRows& xs, int t0, const float* sx,
               float* out, size_t stride) {
    __m512 f[T];
    vnni_block<T>(w, k, b, xs, t0, f);
    alignas(64) float lanes[T * 16];
    for (int t = 0; t < T; t++) _mm512_store_ps(lanes + 16 * t, f[t]);
    store_block(nullptr, b, r0, r1, lanes, T, sx + t0, out + (size_t)t0 * stride, stride);
}

void vnni_rows(const Int4Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t stride) {
    thread_local SignedRows x;
    to_signed(xs, count, k, w.group, x);
    for (int b = r0 / 16; b < (r1 + 15) / 16; b++) {
        int t = 0;
        for (; t + 8 <= count; t += 8) vnni_step<8>(w, k, b, r0, r1, x, t, sx, out, stride);
        for (; t + 4 <= count; t += 4) vnni_step<4>(w, k, b, r0, r1, x, t, sx, out, stride);
        for (; t + 2 <= count; t += 2) vnni_step<2>(w, k, b, r0, r1, x, t, sx, out, stride);
        for (; t < count; t++) vnni_step<1>(w, k, b, r0, r1, x, t, sx, out, stride);
    }
}
}  // namespace
#endif

#if defined(KT_AMX)
namespace {
inline void unpack_tile(const uint8_t* block, uint8_t* tile) {  // 512 bytes -> the 1 KiB int8 tile
    for (int c = 0; c < 8; c++) {
        __m512i lo, hi;
        unpack_pair(block, c, lo, hi);
        _mm512_store_si512((void*)(tile + 64 * c), lo);
        _mm512_store_si512((void*)(tile + 64 * (c + 8)), hi);
    }
}

// RB (1 or 2) blocks from b against TT (1 or 2) groups of 16 activation rows in `a` (row stride k):
// each group of columns accumulates in tiles C (as the int8 kernel's), which are then scaled into
// f[rb][i] (16 rows' floats for token i < m) and zeroed for the next group.
template <int RB, int TT>
void amx_block(const Int4Weights& w, int k, int b, const uint8_t* a, int m, int ahead, float f[2][32][16]) {
    const int chunks = k / 64, per_group = w.group / 64, groups = k / w.group;
    const size_t bytes = (size_t)chunks * kInt4Block;
    const uint8_t* q = w.q + (size_t)b * bytes;
    alignas(64) uint8_t tile[2][1024];
    alignas(64) int32_t c[2][2][16][16];
    for (int rb = 0; rb < RB; rb++) std::memset(f[rb], 0, sizeof(float) * 16 * m);
    for (int g = 0; g < groups; g++) {
        zero_accumulators<RB, TT>();
        for (int ch = g * per_group; ch < (g + 1) * per_group; ch++) {
            for (int rb = 0; rb < RB; rb++) {
                const uint8_t* src = q + rb * bytes + (size_t)ch * kInt4Block;
                if (ahead)
                    for (int l = 0; l < kInt4Block; l += 64) _mm_prefetch((const char*)src + ahead + l, _MM_HINT_T0);
                unpack_tile(src, tile[rb]);
            }
            _tile_loadd(6, tile[0], 64);
            if (RB > 1) _tile_loadd(7, tile[1], 64);
            _tile_loadd(4, a + ch * 64, k);
            if (TT > 1) _tile_loadd(5, a + (size_t)16 * k + ch * 64, k);
            _tile_dpbusd(0, 4, 6);
            if (TT > 1) _tile_dpbusd(1, 5, 6);
            if (RB > 1) _tile_dpbusd(2, 4, 7);
            if (RB > 1 && TT > 1) _tile_dpbusd(3, 5, 7);
        }
        store_accumulators<RB, TT>(c);
        for (int rb = 0; rb < RB; rb++) {
            const __m512 s = _mm512_loadu_ps(w.scale + ((size_t)(b + rb) * groups + g) * 16);
            for (int i = 0; i < m; i++) {
                const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)c[rb][i / 16][i % 16]));
                _mm512_store_ps(f[rb][i], _mm512_fmadd_ps(v, s, _mm512_load_ps(f[rb][i])));
            }
        }
    }
}

void amx_rows(const Int4Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
              float* out, size_t stride) {
    configure_tiles();
    const int ahead = kPrefetchAhead;
    thread_local std::vector<uint8_t> a;  // the activation rows, 32 at a time, padded with zero rows (128)
    if (a.size() < (size_t)32 * k) a.resize((size_t)32 * k);
    alignas(64) float f[2][32][16];
    const int b1 = (r1 + 15) / 16;
    for (int t0 = 0; t0 < count; t0 += 32) {
        const int m = std::min(32, count - t0);
        for (int i = 0; i < 32; i++)
            if (i < m) std::memcpy(&a[(size_t)i * k], xs[t0 + i], k);
            else std::memset(&a[(size_t)i * k], 128, k);
        for (int b = r0 / 16; b < b1;) {
            const int blocks = b + 2 <= b1 ? 2 : 1;
            if (blocks == 2) {
                if (m > 16) amx_block<2, 2>(w, k, b, a.data(), m, ahead, f);
                else amx_block<2, 1>(w, k, b, a.data(), m, ahead, f);
            } else {
                if (m > 16) amx_block<1, 2>(w, k, b, a.data(), m, ahead, f);
                else amx_block<1, 1>(w, k, b, a.data(), m, ahead, f);
            }
            for (int rb = 0; rb < blocks; rb++, b++)
                store_block(w.corr, b, r0, r1, &f[rb][0][0], m, sx + t0, out + (size_t)t0 * stride, stride);
        }
    }
}
}  // namespace
#endif

void int4_rows(const Int4Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t out_stride) {
    if (r0 >= r1 || count <= 0) return;
#if defined(KT_AMX)
    // (a tile step on 1-3 tokens would do 16 tokens' work on padding; VNNI keeps up with memory there)
    if (count >= 4 && amx_available()) return amx_rows(w, k, r0, r1, xs, sx, count, out, out_stride);
#endif
#if defined(KT_INT8_GEMM)
    vnni_rows(w, k, r0, r1, xs, sx, count, out, out_stride);
#else
    (void)w, (void)k, (void)xs, (void)sx, (void)out, (void)out_stride;
    throw std::logic_error("int4_rows: this build has no int8 GEMM (MoE refuses int4 copies without one)");
#endif
}

}  // namespace kt
