// The int8 prefill GEMM: 4 weight rows x 4 token rows per step (16 accumulators), int32 accumulators over the
// whole row (|sum| <= k * 127 * 255 fits in int32 for k < 66,000), scales applied once at the end.
#include "int8.h"

#include "amx.h"
#include "quants.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#if defined(KT_AMX)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>
#define KT_AMX 1
#endif

namespace kt {

bool amx_available() {
#if defined(KT_AMX)
    // Linux hands out the 8 KiB tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA = 18).
    static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
#else
    return false;
#endif
}

bool int8_gemm_available() {
#if defined(KT_INT8_GEMM) || defined(KT_INT8_GEMM_256)
    return true;
#else
    return false;
#endif
}

bool int8_gemm_vnni() {
#if (defined(KT_INT8_GEMM) || defined(KT_INT8_GEMM_256)) && !defined(KT_INT8_GEMM_MADDUBS)
    return true;
#else
    return false;
#endif
}

bool int4_gemm_available() {
#if defined(KT_INT8_GEMM)
    return true;
#else
    return false;
#endif
}

float quantize_row_u8(const float* x, uint8_t* out, int n) {  // n % 64 == 0 (checked by MoE)
    const float s = row_absmax(x, n) / 127.f, inv = s ? 1.f / s : 0.f;
    row_round_i8(x, inv, (int8_t*)out, n);
    for (int i = 0; i < n; i++) out[i] ^= 0x80;  // int8 q -> uint8 q + 128
    return s;
}

#if defined(KT_INT8_GEMM_256)
namespace {
#if defined(KT_INT8_GEMM_MADDUBS)
// AVX2 has no vpdpbusd, and vpmaddubsw's pairs of (q + 128) * w would saturate 16 bits
// (2 * 255 * 127). So the block takes q = x - 128 itself (|q| <= 127, as quantize_row_u8 makes
// it): |q| * (w with q's sign) pairs stay within 2 * 127 * 127, vpmaddwd widens them to 32 bits.
// Its sums are of q * w, without the + 128 * w that the VNNI blocks' carry (kOffsetSums).
constexpr bool kOffsetSums = false;
inline __m256i dot32(__m256i acc, __m256i q_abs, __m256i q, __m256i w) {
    const __m256i pairs = _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(w, q));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#else
constexpr bool kOffsetSums = true;
#endif
// The 256-bit block: 32 bytes a step, AVX-VNNI's vpdpbusd (VEX-encoded) or AVX2's dot32, one
// horizontal sum a row and token at the end; the same integer sums as the 512-bit block's.
template <int R, int T>
inline void block(const int8_t* const* w, const uint8_t* const* x, int k, int32_t out[R][T]) {
    __m256i acc[R][T];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_si256();
    for (int i = 0; i < k; i += 32) {
        __m256i wv[R];
        for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_si256((const __m256i*)(w[r] + i));
        for (int t = 0; t < T; t++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(x[t] + i));
#if defined(KT_INT8_GEMM_MADDUBS)
            const __m256i q = _mm256_xor_si256(xv, _mm256_set1_epi8((char)0x80)), q_abs = _mm256_abs_epi8(q);
            for (int r = 0; r < R; r++) acc[r][t] = dot32(acc[r][t], q_abs, q, wv[r]);
#else
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_dpbusd_avx_epi32(acc[r][t], xv, wv[r]);
#endif
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[r][t]), _mm256_extracti128_si256(acc[r][t], 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            out[r][t] = _mm_cvtsi128_si32(s);
        }
}
}  // namespace
#elif defined(KT_INT8_GEMM)
namespace {
constexpr bool kOffsetSums = true;
template <int R, int T>
inline void block(const int8_t* const* w, const uint8_t* const* x, int k, int32_t out[R][T]) {
    __m512i acc[R][T];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_si512();
    for (int i = 0; i < k; i += 64) {
        __m512i wv[R];
        for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_si512((const void*)(w[r] + i));
        for (int t = 0; t < T; t++) {
            const __m512i xv = _mm512_loadu_si512((const void*)(x[t] + i));
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], xv, wv[r]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) out[r][t] = _mm512_reduce_add_epi32(acc[r][t]);
}
}  // namespace
#endif

#if defined(KT_INT8_GEMM) || defined(KT_INT8_GEMM_256)
namespace {
template <int R, int T>
inline void store(const Int8Weights& w, int r, const float* sx, const int32_t sums[R][T], float* out, size_t stride,
                  int t0) {
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++)
            out[(size_t)(t0 + j) * stride + (r + i)] =
                (float)(kOffsetSums ? sums[i][j] - 128 * w.row_sum[r + i] : sums[i][j]) * w.scale[r + i] * sx[t0 + j];
}

template <int R, int T>
inline void step(const Int8Weights& w, int k, int r, int t, const uint8_t* const* xs, const float* sx, float* out,
                 size_t stride) {
    const int8_t* rows[R];
    for (int i = 0; i < R; i++) rows[i] = w.w + (size_t)(r + i) * k;
    int32_t sums[R][T];
    block<R, T>(rows, xs + t, k, sums);
    store<R, T>(w, r, sx, sums, out, stride, t);
}
}  // namespace
#endif

