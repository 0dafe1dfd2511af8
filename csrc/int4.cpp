// The int4 prefill GEMM (layout in int8.h): weights two to a byte in 16-row x 64-column VNNI
// blocks, one step per row and group of columns; activations u8 (q + 128) with one scale per row.
// Each group's products add up in int32 (|sum| <= group * 8 * 255), then one float multiply-add by
// the 16 rows' steps; the activation offset comes off once at the end (corr). AVX512-VNNI: 16 rows
// in a vector against up to 8 tokens, each token's 4 bytes broadcast; AMX: the block's tiles
// unpacked into 1 KiB of L1 a step, then the int8 kernel's tdpbusd.
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

inline int32_t load4(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Tile rows c and c + 8 of a block as signed bytes (the stored w + 8, less 8).
inline void unpack_pair(const uint8_t* block, int c, __m512i& lo, __m512i& hi) {
    const __m512i v = _mm512_loadu_si512((const void*)(block + 64 * c));
    const __m512i mask = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    lo = _mm512_sub_epi8(_mm512_and_si512(v, mask), eight);
    hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), eight);
}

// Block b (rows 16b..16b+15) against T tokens: lane n of f[t] = sum_g scale[16b+n, g] * (the
// group's int32 dot of w's row with x[t]).
template <int T>
void vnni_block(const Int4Weights& w, int k, int b, const uint8_t* const* x, __m512 f[T]) {
    const int chunks = k / 64, per_group = w.group / 64, groups = k / w.group;
    const uint8_t* q = w.q + (size_t)b * chunks * kInt4Block;
    const float* scale = w.scale + (size_t)b * groups * 16;
    for (int t = 0; t < T; t++) f[t] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i acc[T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_si512();
        for (int ch = g * per_group; ch < (g + 1) * per_group; ch++) {
            const uint8_t* block = q + (size_t)ch * kInt4Block;
            for (int c = 0; c < 8; c++) {
                __m512i lo, hi;
                unpack_pair(block, c, lo, hi);
                for (int t = 0; t < T; t++) {  // tile row c: columns 4c..4c+3 of the chunk; row c + 8: 4c+32..
                    const uint8_t* xc = x[t] + ch * 64 + 4 * c;
                    acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_set1_epi32(load4(xc)), lo);
                    acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_set1_epi32(load4(xc + 32)), hi);
                }
            }
        }
        const __m512 s = _mm512_loadu_ps(scale + g * 16);
        for (int t = 0; t < T; t++) f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), s, f[t]);
    }
}

// out[t][r] = (f[t] lane r - 16b - corr[r]) * sx[t] for the rows of block b inside [r0, r1).
inline void store_block(const Int4Weights& w, int b, int r0, int r1, const float* f, int count, const float* sx,
                        float* out, size_t stride) {
    const int lo = std::max(r0 - 16 * b, 0), hi = std::min(r1 - 16 * b, 16);
    const __mmask16 rows = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
    const __m512 corr = _mm512_loadu_ps(w.corr + 16 * b);
    for (int t = 0; t < count; t++)
        _mm512_mask_storeu_ps(out + (size_t)t * stride + 16 * b, rows,
                              _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(f + 16 * t), corr), _mm512_set1_ps(sx[t])));
}

template <int T>
void vnni_step(const Int4Weights& w, int k, int b, int r0, int r1, const uint8_t* const* xs, const float* sx,
               float* out, size_t stride) {
    __m512 f[T];
    vnni_block<T>(w, k, b, xs, f);
    alignas(64) float lanes[T * 16];
    for (int t = 0; t < T; t++) _mm512_store_ps(lanes + 16 * t, f[t]);
    store_block(w, b, r0, r1, lanes, T, sx, out, stride);
}

void vnni_rows(const Int4Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t stride) {
    for (int b = r0 / 16; b < (r1 + 15) / 16; b++) {
        int t = 0;
        for (; t + 8 <= count; t += 8) vnni_step<8>(w, k, b, r0, r1, xs + t, sx + t, out + (size_t)t * stride, stride);
        for (; t + 4 <= count; t += 4) vnni_step<4>(w, k, b, r0, r1, xs + t, sx + t, out + (size_t)t * stride, stride);
        for (; t + 2 <= count; t += 2) vnni_step<2>(w, k, b, r0, r1, xs + t, sx + t, out + (size_t)t * stride, stride);
        for (; t < count; t++) vnni_step<1>(w, k, b, r0, r1, xs + t, sx + t, out + (size_t)t * stride, stride);
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
        _tile_zero(0);
        if (TT > 1) _tile_zero(1);
        if (RB > 1) _tile_zero(2);
        if (RB > 1 && TT > 1) _tile_zero(3);
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
        _tile_stored(0, c[0][0], 64);
        if (TT > 1) _tile_stored(1, c[0][1], 64);
        if (RB > 1) _tile_stored(2, c[1][0], 64);
        if (RB > 1 && TT > 1) _tile_stored(3, c[1][1], 64);
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
    const int ahead = tile_prefetch().first;
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
                store_block(w, b, r0, r1, &f[rb][0][0], m, sx + t0, out + (size_t)t0 * stride, stride);
        }
    }
}
}  // namespace
#endif

void int4_rows(const Int4Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t out_stride) {
    if (r0 >= r1 || count <= 0) return;
#if defined(KT_AMX)
    if (amx_available()) return amx_rows(w, k, r0, r1, xs, sx, count, out, out_stride);
#endif
#if defined(KT_INT8_GEMM)
    vnni_rows(w, k, r0, r1, xs, sx, count, out, out_stride);
#else
    (void)w, (void)k, (void)xs, (void)sx, (void)out, (void)out_stride;
    throw std::logic_error("int4_rows: this build has no int8 GEMM (MoE refuses int4 copies without one)");
#endif
}

}  // namespace kt