#if defined(KT_AMX)
namespace {
// RB (1 or 2) blocks of 16 weight rows, packed one after the other (`packed`, k/64 tiles of 1 KiB
// a block), against TT (1 or 2) groups of 16 activation rows in `a` (row stride k):
//   C tile 2 rb + tt += A tile 4 + tt (activations) x B tile 6 + rb (weights)
// so up to four accumulations are in flight (each tdpbusd waits for the last one into its C) and
// each weight tile loaded serves both token groups. `ahead` bytes past the tiles being read are
// prefetched (0: none), the weights streaming from memory one 1 KiB tile per block and step.
template <int RB, int TT>
void amx_block(const int8_t* packed, const uint8_t* a, int k, int ahead, int32_t c[2][2][16][16]) {
    const size_t block = (size_t)(k / 64) * 1024;
    zero_accumulators<RB, TT>();
    for (int kb = 0; kb < k / 64; kb++) {
        const int8_t* w = packed + (size_t)kb * 1024;
        if (ahead)
            for (int rb = 0; rb < RB; rb++)
                for (int l = 0; l < 1024; l += 64) _mm_prefetch((const char*)w + rb * block + ahead + l, _MM_HINT_T0);
        _tile_loadd(6, w, 64);
        if (RB > 1) _tile_loadd(7, w + block, 64);
        _tile_loadd(4, a + kb * 64, k);
        if (TT > 1) _tile_loadd(5, a + (size_t)16 * k + kb * 64, k);
        _tile_dpbusd(0, 4, 6);
        if (TT > 1) _tile_dpbusd(1, 5, 6);
        if (RB > 1) _tile_dpbusd(2, 4, 7);
        if (RB > 1 && TT > 1) _tile_dpbusd(3, 5, 7);
    }
    store_accumulators<RB, TT>(c);
}

template <int RB>
void amx_blocks(const int8_t* packed, const uint8_t* a, int k, int m, int ahead, int32_t c[2][2][16][16]) {
    if (m > 16) amx_block<RB, 2>(packed, a, k, ahead, c);
    else amx_block<RB, 1>(packed, a, k, ahead, c);
}

// Every 16-row block of [r0, r1) that starts at a multiple of 16, two blocks at a time where two
// remain; returns the first row not done.
int amx_rows(const Int8Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
             float* out, size_t stride) {
    int first = (r0 + 15) / 16 * 16;
    if (first + 16 > r1 || !amx_available()) return r0;
    configure_tiles();
    const int last = r1 - (r1 - first) % 16;  // the end of the whole blocks
    const int ahead = kPrefetchAhead;
    thread_local std::vector<uint8_t> a;  // the activation rows, 32 at a time, zero rows as padding
    if (a.size() < (size_t)32 * k) a.resize((size_t)32 * k);
    int32_t c[2][2][16][16];
    for (int t0 = 0; t0 < count; t0 += 32) {
        const int m = std::min(32, count - t0);
        for (int i = 0; i < 32; i++)
            if (i < m) std::memcpy(&a[(size_t)i * k], xs[t0 + i], k);
            else std::memset(&a[(size_t)i * k], 128, k);
        for (int r = first; r < last;) {
            const int8_t* packed = w.amx + (size_t)(r / 16) * (k / 64) * 1024;
            const int blocks = r + 32 <= last ? 2 : 1;
            if (blocks == 2) amx_blocks<2>(packed, a.data(), k, m, ahead, c);
            else amx_blocks<1>(packed, a.data(), k, m, ahead, c);
            // (c - 128 row_sum) * scale * sx, 16 rows a vector (the same float steps as the AVX-512 path's)
            for (int b = 0; b < blocks; b++, r += 16) {
                const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512((const void*)(w.row_sum + r)), 7);
                const __m512 scale = _mm512_loadu_ps(w.scale + r);
                for (int i = 0; i < m; i++) {
                    const __m512 v = _mm512_cvtepi32_ps(
                        _mm512_sub_epi32(_mm512_loadu_si512((const void*)c[b][i / 16][i % 16]), offset));
                    _mm512_storeu_ps(out + (size_t)(t0 + i) * stride + r,
                                     _mm512_mul_ps(_mm512_mul_ps(v, scale), _mm512_set1_ps(sx[t0 + i])));
                }
            }
        }
    }
    // rows before `first` and after the last whole block: the caller's AVX-512 loop
    return last;
}
}  // namespace
#endif

#if defined(KT_AMX)
namespace {
// Rows [r0, r1) through the AVX-512 loop, for rows AMX's whole 16-row blocks leave over. A copy
// kept as AMX tiles alone (whole blocks: Int8Rows.pack_amx) has none: every caller splits rows
// in whole blocks.
void edge_rows(const Int8Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t out_stride) {
    if (r0 >= r1) return;
    if (!w.w)
        throw std::logic_error("int8_rows: rows " + std::to_string(r0) + ".." + std::to_string(r1) +
                               " are not whole 16-row blocks of a copy kept as AMX tiles alone");
    int8_rows(Int8Weights{w.w, w.scale, w.row_sum, nullptr}, k, r0, r1, xs, sx, count, out, out_stride);
}
}  // namespace
#endif

void int8_rows(const Int8Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t out_stride) {
#if defined(KT_AMX)
    if (w.amx) {
        const int first = std::min(r1, (r0 + 15) / 16 * 16);
        const int done_to = amx_rows(w, k, r0, r1, xs, sx, count, out, out_stride);
        if (done_to == r0) {  // no whole block (or no tiles for this process): all rows are edges
            edge_rows(w, k, r0, r1, xs, sx, count, out, out_stride);
            return;
        }
        edge_rows(w, k, r0, first, xs, sx, count, out, out_stride);  // AMX did [first, done_to)
        edge_rows(w, k, done_to, r1, xs, sx, count, out, out_stride);
        return;
    }
#endif
#if defined(KT_INT8_GEMM) || defined(KT_INT8_GEMM_256)
    int r = r0;
#if defined(KT_INT8_GEMM)  // (4 x 4 accumulators fill the 16 ymm registers of the 256-bit level: 2 x 4 there)
    for (; r + 4 <= r1; r += 4) {
        int t = 0;
        for (; t + 4 <= count; t += 4) step<4, 4>(w, k, r, t, xs, sx, out, out_stride);
        for (; t < count; t++) step<4, 1>(w, k, r, t, xs, sx, out, out_stride);
    }
#endif
    for (; r + 2 <= r1; r += 2) {
        int t = 0;
        for (; t + 4 <= count; t += 4) step<2, 4>(w, k, r, t, xs, sx, out, out_stride);
        for (; t < count; t++) step<2, 1>(w, k, r, t, xs, sx, out, out_stride);
    }
    for (; r < r1; r++) {
        int t = 0;
        for (; t + 4 <= count; t += 4) step<1, 4>(w, k, r, t, xs, sx, out, out_stride);
        for (; t < count; t++) step<1, 1>(w, k, r, t, xs, sx, out, out_stride);
    }
#else
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < count; t++) {
            const int8_t* row = w.w + (size_t)r * k;
            int32_t sum = 0;
            for (int i = 0; i < k; i++) sum += row[i] * (int)xs[t][i];
            out[(size_t)t * out_stride + r] = (float)(sum - 128 * w.row_sum[r]) * w.scale[r] * sx[t];
        }
#endif
}

}  // namespace kt
