// Row dot products of GGML weight blocks with quantized activations.
// Each format has a scalar reference; an AVX2 path where the build has AVX2 (every ISA level
// we build for does). Integer sums are exact; only the final scaling is in float.
#include "quants.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kt {
namespace {

const int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#if defined(__AVX2__)
// The 8 six-bit scales (bytes 0..7) and 8 mins (bytes 8..15) of a Q4_K / Q5_K super-block,
// unpacked in 32-bit steps straight into a register (no store-to-load round trip).
inline __m128i k4_scales_vec(const uint8_t* q) {
    uint32_t u0, u1, u2;
    std::memcpy(&u0, q, 4), std::memcpy(&u1, q + 4, 4), std::memcpy(&u2, q + 8, 4);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    return _mm_set_epi32((int)(((u2 >> 4) & m4) | (((u1 >> 6) & m2) << 4)), (int)(u1 & m6),
                         (int)((u2 & m4) | (((u0 >> 6) & m2) << 4)), (int)(u0 & m6));
}
// sum_j mins_j * (bsums[2j] + bsums[2j+1]) for the 8 mins in bytes 8..15 of `sm`
inline int k4_mins_dot(__m128i sm, const int16_t* bsums) {
    const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i*)bsums), _mm_loadu_si128((const __m128i*)(bsums + 8)));
    __m128i prod = _mm_madd_epi16(pairs, _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)));
    prod = _mm_add_epi32(prod, _mm_shuffle_epi32(prod, 0x4e));
    prod = _mm_add_epi32(prod, _mm_shuffle_epi32(prod, 0xb1));
    return _mm_cvtsi128_si32(prod);
}
#endif

// 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// ---- activation preparation ---------------------------------------------------------------
#if defined(__AVX2__)
inline float hmax_f32(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
// amax of n floats (n % 8 == 0); NaN where one is NaN (maxps drops NaNs: they are looked for
// apart), so that the block's scale, and every sum it multiplies, is NaN as the reference's is
inline float absmax(const float* x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    return _mm256_movemask_ps(nan) ? NAN : hmax_f32(m);
}
// round(x * id) to int8 (round to nearest even, as nearbyint), n % 8 == 0
inline void round_to_i8(const float* x, float id, int8_t* q, int n) {
    const __m256 s = _mm256_set1_ps(id);
    for (int i = 0; i < n; i += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i*)(q + i), _mm_packs_epi16(w, w));
    }
}
#else
inline float absmax(const float* x, int n) {  // NaN where one is NaN (fmax drops NaNs)
    float amax = 0;
    for (int i = 0; i < n; i++) {
        if (std::isnan(x[i])) return NAN;
        amax = std::fmax(amax, std::fabs(x[i]));
    }
    return amax;
}
inline void round_to_i8(const float* x, float id, int8_t* q, int n) {
    for (int i = 0; i < n; i++) q[i] = (int8_t)std::nearbyint(x[i] * id);
}
#endif

// One block of Q8_0: its 32 values rounded to int8 in qs; returns their scale.
inline float q8_0_block(const float* x, int8_t* qs) {
    const float d = absmax(x, QK) / 127.f, id = d ? 1.f / d : 0.f;
    round_to_i8(x, id, qs, QK);
    return d;
}

void prep_q8_0(const float* x, act_q8_0* y, int n) {
    for (int b = 0; b < n / QK; b++, x += QK) y[b].d = q8_0_block(x, y[b].qs);
}

void prep_q8_0u(const float* x, act_q8_0* y, int n) {
    prep_q8_0(x, y, n);
    for (int b = 0; b < n / QK; b++)
        for (int i = 0; i < QK; i++) y[b].qs[i] = (int8_t)((uint8_t)y[b].qs[i] ^ 0x80);
}

void prep_q8_0s(const float* x, act_q8_0s* y, int n) {
    for (int b = 0; b < n / QK; b++, x += QK) {
        y[b].d = q8_0_block(x, y[b].qs);
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) sum += y[b].qs[i];
        y[b].sum = sum;
    }
}

void prep_q8_k(const float* x, act_q8_k* y, int n) {
    for (int b = 0; b < n / QK_K; b++, x += QK_K) {
        const float d = absmax(x, QK_K) / 127.f, id = d ? 1.f / d : 0.f;
        y[b].d = d;
        round_to_i8(x, id, y[b].qs, QK_K);
        for (int g = 0; g < QK_K / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y[b].qs[16 * g + i];
            y[b].bsums[g] = (int16_t)s;
        }
    }
}

// Q8_K, then the bytes of each 128 reordered for 512-bit Q4_K (bsums stay in natural order).
void prep_q8_kx(const float* x, act_q8_k* y, int n) {
    prep_q8_k(x, y, n);
    for (int b = 0; b < n / QK_K; b++)
        for (int c = 0; c < QK_K; c += 128) {
            int8_t tmp[128];
            int8_t* q = y[b].qs + c;
            std::memcpy(tmp, q, 32);
            std::memcpy(tmp + 32, q + 64, 32);
            std::memcpy(tmp + 64, q + 32, 32);
            std::memcpy(tmp + 96, q + 96, 32);
            std::memcpy(q, tmp, 128);
        }
}

// Q8_K, with bsums[0..7] replaced by the sums of each 32 values in the order 0, 2, 1, 3, 4, 6, 5, 7
void prep_q8_kt(const float* x, act_q8_k* y, int n) {
    prep_q8_k(x, y, n);
    for (int b = 0; b < n / QK_K; b++) {
        int16_t* bs = y[b].bsums;
        const int16_t s[8] = {(int16_t)(bs[0] + bs[1]), (int16_t)(bs[2] + bs[3]), (int16_t)(bs[4] + bs[5]), (int16_t)(bs[6] + bs[7]),
                              (int16_t)(bs[8] + bs[9]), (int16_t)(bs[10] + bs[11]), (int16_t)(bs[12] + bs[13]), (int16_t)(bs[14] + bs[15])};
        const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
        for (int k = 0; k < 8; k++) bs[k] = s[order[k]];
        for (int k = 8; k < 16; k++) bs[k] = 0;
    }
}

// ---- 16-row tiles ---------------------------------------------------------------------------
// (asm volatile: GCC deleted _mm_prefetch from tiled kernels it was inlined into, silently.)
// Into L2 (T1), not L1: a T0 prefetch holds one of the core's L1 fill buffers (16 on Intel cores)
// for the whole memory latency, which caps a core's reads at 16 lines a latency; L2's queue keeps
// more lines in flight, and the lines move on to L1 at L2's latency.
inline void prefetch_line(const char* p) { __asm__ volatile("prefetcht1 %0" : : "m"(*p)); }
// prefetch part `part` (of `parts`) of the lines kPrefetchAhead bytes past `tile`
template <typename Tile>
inline void prefetch_ahead(const Tile* tile, int part, int parts) {
    constexpr int lines = (sizeof(Tile) + 63) / 64;
    const char* at = (const char*)tile + kPrefetchAhead;
    for (int l = part * lines / parts; l < (part + 1) * lines / parts; l++) prefetch_line(at + 64 * l);
}
// One tile step group from 32 bytes holding a sub-block's 32 values as nibbles (the low nibbles
// when !high): the 16 bytes [value x | value x + 16 << 4] for x = 0..15, stored as the four
// 4-byte lanes r of steps q = 0..3 (value x = 4q + i). 64-bit SWAR, no per-value loop.
inline void nibble_steps(const uint8_t* src, bool high, int r, uint8_t (*steps)[64]) {
    const uint64_t low = 0x0F0F0F0F0F0F0F0FULL;
    for (int half = 0; half < 2; half++) {  // values 8 half .. 8 half + 7: steps 2 half, 2 half + 1
        uint64_t a, b;
        std::memcpy(&a, src + 8 * half, 8);
        std::memcpy(&b, src + 16 + 8 * half, 8);
        const uint64_t packed = high ? ((a >> 4) & low) | (b & ~low) : (a & low) | ((b & low) << 4);
        std::memcpy(&steps[2 * half][4 * r], &packed, 4);
        std::memcpy(&steps[2 * half + 1][4 * r], reinterpret_cast<const uint8_t*>(&packed) + 4, 4);
    }
}

// Each tile column b of a group of 16 rows: pack(row r's `Block` b, tile b, r) for r = 0..15;
// a Block spans `elems` values of a row (one tile column).
template <typename Block, typename Tile, int elems = QK_K, typename Pack>
void repack_group(const void* src, void* dst, int n, Pack pack) {
    const int nb = n / elems;
    const Block* rows = (const Block*)src;
    Tile* tiles = (Tile*)dst;
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < kTileRows; r++) pack(rows[(size_t)r * nb + b], tiles[b], r);
}

// lane r of a Q4_K / Q5_K tile's header: d, dmin and the 12 packed scale bytes as they are
template <typename Block, typename Tile>
inline void k4_tile_header(const Block& blk, Tile& t, int r) {
    t.d[r] = blk.d, t.dmin[r] = blk.dmin;
    for (int p = 0; p < 3; p++) std::memcpy(&t.sc[p][r], blk.scales + 4 * p, 4);
}

void repack_q4_k16(const void* src, void* dst, int n) {
    repack_group<block_q4_k, tile_q4_k16>(src, dst, n, [](const block_q4_k& blk, tile_q4_k16& t, int r) {
        k4_tile_header(blk, t, r);
        for (int j = 0; j < 8; j++)  // qs[32p + l]: value 64p + l (low nibble), 64p + 32 + l (high)
            nibble_steps(blk.qs + 32 * (j / 2), j % 2, r, t.qs + 4 * j);
    });
}

void repack_q5_k16(const void* src, void* dst, int n) {
    repack_group<block_q5_k, tile_q5_k16>(src, dst, n, [](const block_q5_k& blk, tile_q5_k16& t, int r) {
        k4_tile_header(blk, t, r);
        for (int j = 0; j < 8; j++) {  // fifth bit of value 32j + l: bit j of qh[l]
            nibble_steps(blk.qs + 32 * (j / 2), j % 2, r, t.part[j].qs);
            uint32_t packed = 0;
            for (int q = 0; q < 4; q++) {
                uint32_t lo, hi;
                std::memcpy(&lo, blk.qh + 4 * q, 4);
                std::memcpy(&hi, blk.qh + 16 + 4 * q, 4);
                packed |= ((lo >> j) & 0x01010101u) << q | ((hi >> j) & 0x01010101u) << (4 + q);
            }
            std::memcpy(&t.part[j].qh[4 * r], &packed, 4);
        }
    });
}

void repack_q6_k16(const void* src, void* dst, int n) {
    repack_group<block_q6_k, tile_q6_k16>(src, dst, n, [](const block_q6_k& blk, tile_q6_k16& t, int r) {
        t.d[r] = blk.d;
        for (int j = 0; j < 8; j++) t.part[j / 2].sc[j % 2][r][0] = blk.scales[2 * j], t.part[j / 2].sc[j % 2][r][1] = blk.scales[2 * j + 1];
        // value 128 half + 32k + l: low 4 bits in ql[64 half + 32 (k % 2) + l] (k < 2: low nibble),
        // high 2 bits at bits 2k, 2k + 1 of qh[32 half + l]; sub-block j = 4 half + k
        for (int j = 0; j < 8; j++) {
            const int k = j % 4;
            nibble_steps(blk.ql + 64 * (j / 4) + 32 * (k % 2), k >= 2, r, t.part[j / 2].half[j % 2].ql);
            const uint8_t* qh = blk.qh + 32 * (j / 4);
            for (int h = 0; h < 2; h++) {  // four values' 2-bit fields a byte, four bytes at once
                auto bits = [&](int at) {
                    uint32_t u;
                    std::memcpy(&u, qh + at, 4);
                    return (u >> (2 * k)) & 0x03030303u;
                };
                const uint32_t packed = bits(8 * h) | bits(16 + 8 * h) << 2 | bits(8 * h + 4) << 4 | bits(20 + 8 * h) << 6;
                std::memcpy(&t.part[j / 2].half[j % 2].qh[h][4 * r], &packed, 4);
            }
        }
    });
}

struct block_q8_0x2 { block_q8_0 b[2]; };  // a Q8_0 tile column: two blocks, 64 values of a row

void repack_q8_0x16(const void* src, void* dst, int n) {  // n % 64 == 0
    repack_group<block_q8_0x2, tile_q8_0x16, 2 * QK>(src, dst, n, [](const block_q8_0x2& two, tile_q8_0x16& t, int r) {
        for (int h = 0; h < 2; h++) {
            t.d[h][r] = two.b[h].d;
            for (int q = 0; q < 8; q++) std::memcpy(&t.qs[h][q][4 * r], two.b[h].qs + 4 * q, 4);
        }
    });
}

void repack_mxfp4x16(const void* src, void* dst, int n) {
    repack_group<block_mxfp4, tile_mxfp4x16, QK>(src, dst, n, [](const block_mxfp4& blk, tile_mxfp4x16& t, int r) {
        t.e[r] = blk.e;
        for (int q = 0; q < 4; q++) std::memcpy(&t.qs[q][4 * r], blk.qs + 4 * q, 4);
    });
}

void repack_iq4_xs16(const void* src, void* dst, int n) {
    repack_group<block_iq4_xs, tile_iq4_xs16>(src, dst, n, [](const block_iq4_xs& blk, tile_iq4_xs16& t, int r) {
        t.d[r] = blk.d, t.sh[r] = blk.scales_h;
        std::memcpy(&t.sl[r], blk.scales_l, 4);
        for (int step = 0; step < 32; step++) std::memcpy(&t.qs[step][4 * r], blk.qs + 4 * step, 4);
    });
}

#if defined(__AVX2__)
inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
// Sum of products of signed bytes a and b, as 8 int32 lanes (maddubs and dpbusd need an unsigned
// side; |a| <= 128 and |b| <= 127 keep maddubs's int16 pair sums from saturating, so both agree).
inline __m256i dot_s8(__m256i a, __m256i b) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
#else
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}
#endif

// ---- 32-value blocks (Q8_0, Q4_0, MXFP4) x Q8_0 --------------------------------------------
// sum over blocks of d_w * d_x * (q_w . q_x); `vec(b)` gives block b's 32 signed weights as bytes,
// `at(b, i)` the i-th one (scalar build).
inline float block_scale(const block_q8_0& b) { return fp16_to_f32(b.d); }
inline float block_scale(const block_q4_0& b) { return fp16_to_f32(b.d); }
inline float block_scale(const block_mxfp4& b) { return e8m0_half(b.e); }

template <typename Block, typename Vec, typename At>
inline float dot_blocks32(int n, const Block* w, const act_q8_0* a, Vec vec, At at) {
    const int nb = n / QK;
#if defined(__AVX2__)
    (void)at;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i p = dot_s8(vec(b), _mm256_loadu_si256((const __m256i*)a[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(block_scale(w[b]) * a[b].d), _mm256_cvtepi32_ps(p), acc);
    }
    return hsum_f32(acc);
#else
    (void)vec;
    float sum = 0;
    for (int b = 0; b < nb; b++) {
        int s = 0;
        for (int i = 0; i < QK; i++) s += at(b, i) * a[b].qs[i];
        sum += block_scale(w[b]) * a[b].d * s;
    }
    return sum;
#endif
}

float dot_q8_0(int n, const void* vw, const void* va) {
    const block_q8_0* w = (const block_q8_0*)vw;
    return dot_blocks32(
        n, w, (const act_q8_0*)va,
        [&](int b) {
#if defined(__AVX2__)
            return _mm256_loadu_si256((const __m256i*)w[b].qs);
#else
            return b;
#endif
        },
        [&](int b, int i) { return (int)w[b].qs[i]; });
}

// Q4_0: value = (nibble - 8) * d; bytes 0..15 of a block hold values 0..15 (low) and 16..31 (high).
#if defined(__AVX2__)
// a block's 32 values (nibble - 8) as signed bytes, in order
inline __m256i q4_0_values(const block_q4_0& b) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)b.qs);
    const __m256i q = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_sub_epi8(_mm256_and_si256(q, _mm256_set1_epi8(0xF)), _mm256_set1_epi8(8));
}
#endif
float dot_q4_0(int n, const void* vw, const void* va) {
    const block_q4_0* w = (const block_q4_0*)vw;
    return dot_blocks32(
        n, w, (const act_q8_0*)va,
        [&](int b) {
#if defined(__AVX2__)
            return q4_0_values(w[b]);
#else
            return b;
#endif
        },
        [&](int b, int i) { return (i < 16 ? (w[b].qs[i] & 0xF) : (w[b].qs[i - 16] >> 4)) - 8; });
}

// MXFP4: the nibbles (ordered as Q4_0's) index the doubled e2m1 values, whole numbers in
// [-12, 12], so the integer dot products are Q4_0's; the exponent is the block's scale.
#if defined(__AVX2__)
inline __m256i mxfp4_values(const block_mxfp4& b) {
    const __m128i lut = _mm_loadu_si128((const __m128i*)kMxfp4Values);
    const __m128i raw = _mm_loadu_si128((const __m128i*)b.qs), low = _mm_set1_epi8(0xF);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, low));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low));
    return _mm256_set_m128i(hi, lo);
}
#endif
float dot_mxfp4(int n, const void* vw, const void* va) {
    const block_mxfp4* w = (const block_mxfp4*)vw;
    return dot_blocks32(
        n, w, (const act_q8_0*)va,
        [&](int b) {
#if defined(__AVX2__)
            return mxfp4_values(w[b]);
#else
            return b;
#endif
        },
        [&](int b, int i) { return (int)kMxfp4Values[i < 16 ? (w[b].qs[i] & 0xF) : (w[b].qs[i - 16] >> 4)]; });
}

#if defined(__AVX2__)
// Four activation rows against one weight row of 32-value blocks: the weights' magnitudes and
// scale are prepared once per block for all four (`vec(b)` as in dot_blocks32). The same integer
// sums (exact) and float steps as four dot_blocks32 calls: the results are identical.
template <typename Block, typename Vec>
inline void dot4_blocks32(int n, const Block* w, const void* const va[4], float out[4], Vec vec) {
    const act_q8_0* a[4] = {(const act_q8_0*)va[0], (const act_q8_0*)va[1], (const act_q8_0*)va[2], (const act_q8_0*)va[3]};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < n / QK; b++) {
        const __m256i q = vec(b);
        const __m256i mag = _mm256_sign_epi8(q, q);
        const float dw = block_scale(w[b]);
        for (int t = 0; t < 4; t++) {
            const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)a[t][b].qs), q);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), mag, x);
#elif defined(__AVXVNNI__)
            const __m256i p = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), mag, x);
#else
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, x), _mm256_set1_epi16(1));
#endif
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[t][b].d), _mm256_cvtepi32_ps(p), acc[t]);
        }
    }
    for (int t = 0; t < 4; t++) out[t] = hsum_f32(acc[t]);
}

void dot4_q8_0(int n, const void* vw, const void* const va[4], float out[4]) {
    const block_q8_0* w = (const block_q8_0*)vw;
    dot4_blocks32(n, w, va, out, [&](int b) { return _mm256_loadu_si256((const __m256i*)w[b].qs); });
}

void dot4_q4_0(int n, const void* vw, const void* const va[4], float out[4]) {
    const block_q4_0* w = (const block_q4_0*)vw;
    dot4_blocks32(n, w, va, out, [&](int b) { return q4_0_values(w[b]); });
}

void dot4_mxfp4(int n, const void* vw, const void* const va[4], float out[4]) {
    const block_mxfp4* w = (const block_mxfp4*)vw;
    dot4_blocks32(n, w, va, out, [&](int b) { return mxfp4_values(w[b]); });
}
#endif

#if defined(__AVX2__)
// any number of tokens: four at a time (each tile decoded once per four), then the rest;
// kernel(std::integral_constant<int, T>, n, tiles, activation rows, out) runs T of them
template <typename Tile, typename ActBlock, typename Kernel>
void tile_tokens(int n, const void* w, const void* const* a, int count, float* out, Kernel kernel) {
    const Tile* tw = (const Tile*)w;
    const ActBlock* const* x = (const ActBlock* const*)a;
    int i = 0;
    for (; i + 4 <= count; i += 4) kernel(std::integral_constant<int, 4>{}, n, tw, x + i, out + 16 * i);
    switch (count - i) {
        case 3: kernel(std::integral_constant<int, 3>{}, n, tw, x + i, out + 16 * i); break;
        case 2: kernel(std::integral_constant<int, 2>{}, n, tw, x + i, out + 16 * i); break;
        case 1: kernel(std::integral_constant<int, 1>{}, n, tw, x + i, out + 16 * i); break;
    }
}
#endif

#if defined(__AVX512BW__)
inline float hsum512_f32(__m512 v) { return _mm512_reduce_add_ps(v); }
// acc + (pairs of int16 products p * s summed into int32): one VNNI instruction where the build has it
inline __m512i madd_acc(__m512i acc, __m512i p, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, p, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
#endif
}
// 16-bit lanes of every 128-bit lane i take the 16-bit value at index idx[i] of a 128-bit table
inline __m512i pick16(__m128i table8x16, int i0, int i1, int i2, int i3) {
    const __m512i t = _mm512_broadcast_i32x4(table8x16);
    auto pair = [](int i) { return (long long)(((2 * i + 1) << 8) | (2 * i)) * 0x0001000100010001LL; };
    return _mm512_shuffle_epi8(t, _mm512_set_epi64(pair(i3), pair(i3), pair(i2), pair(i2), pair(i1), pair(i1), pair(i0), pair(i0)));
}

// Quants c (0, 1) of a Q4_K / Q5_K block as bytes: lo = sub-blocks 4c (low 256 bits) and 4c+2
// (high), hi = 4c+1 and 4c+3. Q5_K: the fifth bit of sub-block s is bit s of each qh byte (qh:
// its 32 bytes in both halves), moved to bit 4 by one rotation of the 32-bit lanes by 4 - s
// (each byte's bit 4 then comes from its own bit s).
template <typename Block>
inline void k4_values(const Block& blk, int c, __m512i qh, __m512i& lo, __m512i& hi) {
    const __m512i low = _mm512_set1_epi8(0xF);
    const __m512i raw = _mm512_loadu_si512((const void*)(blk.qs + 64 * c));
    lo = _mm512_and_si512(raw, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    if constexpr (std::is_same<Block, block_q5_k>::value) {
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        const auto turn = [](int s_lo, int s_hi) {
            return _mm512_inserti64x4(_mm512_set1_epi32((4 - s_lo) & 31), _mm256_set1_epi32((4 - s_hi) & 31), 1);
        };
        const int j = 4 * c;
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_rolv_epi32(qh, turn(j, j + 2)), bit4));
        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_rolv_epi32(qh, turn(j + 1, j + 3)), bit4));
    } else {
        (void)qh;
    }
}
template <typename Block>
inline __m512i k4_high_bits(const Block& blk) {
    if constexpr (std::is_same<Block, block_q5_k>::value) return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)blk.qh));
    else return _mm512_setzero_si512();
}

// [d, dmin, 0, 0]: a K-quant block's two fp16 scales (adjacent), as floats
inline __m128 k4_block_scales(const fp16_t* d_dmin) {
    uint32_t both;
    std::memcpy(&both, d_dmin, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)both));
}
// mins += dmin * ad * [m_j * (bsums[2j] + bsums[2j+1]) summed in pairs of j], four lanes: the
// block's min term stays in a vector until the row's end (no horizontal sum per block)
inline __m128 k4_mins_acc(__m128 mins, __m128 dd, __m128i mins16, const int16_t* bsums) {
    const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i*)bsums), _mm_loadu_si128((const __m128i*)(bsums + 8)));
    return _mm_fmadd_ps(_mm_shuffle_ps(dd, dd, 0x55), _mm_cvtepi32_ps(_mm_madd_epi16(pairs, mins16)), mins);
}
inline float hsum128_f32(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// Q4_K, and Q5_K (the same plus a fifth bit per value in qh: bit j of qh[l] for value l of
// sub-block j), against T activation rows in the Q8_KX order: each weight block unpacked once for
// all of them, the same float steps per row whatever T (one token alone gives what it gives among
// four, to the bit).
template <typename Block, int T>
void dot_k4_rows(int n, const Block* w, const act_q8_k* const* a, float* out) {
    __m512 acc[T];
    __m128 mins[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps(), mins[t] = _mm_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) {
        const __m128i sm = k4_scales_vec(w[b].scales);
        const __m128i sc = _mm_cvtepu8_epi16(sm), mins16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
        const __m512i qh = k4_high_bits(w[b]);
        __m512i sumi[T];
        for (int t = 0; t < T; t++) sumi[t] = _mm512_setzero_si512();
        for (int c = 0; c < 2; c++) {  // 64 bytes of quants = sub-blocks 4c (lo), 4c+1 (hi), 4c+2 (lo), 4c+3 (hi)
            __m512i lo, hi;
            k4_values(w[b], c, qh, lo, hi);
            const int j = 4 * c;
            const __m512i s0 = pick16(sc, j, j, j + 2, j + 2), s1 = pick16(sc, j + 1, j + 1, j + 3, j + 3);
            for (int t = 0; t < T; t++) {
                const int8_t* x = a[t][b].qs + 128 * c;  // x[0..31], x[64..95] against lo; x[32..63], x[96..127] hi
                sumi[t] = madd_acc(sumi[t], _mm512_maddubs_epi16(lo, _mm512_loadu_si512((const void*)x)), s0);
                sumi[t] = madd_acc(sumi[t], _mm512_maddubs_epi16(hi, _mm512_loadu_si512((const void*)(x + 64))), s1);
            }
        }
        const __m128 dw = k4_block_scales(&w[b].d);
        for (int t = 0; t < T; t++) {
            const __m128 dd = _mm_mul_ps(dw, _mm_set1_ps(a[t][b].d));  // [d * ad, dmin * ad]
            mins[t] = k4_mins_acc(mins[t], dd, mins16, a[t][b].bsums);
            acc[t] = _mm512_fmadd_ps(_mm512_broadcastss_ps(dd), _mm512_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) out[t] = hsum512_f32(acc[t]) - hsum128_f32(mins[t]);
}
template <typename Block>
float dot_k4_avx512(int n, const Block* w, const act_q8_k* a) {
    float out;
    dot_k4_rows<Block, 1>(n, w, &a, &out);
    return out;
}
void dot4_q4_k(int n, const void* vw, const void* const va[4], float out[4]) {
    dot_k4_rows<block_q4_k, 4>(n, (const block_q4_k*)vw, (const act_q8_k* const*)va, out);
}
void dot4_q5_k(int n, const void* vw, const void* const va[4], float out[4]) {
    dot_k4_rows<block_q5_k, 4>(n, (const block_q5_k*)vw, (const act_q8_k* const*)va, out);
}

#if defined(__AVX512VNNI__)
// acc + dpbusd(w, x's 4 bytes broadcast to the 16 lanes), the broadcast folded into the instruction
// ({1to16}: one op where GCC emits a broadcast load and the dpbusd: fewer instructions in the
// T=1 tiles' loop, which must keep up with memory)
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)x));
    return acc;
}
// One tile step for T tokens: acc_lo[t] += lo . (token t's bytes at+0..3), acc_hi[t] += hi .
// (its bytes at+16..19), each token's four bytes broadcast to the 16 rows (acc_lo may be acc_hi).
template <int T>
inline void dpbusd_tokens(__m512i* acc_lo, __m512i* acc_hi, __m512i lo, __m512i hi, const act_q8_k* const* a, int b, int at) {
    for (int t = 0; t < T; t++) {
        acc_lo[t] = dpbusd_bcast(acc_lo[t], lo, a[t][b].qs + at);
        acc_hi[t] = dpbusd_bcast(acc_hi[t], hi, a[t][b].qs + at + 16);
    }
}
// acc[t] += d (the 16 rows' block scales) * token t's scale * total[t]: a block's exact integer
// sums, scaled once
template <int T>
inline void scale_accumulate(__m512* acc, __m512 d, const act_q8_k* const* a, int b, const __m512i* total) {
    for (int t = 0; t < T; t++) acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a[t][b].d)), _mm512_cvtepi32_ps(total[t]), acc[t]);
}

// 16 rows of Q4_K (or Q5_K) tiles against T activation rows (Q8_KT): per sub-block j, four dpbusd per token
// on the unpacked nibbles (16 rows x 4 values each) with the token's 4 bytes broadcast, then
// times the rows' scales (one vector of 16); the mins as int16 pairs against pairs of 32-sums.
template <typename Tile, int T>
void tile_k4_rows(int n, const Tile* w, const act_q8_k* const* a, float* out) {
    constexpr bool five = std::is_same<Tile, tile_q5_k16>::value;  // Q5_K: a fifth bit from qh
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(0x0F);
    const __m512i pair6 = _mm512_set1_epi32(0x003F003F), pair4 = _mm512_set1_epi32(0x000F000F);
    __m512 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    // the tile's bytes in order, d and dmin first: one forward stream for the prefetchers; and each
    // tile's header (d, dmin, scales) loaded during the tile before it: every sub-block's result
    // waits for its scale, so a header that missed the cache held the whole tile (and the
    // reorder window with it) for one memory latency
    const int nb = n / QK_K;
    __m256i nd = _mm256_loadu_si256((const __m256i*)w->d), ndm = _mm256_loadu_si256((const __m256i*)w->dmin);
    __m512i n0 = _mm512_loadu_si512(w->sc[0]), n1 = _mm512_loadu_si512(w->sc[1]), n2 = _mm512_loadu_si512(w->sc[2]);
    for (int b = 0; b < nb; b++, w++) {
        const __m512 d_rows = _mm512_cvtph_ps(nd), dmin = _mm512_cvtph_ps(ndm);
        const __m512i P0 = n0, P1 = n1, P2 = n2;
        if (b + 1 < nb) {
            nd = _mm256_loadu_si256((const __m256i*)w[1].d), ndm = _mm256_loadu_si256((const __m256i*)w[1].dmin);
            n0 = _mm512_loadu_si512(w[1].sc[0]), n1 = _mm512_loadu_si512(w[1].sc[1]), n2 = _mm512_loadu_si512(w[1].sc[2]);
        }
        __m512i sumi[T];
        for (int t = 0; t < T; t++) sumi[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            prefetch_ahead(w, j, 8);
            // sub-block j's scale: j < 4 byte j of P0 (6 bits); else byte j-4 of P2 (low 4) with bits 6, 7 of byte j-4 of P0
            const __m512i sc = j < 4 ? _mm512_and_si512(_mm512_srli_epi32(P0, 8 * j), six)
                                     : _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi32(P2, 8 * (j - 4)),
                                                                                  _mm512_srli_epi32(P0, 8 * (j - 4) + 2), four, 0xE4), six);
            __m512i dj[T], dh[T];
            for (int t = 0; t < T; t++) dj[t] = _mm512_setzero_si512(), dh[t] = _mm512_setzero_si512();
            __m512i qh = _mm512_setzero_si512();
            if constexpr (five) qh = _mm512_loadu_si512(w->part[j].qh);
            for (int q = 0; q < 4; q++) {
                __m512i v;
                if constexpr (five) v = _mm512_loadu_si512(w->part[j].qs[q]);
                else v = _mm512_loadu_si512(w->qs[4 * j + q]);
                __m512i lo = _mm512_and_si512(v, low4);
                if constexpr (five) {  // bit q -> bit 4 (low values), bit 4 + q -> bit 4 (high); a | (b & c)
                    const __m512i bit4 = _mm512_set1_epi8(0x10);
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                    lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(qh, 4 - q), bit4, 0xF8);
                    hi = _mm512_ternarylogic_epi32(hi, q ? _mm512_srli_epi16(qh, q) : qh, bit4, 0xF8);
                    dpbusd_tokens<T>(dj, dj, lo, hi, a, b, 32 * j + 4 * q);
                } else {  // the high nibbles in place, as 16x their value: one AND, no shift
                    dpbusd_tokens<T>(dj, dh, lo, _mm512_and_si512(v, high4), a, b, 32 * j + 4 * q);
                }
            }
            if constexpr (!five)  // (a sum of multiples of 16: the shift is exact)
                for (int t = 0; t < T; t++) dj[t] = _mm512_add_epi32(dj[t], _mm512_srai_epi32(dh[t], 4));
            for (int t = 0; t < T; t++) sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(dj[t], sc));
        }
        // mins as int16 pairs per row: (m0, m2), (m1, m3), (m4, m6), (m5, m7)
        const __m512i m02 = _mm512_and_si512(P1, pair6), m13 = _mm512_and_si512(_mm512_srli_epi32(P1, 8), pair6);
        const __m512i m46 = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi32(P2, 4), _mm512_srli_epi32(P1, 2), pair4, 0xE4), pair6);
        const __m512i m57 = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi32(P2, 12), _mm512_srli_epi32(P1, 10), pair4, 0xE4), pair6);
        scale_accumulate<T>(acc, d_rows, a, b, sumi);
        for (int t = 0; t < T; t++) {
            int32_t pr[4];
            std::memcpy(pr, a[t][b].bsums, 16);
            __m512i ms = _mm512_madd_epi16(m02, _mm512_set1_epi32(pr[0]));
            ms = _mm512_dpwssd_epi32(ms, m13, _mm512_set1_epi32(pr[1]));
            ms = _mm512_dpwssd_epi32(ms, m46, _mm512_set1_epi32(pr[2]));
            ms = _mm512_dpwssd_epi32(ms, m57, _mm512_set1_epi32(pr[3]));
            acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, _mm512_set1_ps(a[t][b].d)), _mm512_cvtepi32_ps(ms), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + 16 * t, acc[t]);
}
// 16 rows of Q6_K tiles against T activation rows (Q8_K): the low nibbles as in the Q4_K tiles,
// the high 2 bits moved to bits 4-5 by one shift each and merged by one ternary-logic op; per
// sub-block pair two accumulators times the rows' scales; the -32 of every value as
// 32 * (scales . bsums), pairs of scales against pairs of bsums (dpwssd), all in int32.
template <int T>
void tile_q6_k16_rows(int n, const tile_q6_k16* w, const act_q8_k* const* a, float* out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    __m512 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < n / QK_K; b++, w++) {
        __m512i sumi[T], offs[T];
        for (int t = 0; t < T; t++) sumi[t] = _mm512_setzero_si512(), offs[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            prefetch_ahead(w, j, 8);
            const __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)w->part[j / 2].sc[j % 2]));  // int16 (sc[2j], sc[2j+1]) a row
            const __m512i s_lo = _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16), s_hi = _mm512_srai_epi32(pair, 16);
            __m512i dlo[T], dhi[T];
            for (int t = 0; t < T; t++) dlo[t] = _mm512_setzero_si512(), dhi[t] = _mm512_setzero_si512();
            const auto& half = w->part[j / 2].half[j % 2];
            const __m512i Hs[2] = {_mm512_loadu_si512(half.qh[0]), _mm512_loadu_si512(half.qh[1])};  // (before ql: in order)
            for (int h = 0; h < 2; h++) {
                const __m512i H = Hs[h];
                const __m512i hs[4] = {_mm512_slli_epi16(H, 4), _mm512_slli_epi16(H, 2), H, _mm512_srli_epi16(H, 2)};
                for (int qq = 0; qq < 2; qq++) {
                    const int q = 2 * h + qq;
                    const __m512i v = _mm512_loadu_si512(half.ql[q]);
                    const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low4), hs[2 * qq], bits45, 0xF8);  // a | (b & c)
                    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), hs[2 * qq + 1], bits45, 0xF8);
                    dpbusd_tokens<T>(dlo, dhi, lo, hi, a, b, 32 * j + 4 * q);
                }
            }
            for (int t = 0; t < T; t++) {
                int32_t bs;
                std::memcpy(&bs, a[t][b].bsums + 2 * j, 4);
                sumi[t] = _mm512_add_epi32(sumi[t], _mm512_add_epi32(_mm512_mullo_epi32(dlo[t], s_lo), _mm512_mullo_epi32(dhi[t], s_hi)));
                offs[t] = _mm512_dpwssd_epi32(offs[t], pair, _mm512_set1_epi32(bs));
            }
        }
        for (int t = 0; t < T; t++) sumi[t] = _mm512_sub_epi32(sumi[t], _mm512_slli_epi32(offs[t], 5));  // the -32s
        scale_accumulate<T>(acc, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w->d)), a, b, sumi);
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + 16 * t, acc[t]);
}

// 16 rows of IQ4_XS tiles against T activation rows (Q8_KT): nibbles through the IQ4_NL table
// shifted by +128 (dpbusd wants unsigned weights), the shift taken back as 128 * (scales . 32-sums)
// with pairs of scales against the activation's pairs of sums; the 6-bit scales minus 32 per row.
template <int T>
void tile_iq4_xs16_rows(int n, const tile_iq4_xs16* w, const act_q8_k* const* a, float* out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), table = _mm512_broadcast_i32x4(_mm_add_epi8(_mm_loadu_si128((const __m128i*)kIQ4NL), _mm_set1_epi8((char)128)));
    __m512 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    // d, sh, sl, qs: in order; each tile's header loaded during the tile before it (see tile_k4_rows)
    const int nb = n / QK_K;
    __m256i nd = _mm256_loadu_si256((const __m256i*)w->d), nh = _mm256_loadu_si256((const __m256i*)w->sh);
    __m512i nl = _mm512_loadu_si512(w->sl);
    for (int b = 0; b < nb; b++, w++) {
        prefetch_ahead(w, 0, 1);
        const __m512 d_rows = _mm512_cvtph_ps(nd);
        const __m512i Hh = _mm512_cvtepu16_epi32(nh), L = nl;
        if (b + 1 < nb)
            nd = _mm256_loadu_si256((const __m256i*)w[1].d), nh = _mm256_loadu_si256((const __m256i*)w[1].sh), nl = _mm512_loadu_si512(w[1].sl);
        __m512i sc[8];
        for (int j = 0; j < 8; j++) {  // low 4 bits: nibble j of scales_l; high 2: bits 2j, 2j+1 of scales_h
            const __m512i hi = 2 * j <= 4 ? _mm512_slli_epi32(Hh, 4 - 2 * j) : _mm512_srli_epi32(Hh, 2 * j - 4);
            const __m512i six = _mm512_ternarylogic_epi32(_mm512_srli_epi32(L, 4 * j), hi, _mm512_set1_epi32(0x0F), 0xE4);
            sc[j] = _mm512_sub_epi32(_mm512_and_si512(six, _mm512_set1_epi32(0x3F)), _mm512_set1_epi32(32));
        }
        __m512i sumi[T], offs[T];
        for (int t = 0; t < T; t++) sumi[t] = _mm512_setzero_si512(), offs[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            __m512i dj[T];
            for (int t = 0; t < T; t++) dj[t] = _mm512_setzero_si512();
            for (int q = 0; q < 4; q++) {
                const __m512i v = _mm512_loadu_si512(w->qs[4 * j + q]);
                const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
                const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
                dpbusd_tokens<T>(dj, dj, lo, hi, a, b, 32 * j + 4 * q);
            }
            for (int t = 0; t < T; t++) sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(dj[t], sc[j]));
        }
        const int order[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};  // Q8_KT's pairs of 32-sums
        for (int k = 0; k < 4; k++) {
            const __m512i pair = _mm512_mask_blend_epi16(0xAAAAAAAA, sc[order[k][0]], _mm512_slli_epi32(sc[order[k][1]], 16));
            for (int t = 0; t < T; t++) {
                int32_t bs;
                std::memcpy(&bs, a[t][b].bsums + 2 * k, 4);
                offs[t] = _mm512_dpwssd_epi32(offs[t], pair, _mm512_set1_epi32(bs));
            }
        }
        for (int t = 0; t < T; t++) sumi[t] = _mm512_sub_epi32(sumi[t], _mm512_slli_epi32(offs[t], 7));  // the +128s
        scale_accumulate<T>(acc, d_rows, a, b, sumi);
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + 16 * t, acc[t]);
}

// 16 rows of Q8_0 tiles against T activation rows (Q8_0U): dpbusd of the tokens' unsigned bytes
// (value + 128) with the signed weights, the +128 taken back as 128 * (sum of each row's 32
// weights, one more dpbusd against ones); scaled per 32 values.
template <int T>
void tile_q8_0x16_rows(int n, const tile_q8_0x16* w, const act_q8_0* const* a, float* out) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < n / 64; b++, w++) {
        prefetch_ahead(w, 0, 1);
        for (int h = 0; h < 2; h++) {
            const int blk = 2 * b + h;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w->d[h]));  // (first: in order)
            __m512i dot[T], sum = _mm512_setzero_si512();
            for (int t = 0; t < T; t++) dot[t] = _mm512_setzero_si512();
            for (int q = 0; q < 8; q++) {
                const __m512i v = _mm512_loadu_si512(w->qs[h][q]);
                sum = _mm512_dpbusd_epi32(sum, ones, v);
                for (int t = 0; t < T; t++) {
                    int32_t x;
                    std::memcpy(&x, a[t][blk].qs + 4 * q, 4);
                    dot[t] = _mm512_dpbusd_epi32(dot[t], _mm512_set1_epi32(x), v);
                }
            }
            const __m512i offset = _mm512_slli_epi32(sum, 7);
            for (int t = 0; t < T; t++)
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a[t][blk].d)), _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[t], offset)), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + 16 * t, acc[t]);
}

// 16 rows of MXFP4 tiles against T activation rows (Q8_0S): the nibbles through the doubled e2m1
// table plus 12 (unsigned bytes 0..24), dpbusd of them with the tokens' signed bytes, the +12
// taken back as 12 * (the block's sum of the token's values, from its Q8_0S block); scaled per 32
// values by 2^(e - 128) (e8m0_half, subnormal for e < 2).
template <int T>
void tile_mxfp4x16_rows(int n, const tile_mxfp4x16* w, const act_q8_0s* const* a, float* out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kMxfp4Plus12));
    const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2), tiny = _mm512_set1_epi32(0x00200000);
    __m512 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < n / QK; b++, w++) {
        prefetch_ahead(w, 0, 1);
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)w->e));
        const __m512i bits = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, two), _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23),
                                                     _mm512_sllv_epi32(tiny, e));
        const __m512 d = _mm512_castsi512_ps(bits);
        __m512i dlo[T], dhi[T];  // (two chains of dependent dpbusd a token, not one: half the latency)
        for (int t = 0; t < T; t++) dlo[t] = _mm512_set1_epi32(-12 * a[t][b].sum), dhi[t] = _mm512_setzero_si512();
        for (int q = 0; q < 4; q++) {
            const __m512i v = _mm512_loadu_si512(w->qs[q]);
            const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
            const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
            for (int t = 0; t < T; t++) {
                int32_t xl, xh;
                std::memcpy(&xl, a[t][b].qs + 4 * q, 4);
                std::memcpy(&xh, a[t][b].qs + 16 + 4 * q, 4);
                dlo[t] = _mm512_dpbusd_epi32(dlo[t], lo, _mm512_set1_epi32(xl));
                dhi[t] = _mm512_dpbusd_epi32(dhi[t], hi, _mm512_set1_epi32(xh));
            }
        }
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a[t][b].d)), _mm512_cvtepi32_ps(_mm512_add_epi32(dlo[t], dhi[t])), acc[t]);
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + 16 * t, acc[t]);
}

#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
void tiles_mxfp4(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_mxfp4x16, act_q8_0s>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_mxfp4x16_rows<T>(n, tw, x, o); });
}
void tiles_iq4_xs(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_iq4_xs16, act_q8_k>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_iq4_xs16_rows<T>(n, tw, x, o); });
}
void tiles_q8_0(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_q8_0x16, act_q8_0>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_q8_0x16_rows<T>(n, tw, x, o); });
}
#endif

// offsets += d * 32 * [scales . bsums] in eight lanes (the -32 of every Q6_K value), reduced once a row
inline __m256 q6_offsets_acc(__m256 offsets, float d, __m256i sc_all, const int16_t* bsums) {
    const __m256i prod = _mm256_madd_epi16(sc_all, _mm256_loadu_si256((const __m256i*)bsums));
    return _mm256_fmadd_ps(_mm256_set1_ps(d * 32), _mm256_cvtepi32_ps(prod), offsets);
}

// The 6-bit values of one half (128 values) of a Q6_K block as bytes: qA = its values 0..63, qB =
// 64..127. Bits 2k, 2k+1 of qh byte l are the high bits of value l + 32k; one shift in 16-bit
// lanes moves each pair to bits 4, 5 (what crosses into the neighbouring byte is masked off).
inline void q6_values(const block_q6_k& blk, int half, __m512i& qA, __m512i& qB) {
    const __m512i low = _mm512_set1_epi8(0xF), bits45 = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);    // h << 4, h << 2
    const __m512i down = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);  // h, h >> 2
    const __m512i l = _mm512_loadu_si512((const void*)(blk.ql + 64 * half));
    const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk.qh + 32 * half)));
    qA = _mm512_or_si512(_mm512_and_si512(l, low), _mm512_and_si512(_mm512_sllv_epi16(h, up), bits45));
    qB = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low), _mm512_and_si512(_mm512_srlv_epi16(h, down), bits45));
}

// Q6_K against T activation rows, as dot_k4_rows: unpacked once, the same float steps per row
template <int T>
void dot_q6_k_rows(int n, const block_q6_k* w, const act_q8_k* const* a, float* out) {
    __m512 acc[T];
    __m256 offsets[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps(), offsets[t] = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) {
        const float dw = fp16_to_f32(w[b].d);
        const __m256i sc_all = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w[b].scales));
        __m512i sumi[T];
        for (int t = 0; t < T; t++) sumi[t] = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            __m512i qA, qB;
            q6_values(w[b], half, qA, qB);
            const __m128i sc = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(w[b].scales + 8 * half)));
            const __m512i sA = pick16(sc, 0, 1, 2, 3), sB = pick16(sc, 4, 5, 6, 7);
            for (int t = 0; t < T; t++) {
                const int8_t* x = a[t][b].qs + 128 * half;
                sumi[t] = madd_acc(sumi[t], _mm512_maddubs_epi16(qA, _mm512_loadu_si512((const void*)x)), sA);
                sumi[t] = madd_acc(sumi[t], _mm512_maddubs_epi16(qB, _mm512_loadu_si512((const void*)(x + 64))), sB);
            }
        }
        for (int t = 0; t < T; t++) {
            const float d = dw * a[t][b].d;
            offsets[t] = q6_offsets_acc(offsets[t], d, sc_all, a[t][b].bsums);
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) out[t] = hsum512_f32(acc[t]) - hsum_f32(offsets[t]);
}
void dot4_q6_k(int n, const void* vw, const void* const va[4], float out[4]) {
    dot_q6_k_rows<4>(n, (const block_q6_k*)vw, (const act_q8_k* const*)va, out);
}
float dot_q6_k_avx512(int n, const block_q6_k* w, const act_q8_k* a) {
    float out;
    dot_q6_k_rows<1>(n, w, &a, &out);
    return out;
}

// ---- IQ4_XS, 512 bits: two sub-blocks (64 values) a step --------------------------------------
// the 8 six-bit scales of a block, minus 32, as floats: sub-block j's low 4 bits are nibble j of
// scales_l (low nibble first), its high 2 bits bits 2j, 2j+1 of scales_h
inline __m256 iq4_scales(const block_iq4_xs& blk) {
    uint32_t l;
    std::memcpy(&l, blk.scales_l, 4);
    const __m128i lv = _mm_cvtsi32_si128((int)l), nibble = _mm_set1_epi8(0xF);
    const __m128i low = _mm_unpacklo_epi8(_mm_and_si128(lv, nibble), _mm_and_si128(_mm_srli_epi16(lv, 4), nibble));
    const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(blk.scales_h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                          _mm256_set1_epi32(3));
    const __m256i ls = _mm256_or_si256(_mm256_cvtepu8_epi32(low), _mm256_slli_epi32(high, 4));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)));
}
// [s[2p] x 8, s[2p+1] x 8]: the scales of the two sub-blocks of a 512-bit step
inline __m512 iq4_pair_scales(__m256 s, int p) {
    const __m512i at = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
    return _mm512_permutexvar_ps(at, _mm512_castps256_ps512(s));
}
// the values of sub-blocks 2p and 2p+1 as signed bytes, in order: each sub-block's 16 bytes hold
// its values 0..15 (low nibbles) and 16..31 (high), looked up in the non-linear table
inline __m512i iq4_values(const block_iq4_xs& blk, int p, __m512i lut) {
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk.qs + 32 * p)));  // A B A B
    const __m512i spread = _mm512_shuffle_i32x4(both, both, _MM_SHUFFLE(1, 1, 0, 0));                      // A A B B
    const __m256i sh = _mm256_set_m128i(_mm_set1_epi16(4), _mm_setzero_si128());
    const __m512i idx = _mm512_and_si512(_mm512_srlv_epi16(spread, _mm512_inserti64x4(_mm512_castsi256_si512(sh), sh, 1)),
                                         _mm512_set1_epi8(0xF));
    return _mm512_shuffle_epi8(lut, idx);
}
// sum of products of signed bytes v and x as 16 int32 lanes, v given as |v| and its negative lanes
inline __m512i dot_signed64(__m512i mag, __mmask64 neg, __m512i x) {
    const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), mag, xs);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(mag, xs), _mm512_set1_epi16(1));
#endif
}

// IQ4_XS against T activation rows: the values, their magnitudes and signs unpacked once, the
// same float steps per row whatever T
template <int T>
void dot_iq4_xs_rows(int n, const block_iq4_xs* w, const act_q8_k* const* a, float* out) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kIQ4NL));
    __m512 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) {
        const __m256 s = iq4_scales(w[b]);
        __m512 sum[T];
        for (int t = 0; t < T; t++) sum[t] = _mm512_setzero_ps();
        for (int p = 0; p < 4; p++) {
            const __m512i v = iq4_values(w[b], p, lut);
            const __m512i mag = _mm512_abs_epi8(v);
            const __mmask64 neg = _mm512_movepi8_mask(v);
            const __m512 sc = iq4_pair_scales(s, p);
            for (int t = 0; t < T; t++) {
                const __m512i prod = dot_signed64(mag, neg, _mm512_loadu_si512(a[t][b].qs + 64 * p));
                sum[t] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(prod), sum[t]);
            }
        }
        const float dw = fp16_to_f32(w[b].d);
        for (int t = 0; t < T; t++) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(dw * a[t][b].d), sum[t], acc[t]);
    }
    for (int t = 0; t < T; t++) out[t] = hsum512_f32(acc[t]);
}
float dot_iq4_xs_avx512(int n, const block_iq4_xs* w, const act_q8_k* a) {
    float out;
    dot_iq4_xs_rows<1>(n, w, &a, &out);
    return out;
}
void dot4_iq4_xs(int n, const void* vw, const void* const va[4], float out[4]) {
    dot_iq4_xs_rows<4>(n, (const block_iq4_xs*)vw, (const act_q8_k* const*)va, out);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512BW__)
// ---- 16-row tiles at 256 bits (AVX2) ----------------------------------------------------------
// The same tiles as the AVX512-VNNI kernels, eight rows (half of a tile's 64-byte step) a
// register, a tile's two halves one after the other (its lines stay in L1 between them).
// Without dpbusd, a step's bytes against the token's four go through maddubs (int16 sums of
// pairs), which the steps of one sub-block add in int16 before one madd by the rows' scales:
// what a row-at-a-time kernel spends on its scales and horizontal sums, once for eight rows.

// 8 rows' scale byte k of S (a byte a sub-block in each row's 32-bit lane), one shuffle: as the
// lane's int32 with AVX-VNNI (mullo against dpbusd's sums), else in both 16-bit halves of the
// lane (madd against maddubs' int16 pair sums)
inline __m256i k4_tile_scale(__m256i S, int k) {
    const char z = (char)0x80;
#if defined(__AVXVNNI__)
    const __m256i pick = _mm256_setr_epi8(0, z, z, z, 4, z, z, z, 8, z, z, z, 12, z, z, z, 0, z, z, z, 4, z, z, z, 8, z, z, z, 12, z, z, z);
#else
    const __m256i pick = _mm256_setr_epi8(0, z, 0, z, 4, z, 4, z, 8, z, 8, z, 12, z, 12, z, 0, z, 0, z, 4, z, 4, z, 8, z, 8, z, 12, z, 12, z);
#endif
    return _mm256_shuffle_epi8(S, _mm256_add_epi8(pick, _mm256_set1_epi16((short)k)));  // (z + k: still zeroes)
}
inline __m256i bcast4(const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

// Q4_K tiles, and Q5_K (a fifth bit from qh), against T activation rows (Q8_KT). maddubs of
// 15 * 127 * 2 at most: a sub-block's 8 add up below 2^15 in int16 (Q5_K's 31 * 127 * 2: 4 do),
// for int8 activations in [-127, 127] as prep_q8_kt makes them.
template <typename Tile, int T>
void tile_k4_rows(int n, const Tile* w, const act_q8_k* const* a, float* out) {
    constexpr bool five = std::is_same<Tile, tile_q5_k16>::value;
    constexpr int steps_int16 = five ? 2 : 4;  // steps (two maddubs each) summed in int16 before a madd
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const __m256i pair6 = _mm256_set1_epi32(0x003F003F), pair4 = _mm256_set1_epi32(0x000F000F);
    __m256 acc[T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++, w++) {
        // (unrolled: each step's prefetched lines and scale pick become constants, not arithmetic on
        // the ports the step's vector work needs)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {  // rows 8h .. 8h + 7
            const __m256i P0 = _mm256_loadu_si256((const __m256i*)(w->sc[0] + 8 * h));
            const __m256i P1 = _mm256_loadu_si256((const __m256i*)(w->sc[1] + 8 * h));
            const __m256i P2 = _mm256_loadu_si256((const __m256i*)(w->sc[2] + 8 * h));
            // the 6-bit scales of sub-blocks 0..3 (S03) and 4..7 (S47) as bytes of each row's lane
            const __m256i S03 = _mm256_and_si256(P0, _mm256_set1_epi8(0x3F));
            const __m256i S47 = _mm256_or_si256(_mm256_and_si256(P2, low4), _mm256_and_si256(_mm256_srli_epi32(P0, 2), _mm256_set1_epi8(0x30)));
            __m256i sumi[T];
            for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                prefetch_ahead(w, 8 * h + j, 16);  // spread over both halves: a steady stream of requests
                const __m256i sc = k4_tile_scale(j < 4 ? S03 : S47, j % 4);
                __m256i qh = _mm256_setzero_si256();
                if constexpr (five) qh = _mm256_loadu_si256((const __m256i*)(w->part[j].qh + 32 * h));
                __m256i p[T];
#if defined(__AVXVNNI__)
                __m256i p2[T];
#endif
                for (int q = 0; q < 4; q++) {
                    __m256i v;
                    if constexpr (five) v = _mm256_loadu_si256((const __m256i*)(w->part[j].qs[q] + 32 * h));
                    else v = _mm256_loadu_si256((const __m256i*)(w->qs[4 * j + q] + 32 * h));
                    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    if constexpr (five) {  // bit q of qh -> bit 4 of the low value, bit 4 + q -> of the high one
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4 - q), bit4));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(q ? _mm256_srli_epi16(qh, q) : qh, bit4));
                    }
                    for (int t = 0; t < T; t++) {
                        const int8_t* x = a[t][b].qs + 32 * j + 4 * q;
#if defined(__AVXVNNI__)  // two int32 chains a token, no int16 limit: one mullo by the scales a sub-block
                        p[t] = _mm256_dpbusd_avx_epi32(q ? p[t] : _mm256_setzero_si256(), lo, bcast4(x));
                        p2[t] = _mm256_dpbusd_avx_epi32(q ? p2[t] : _mm256_setzero_si256(), hi, bcast4(x + 16));
#else
                        const __m256i s2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x)), _mm256_maddubs_epi16(hi, bcast4(x + 16)));
                        p[t] = q % steps_int16 ? _mm256_add_epi16(p[t], s2) : s2;
                        if (q % steps_int16 == steps_int16 - 1) sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p[t], sc));
#endif
                    }
                }
#if defined(__AVXVNNI__)
                for (int t = 0; t < T; t++) sumi[t] = _mm256_add_epi32(sumi[t], _mm256_mullo_epi32(_mm256_add_epi32(p[t], p2[t]), sc));
#endif
            }
            // mins as int16 pairs per row: (m0, m2), (m1, m3), (m4, m6), (m5, m7), against Q8_KT's bsums pairs
            const __m256i m02 = _mm256_and_si256(P1, pair6), m13 = _mm256_and_si256(_mm256_srli_epi32(P1, 8), pair6);
            const __m256i m46 = _mm256_and_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(P2, 4), pair4),
                                                                 _mm256_andnot_si256(pair4, _mm256_srli_epi32(P1, 2))), pair6);
            const __m256i m57 = _mm256_and_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(P2, 12), pair4),
                                                                 _mm256_andnot_si256(pair4, _mm256_srli_epi32(P1, 10))), pair6);
            const __m256 d_rows = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w->d + 8 * h)));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w->dmin + 8 * h)));
            for (int t = 0; t < T; t++) {
                int32_t pr[4];
                std::memcpy(pr, a[t][b].bsums, 16);
                const __m256i ms = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(m02, _mm256_set1_epi32(pr[0])), _mm256_madd_epi16(m13, _mm256_set1_epi32(pr[1]))),
                                                    _mm256_add_epi32(_mm256_madd_epi16(m46, _mm256_set1_epi32(pr[2])), _mm256_madd_epi16(m57, _mm256_set1_epi32(pr[3]))));
                const __m256 ad = _mm256_set1_ps(a[t][b].d);
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(d_rows, ad), _mm256_cvtepi32_ps(sumi[t]), acc[t][h]);
                acc[t][h] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, ad), _mm256_cvtepi32_ps(ms), acc[t][h]);
            }
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + 16 * t, acc[t][0]), _mm256_storeu_ps(out + 16 * t + 8, acc[t][1]);
}

// Q6_K tiles against T activation rows (Q8_K): values 0..63 (the -32s as 32 * scales . bsums),
// so two maddubs of 63 * 127 * 2 at most add in int16 before each madd by the scales (32,004 of
// 32,767: no more than two, and only against int8 activations in [-127, 127], as prep_q8_k makes).
template <int T>
void tile_q6_k16_rows(int n, const tile_q6_k16* w, const act_q8_k* const* a, float* out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
#if !defined(__AVXVNNI__)
    // int16 lanes (sc[2j], sc[2j + 1]) of a row -> the first (second) in both halves of its lane
    const __m256i dup_lo = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i dup_hi = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
#endif
    __m256 acc[T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++, w++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {  // rows 8h .. 8h + 7
            __m256i sumi[T];
            for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                prefetch_ahead(w, 8 * h + j, 16);
                const auto& part = w->part[j / 2];
                const auto& half = part.half[j % 2];
                const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)part.sc[j % 2][8 * h]));
#if defined(__AVXVNNI__)  // each half's int32 dpbusd chain over the four steps, times its scale by one mullo
                const __m256i s_lo = _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16), s_hi = _mm256_srai_epi32(pair, 16);
#else
                const __m256i s_lo = _mm256_shuffle_epi8(pair, dup_lo), s_hi = _mm256_shuffle_epi8(pair, dup_hi);
#endif
                __m256i plo[T], phi[T];
                for (int t = 0; t < T; t++) plo[t] = phi[t] = _mm256_setzero_si256();
                for (int hh = 0; hh < 2; hh++) {
                    const __m256i H = _mm256_loadu_si256((const __m256i*)(half.qh[hh] + 32 * h));
                    for (int qq = 0; qq < 2; qq++) {
                        const int q = 2 * hh + qq;
                        const __m256i v = _mm256_loadu_si256((const __m256i*)(half.ql[q] + 32 * h));
                        const __m256i hl = qq ? H : _mm256_slli_epi16(H, 4), hh2 = qq ? _mm256_srli_epi16(H, 2) : _mm256_slli_epi16(H, 2);
                        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(hl, bits45));
                        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_and_si256(hh2, bits45));
                        for (int t = 0; t < T; t++) {
                            const int8_t* x = a[t][b].qs + 32 * j + 4 * q;
#if defined(__AVXVNNI__)
                            plo[t] = _mm256_dpbusd_avx_epi32(plo[t], lo, bcast4(x));
                            phi[t] = _mm256_dpbusd_avx_epi32(phi[t], hi, bcast4(x + 16));
#else
                            plo[t] = _mm256_add_epi16(plo[t], _mm256_maddubs_epi16(lo, bcast4(x)));
                            phi[t] = _mm256_add_epi16(phi[t], _mm256_maddubs_epi16(hi, bcast4(x + 16)));
#endif
                        }
                    }
#if !defined(__AVXVNNI__)  // (int16 holds two steps: each half's sums go out, and start again)
                    for (int t = 0; t < T; t++) {
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_madd_epi16(plo[t], s_lo), _mm256_madd_epi16(phi[t], s_hi)));
                        plo[t] = phi[t] = _mm256_setzero_si256();
                    }
#endif
                }
#if defined(__AVXVNNI__)
                for (int t = 0; t < T; t++)
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_mullo_epi32(plo[t], s_lo), _mm256_mullo_epi32(phi[t], s_hi)));
#endif
                for (int t = 0; t < T; t++) {  // minus 32 * (sc[2j] * bsums[2j] + sc[2j + 1] * bsums[2j + 1])
                    int32_t bs;
                    std::memcpy(&bs, a[t][b].bsums + 2 * j, 4);
                    sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(_mm256_madd_epi16(pair, _mm256_set1_epi32(bs)), 5));
                }
            }
            const __m256 d_rows = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w->d + 8 * h)));
            for (int t = 0; t < T; t++)
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(d_rows, _mm256_set1_ps(a[t][b].d)), _mm256_cvtepi32_ps(sumi[t]), acc[t][h]);
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + 16 * t, acc[t][0]), _mm256_storeu_ps(out + 16 * t + 8, acc[t][1]);
}


// ---- 256 bits: K-quant rows against T activation rows -----------------------------------------
// The AVX2 level's counterparts of the 512-bit row kernels: each weight block is unpacked once for
// T tokens (prefill: four a call), with the same float steps per row whatever T, so one token alone
// gives what it gives among four, to the bit. Activations in the natural Q8_K order.

// Q4_K, and Q5_K (the fifth bit of value l of sub-block j: bit j of qh[l]).
template <typename Block, int T>
void dot_k4_rows256(int n, const Block* w, const act_q8_k* const* a, float* out) {
    constexpr bool five_bits = std::is_same<Block, block_q5_k>::value;
    const __m256i low = _mm256_set1_epi8(0xF), sixteen = _mm256_set1_epi8(16);
    __m256 acc[T];
    float mins[T];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps(), mins[t] = 0;
    for (int b = 0; b < n / QK_K; b++) {
        const __m128i sm = k4_scales_vec(w[b].scales);
        // scales as 16-bit lanes, broadcast per sub-block pair via shuffles
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        __m256i hbits = _mm256_setzero_si256();
        if constexpr (five_bits) hbits = _mm256_loadu_si256((const __m256i*)w[b].qh);
        __m256i sumi[T];
        for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {  // 32 bytes: sub-block 2c (low nibbles), 2c + 1 (high)
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(w[b].qs + 32 * c));
            __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            if constexpr (five_bits) {
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * c))), b1 = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, b0), b0), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, b1), b1), sixteen));
            }
            const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(((4 * c + 1) << 8) | (4 * c))));
            const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(((4 * c + 3) << 8) | (4 * c + 2))));
            for (int t = 0; t < T; t++) {
                const int8_t* x = a[t][b].qs + 64 * c;
                const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)x));
                const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(x + 32)));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)));
            }
        }
        const float dw = fp16_to_f32(w[b].d), dmin = fp16_to_f32(w[b].dmin);
        for (int t = 0; t < T; t++) {
            mins[t] += a[t][b].d * dmin * k4_mins_dot(sm, a[t][b].bsums);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(a[t][b].d * dw), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) out[t] = hsum_f32(acc[t]) - mins[t];
}
void dot4_q4_k(int n, const void* vw, const void* const va[4], float out[4]) {
    dot_k4_rows256<block_q4_k, 4>(n, (const block_q4_k*)vw, (const act_q8_k* const*)va, out);
}
void dot4_q5_k(int n, const void* vw, const void* const va[4], float out[4]) {
    dot_k4_rows256<block_q5_k, 4>(n, (const block_q5_k*)vw, (const act_q8_k* const*)va, out);
}

// Q6_K: value = d * scales[g] * (q - 32); the -32 of every value as 32 * (scales . bsums).
template <int T>
void dot_q6_k_rows256(int n, const block_q6_k* w, const act_q8_k* const* a, float* out) {
    const __m256i low = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
    // for quarter k of a half: 16-bit scale index 2k in the low 128 bits, 2k+1 in the high ones
    const __m256i pick[4] = {
        _mm256_set_m128i(_mm_set1_epi16(0x0302), _mm_set1_epi16(0x0100)),
        _mm256_set_m128i(_mm_set1_epi16(0x0706), _mm_set1_epi16(0x0504)),
        _mm256_set_m128i(_mm_set1_epi16(0x0b0a), _mm_set1_epi16(0x0908)),
        _mm256_set_m128i(_mm_set1_epi16(0x0f0e), _mm_set1_epi16(0x0d0c)),
    };
    __m256 acc[T];
    float offsets[T];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps(), offsets[t] = 0;
    for (int b = 0; b < n / QK_K; b++) {
        const float dw = fp16_to_f32(w[b].d);
        const __m256i sc_all = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w[b].scales));
        const uint8_t* ql = w[b].ql;
        const uint8_t* qh = w[b].qh;
        __m256i sumi[T];
        for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++, ql += 64, qh += 32) {
            const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(w[b].scales + 8 * half))));
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)ql), l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i*)qh);
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(h, three), 4)),
                _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4)),
            };
            for (int k = 0; k < 4; k++) {
                const __m256i s = _mm256_shuffle_epi8(sc, pick[k]);
                for (int t = 0; t < T; t++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i*)(a[t][b].qs + 128 * half + 32 * k));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], x), s));
                }
            }
        }
        for (int t = 0; t < T; t++) {
            const float d = dw * a[t][b].d;
            offsets[t] += d * 32 * hsum_i32(_mm256_madd_epi16(sc_all, _mm256_loadu_si256((const __m256i*)a[t][b].bsums)));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) out[t] = hsum_f32(acc[t]) - offsets[t];
}
void dot4_q6_k(int n, const void* vw, const void* const va[4], float out[4]) {
    dot_q6_k_rows256<4>(n, (const block_q6_k*)vw, (const act_q8_k* const*)va, out);
}

// IQ4_XS: nibbles through the IQ4_NL table; |value| against the token's bytes with the value's
// sign (maddubs needs one unsigned side), times the sub-block's scale - 32 as int16 pairs.
template <int T>
void dot_iq4_xs_rows256(int n, const block_iq4_xs* w, const act_q8_k* const* a, float* out) {
    const __m128i table = _mm_loadu_si128((const __m128i*)kIQ4NL);
    const __m256i lut = _mm256_set_m128i(table, table), low = _mm256_set1_epi8(0xF);
    __m256 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) {
        __m256i sumi[T];
        for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((w[b].scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((w[b].scales_h >> (2 * ib)) & 3) << 4);
            const __m128i raw = _mm_loadu_si128((const __m128i*)(w[b].qs + 16 * ib));
            const __m256i v = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low));
            const __m256i mag = _mm256_sign_epi8(v, v), s = _mm256_set1_epi16((short)(ls - 32));
            for (int t = 0; t < T; t++) {
                const __m256i x = _mm256_loadu_si256((const __m256i*)(a[t][b].qs + 32 * ib));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, v)), s));
            }
        }
        const float dw = fp16_to_f32(w[b].d);
        for (int t = 0; t < T; t++) acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[t][b].d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
    }
    for (int t = 0; t < T; t++) out[t] = hsum_f32(acc[t]);
}
void dot4_iq4_xs(int n, const void* vw, const void* const va[4], float out[4]) {
    dot_iq4_xs_rows256<4>(n, (const block_iq4_xs*)vw, (const act_q8_k* const*)va, out);
}

// Q8_0 tiles against T activation rows: each step's two halves (rows 0..7, 8..15) against the
// token's four bytes broadcast, int32 a 32-value block, scaled per block and row. With AVX-VNNI
// the tokens come unsigned (Q8_0U, x + 128) as the unsigned side of one VEX dpbusd each, and
// the rows' 128 * (sum of weights) comes off once a block for all tokens; with AVX2 they come
// signed (Q8_0) through dot_s8.
template <int T>
void tile_q8_0x16_rows256(int n, const tile_q8_0x16* w, const act_q8_0* const* a, float* out) {
    __m256 acc[T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < n / 64; b++, w++) {
        prefetch_ahead(w, 0, 1);
        for (int h = 0; h < 2; h++) {
            const int blk = 2 * b + h;
            __m256i dot[T][2];
            for (int t = 0; t < T; t++) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
#if defined(__AVXVNNI__)
            const __m256i ones = _mm256_set1_epi8(1);
            __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#endif
            for (int q = 0; q < 8; q++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i*)w->qs[h][q]);
                const __m256i v1 = _mm256_loadu_si256((const __m256i*)(w->qs[h][q] + 32));
#if defined(__AVXVNNI__)
                sum[0] = _mm256_dpbusd_avx_epi32(sum[0], ones, v0);
                sum[1] = _mm256_dpbusd_avx_epi32(sum[1], ones, v1);
#endif
                for (int t = 0; t < T; t++) {
                    const __m256i x = bcast4(a[t][blk].qs + 4 * q);
#if defined(__AVXVNNI__)
                    dot[t][0] = _mm256_dpbusd_avx_epi32(dot[t][0], x, v0);
                    dot[t][1] = _mm256_dpbusd_avx_epi32(dot[t][1], x, v1);
#else
                    dot[t][0] = _mm256_add_epi32(dot[t][0], dot_s8(v0, x));
                    dot[t][1] = _mm256_add_epi32(dot[t][1], dot_s8(v1, x));
#endif
                }
            }
#if defined(__AVXVNNI__)
            for (int t = 0; t < T; t++)
                for (int r = 0; r < 2; r++) dot[t][r] = _mm256_sub_epi32(dot[t][r], _mm256_slli_epi32(sum[r], 7));
#endif
            for (int r = 0; r < 2; r++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w->d[h] + 8 * r)));
                for (int t = 0; t < T; t++)
                    acc[t][r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[t][blk].d)), _mm256_cvtepi32_ps(dot[t][r]), acc[t][r]);
            }
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + 16 * t, acc[t][0]), _mm256_storeu_ps(out + 16 * t + 8, acc[t][1]);
}

// The 2^(e - 128) scales (e8m0_half) of 8 rows' e8m0 bytes: (e - 1) << 23 as float bits, and
// the subnormals 2^21 << e below e = 2.
inline __m256 e8m0_half8(const uint8_t* e8) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)e8));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
// lo += u0 . x0 and hi += u1 . x1 by 4-byte groups (u unsigned, at most 24; x signed): two VEX
// dpbusd chains at the avxvnni level; with AVX2 both into lo, the two maddubs' int16 pair sums
// (|each| <= 2 * 24 * 128) added before one madd, which they cannot overflow.
inline void dot_u24_pair(__m256i& lo, __m256i& hi, __m256i u0, __m256i x0, __m256i u1, __m256i x1) {
#if defined(__AVXVNNI__)
    lo = _mm256_dpbusd_avx_epi32(lo, u0, x0);
    hi = _mm256_dpbusd_avx_epi32(hi, u1, x1);
#else
    (void)hi;
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, x0), _mm256_maddubs_epi16(u1, x1));
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// MXFP4 tiles against T activation rows (Q8_0S): the nibbles through the doubled e2m1 table plus
// 12 (unsigned bytes 0..24: the unsigned side of maddubs/dpbusd without sign ops), low nibbles
// against the block's values 4q.., high ones against 16 + 4q..; the +12 taken back as 12 * (the
// block's sum of the token's values); scaled per block and row by 2^(e - 128).
template <int T>
void tile_mxfp4x16_rows256(int n, const tile_mxfp4x16* w, const act_q8_0s* const* a, float* out) {
    const __m128i table = _mm_loadu_si128((const __m128i*)kMxfp4Plus12);
    const __m256i lut = _mm256_set_m128i(table, table), low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < n / QK; b++, w++) {
        prefetch_ahead(w, 0, 1);
        const __m256 d[2] = {e8m0_half8(w->e), e8m0_half8(w->e + 8)};
        __m256i dlo[T][2], dhi[T][2];
        for (int t = 0; t < T; t++)
            for (int r = 0; r < 2; r++) dlo[t][r] = _mm256_set1_epi32(-12 * a[t][b].sum), dhi[t][r] = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {
            __m256i lo[2], hi[2];
            for (int r = 0; r < 2; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(w->qs[q] + 32 * r));
                lo[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
                hi[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
            }
            for (int t = 0; t < T; t++) {
                const __m256i xl = bcast4(a[t][b].qs + 4 * q), xh = bcast4(a[t][b].qs + 16 + 4 * q);
                for (int r = 0; r < 2; r++) dot_u24_pair(dlo[t][r], dhi[t][r], lo[r], xl, hi[r], xh);
            }
        }
        for (int r = 0; r < 2; r++)
            for (int t = 0; t < T; t++)
                acc[t][r] = _mm256_fmadd_ps(_mm256_mul_ps(d[r], _mm256_set1_ps(a[t][b].d)),
                                            _mm256_cvtepi32_ps(_mm256_add_epi32(dlo[t][r], dhi[t][r])), acc[t][r]);
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + 16 * t, acc[t][0]), _mm256_storeu_ps(out + 16 * t + 8, acc[t][1]);
}

// IQ4_XS tiles against T activation rows (Q8_K, signed): the nibbles through the IQ4_NL table;
// a sub-block's four steps (low nibbles against its values 4q.., high ones against 16 + 4q..) in
// int32, times each row's 6-bit scale - 32; the block's sum scaled by d per row. With AVX-VNNI
// the table comes shifted by +128 as the unsigned side of VEX dpbusd (no sign ops), the shift
// taken back as 128 * (the sub-block's sum of the token's values, from its two 16-sums).
template <int T>
void tile_iq4_xs16_rows256(int n, const tile_iq4_xs16* w, const act_q8_k* const* a, float* out) {
#if defined(__AVXVNNI__)
    const __m128i table = _mm_add_epi8(_mm_loadu_si128((const __m128i*)kIQ4NL), _mm_set1_epi8((char)128));
#else
    const __m128i table = _mm_loadu_si128((const __m128i*)kIQ4NL);
#endif
    const __m256i lut = _mm256_set_m128i(table, table), low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[T][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++, w++) {
        prefetch_ahead(w, 0, 1);
        for (int r = 0; r < 2; r++) {  // rows 8r .. 8r + 7
            const __m256i L = _mm256_loadu_si256((const __m256i*)(w->sl + 8 * r));
            const __m256i H = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w->sh + 8 * r)));
            __m256i sumi[T];
            for (int t = 0; t < T; t++) sumi[t] = _mm256_setzero_si256();
            for (int ib = 0; ib < 8; ib++) {
                const __m256i sc = _mm256_sub_epi32(
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(L, 4 * ib), _mm256_set1_epi32(0x0F)),
                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(H, 2 * ib), _mm256_set1_epi32(3)), 4)),
                    _mm256_set1_epi32(32));
                __m256i dot[T], dhi[T];
                for (int t = 0; t < T; t++) {
#if defined(__AVXVNNI__)
                    dot[t] = _mm256_set1_epi32(-128 * (a[t][b].bsums[2 * ib] + a[t][b].bsums[2 * ib + 1]));
#else
                    dot[t] = _mm256_setzero_si256();
#endif
                    dhi[t] = _mm256_setzero_si256();
                }
                for (int q = 0; q < 4; q++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(w->qs[4 * ib + q] + 32 * r));
                    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
                    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
                    for (int t = 0; t < T; t++) {
                        const __m256i xl = bcast4(a[t][b].qs + 32 * ib + 4 * q), xh = bcast4(a[t][b].qs + 32 * ib + 16 + 4 * q);
#if defined(__AVXVNNI__)
                        dot[t] = _mm256_dpbusd_avx_epi32(dot[t], lo, xl);
                        dhi[t] = _mm256_dpbusd_avx_epi32(dhi[t], hi, xh);
#else
                        dot[t] = _mm256_add_epi32(dot[t], _mm256_add_epi32(dot_s8(lo, xl), dot_s8(hi, xh)));
#endif
                    }
                }
                for (int t = 0; t < T; t++) sumi[t] = _mm256_add_epi32(sumi[t], _mm256_mullo_epi32(_mm256_add_epi32(dot[t], dhi[t]), sc));
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w->d + 8 * r)));
            for (int t = 0; t < T; t++)
                acc[t][r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[t][b].d)), _mm256_cvtepi32_ps(sumi[t]), acc[t][r]);
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + 16 * t, acc[t][0]), _mm256_storeu_ps(out + 16 * t + 8, acc[t][1]);
}

void tiles_q8_0(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_q8_0x16, act_q8_0>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_q8_0x16_rows256<T>(n, tw, x, o); });
}
void tiles_mxfp4(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_mxfp4x16, act_q8_0s>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_mxfp4x16_rows256<T>(n, tw, x, o); });
}
void tiles_iq4_xs(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_iq4_xs16, act_q8_k>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_iq4_xs16_rows256<T>(n, tw, x, o); });
}
#endif

#if defined(__AVX512VNNI__) || (defined(__AVX2__) && !defined(__AVX512BW__))
// the K-quants' tiles, at either level (tile_k4_rows, tile_q6_k16_rows: 512 or 256 bits)
void tiles_q4_k(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_q4_k16, act_q8_k>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_k4_rows<tile_q4_k16, T>(n, tw, x, o); });
}
void tiles_q5_k(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_q5_k16, act_q8_k>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_k4_rows<tile_q5_k16, T>(n, tw, x, o); });
}
void tiles_q6_k(int n, const void* w, const void* const* a, int count, float* out) {
    tile_tokens<tile_q6_k16, act_q8_k>(n, w, a, count, out, [](auto T, int n, auto tw, auto x, float* o) { tile_q6_k16_rows<T>(n, tw, x, o); });
}
#endif

// ---- Q4_K, Q5_K x Q8_K --------------------------------------------------------------------
// value = d * sc_j * q - dmin * m_j for sub-block j (32 values); q in 0..15 (Q4_K), or 0..31 with
// the fifth bit from qh (Q5_K: bit j of qh[l] for value l of sub-block j).
template <typename Block>
float dot_k4(int n, const Block* w, const act_q8_k* a) {
    [[maybe_unused]] constexpr bool five_bits = std::is_same<Block, block_q5_k>::value;
#if defined(__AVX512BW__)
    return dot_k4_avx512(n, w, a);
#elif defined(__AVX2__)
    float out;
    dot_k4_rows256<Block, 1>(n, w, &a, &out);
    return out;
#else
    float sum = 0;
    for (int b = 0; b < n / QK_K; b++) {
        int sc[8], m[8];
        for (int j = 0; j < 8; j++) scale_min_k4(j, w[b].scales, &sc[j], &m[j]);
        int summ = 0;
        for (int j = 0; j < 8; j++) summ += m[j] * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
        const uint8_t* q = w[b].qs;
        const int8_t* x = a[b].qs;
        int sumi = 0;
        for (int c = 0; c < 4; c++, q += 32, x += 64) {
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                int h0 = 0, h1 = 0;
                if constexpr (five_bits) h0 = ((w[b].qh[l] >> (2 * c)) & 1) * 16, h1 = ((w[b].qh[l] >> (2 * c + 1)) & 1) * 16;
                s0 += ((q[l] & 0xF) + h0) * x[l];
                s1 += ((q[l] >> 4) + h1) * x[l + 32];
            }
            sumi += sc[2 * c] * s0 + sc[2 * c + 1] * s1;
        }
        sum += a[b].d * (fp16_to_f32(w[b].d) * sumi - fp16_to_f32(w[b].dmin) * summ);
    }
    return sum;
#endif
}

float dot_q4_k(int n, const void* w, const void* a) { return dot_k4(n, (const block_q4_k*)w, (const act_q8_k*)a); }
float dot_q5_k(int n, const void* w, const void* a) { return dot_k4(n, (const block_q5_k*)w, (const act_q8_k*)a); }

// ---- Q6_K x Q8_K -------------------------------------------------------------------------
// value = d * scales[g] * (q - 32), q in 0..63 from 4 low bits (ql) and 2 high bits (qh).
float dot_q6_k(int n, const void* vw, const void* va) {
    const block_q6_k* w = (const block_q6_k*)vw;
    const act_q8_k* a = (const act_q8_k*)va;
#if defined(__AVX512BW__)
    return dot_q6_k_avx512(n, w, a);
#elif defined(__AVX2__)
    float out;
    dot_q6_k_rows256<1>(n, w, &a, &out);
    return out;
#else
    float sum = 0;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t* ql = w[b].ql;
        const uint8_t* qh = w[b].qh;
        const int8_t* sc = w[b].scales;
        const int8_t* x = a[b].qs;
        int sumi = 0, offset = 0;
        for (int g = 0; g < 16; g++) offset += sc[g] * a[b].bsums[g];
        for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, x += 128) {
            for (int l = 0; l < 32; l++) {
                const int g = l / 16;
                const int q1 = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
                const int q2 = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                const int q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                const int q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                sumi += sc[g] * q1 * x[l] + sc[g + 2] * q2 * x[l + 32] + sc[g + 4] * q3 * x[l + 64] + sc[g + 6] * q4 * x[l + 96];
            }
        }
        sum += fp16_to_f32(w[b].d) * a[b].d * (sumi - 32 * offset);
    }
    return sum;
#endif
}

// ---- IQ4_XS x Q8_K -----------------------------------------------------------------------
float dot_iq4_xs(int n, const void* vw, const void* va) {
    const block_iq4_xs* w = (const block_iq4_xs*)vw;
    const act_q8_k* a = (const act_q8_k*)va;
#if defined(__AVX512BW__)
    return dot_iq4_xs_avx512(n, w, a);
#elif defined(__AVX2__)
    float out;
    dot_iq4_xs_rows256<1>(n, w, &a, &out);
    return out;
#else
    float sum = 0;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t* q = w[b].qs;
        const int8_t* x = a[b].qs;
        int sumi = 0;
        for (int ib = 0; ib < 8; ib++, q += 16, x += 32) {
            const int ls = ((w[b].scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((w[b].scales_h >> (2 * ib)) & 3) << 4);
            int s = 0;
            for (int j = 0; j < 16; j++) s += kIQ4NL[q[j] & 0xF] * x[j] + kIQ4NL[q[j] >> 4] * x[j + 16];
            sumi += (ls - 32) * s;
        }
        sum += fp16_to_f32(w[b].d) * a[b].d * sumi;
    }
    return sum;
#endif
}

// ---- 16-bit floats --------------------------------------------------------------------
// F16 weights take float32 activations; BF16 weights take bf16 ones (Act::BF16, as llama.cpp's
// BF16 rows and the AVX512-BF16 and AMX-BF16 instructions take them), so each product of a weight
// and an activation is exact in float32 and the paths differ only in the order their sums add.
// A kind says how a vector of 16 (AVX-512) or 8 (AVX2) weights, or of activations, and a single
// one become float32: types, not function pointers, so that the loads inline into dot_16bit.
struct BF16Kind {
    using type = bf16_t;
    using act = bf16_t;
#if defined(__AVX512F__)
    static __m512 load16(const bf16_t* w) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)w)), 16));
    }
    static __m512 load_x16(const bf16_t* x) { return load16(x); }
#endif
#if defined(__AVX2__)
    static __m256 load8(const bf16_t* w) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)w)), 16));
    }
    static __m256 load_x8(const bf16_t* x) { return load8(x); }
#endif
    static float one(bf16_t w) { return bf16_to_f32(w); }
    static float one_x(bf16_t x) { return bf16_to_f32(x); }
};
struct F16Kind {
    using type = fp16_t;
    using act = float;
#if defined(__AVX512F__)
    static __m512 load16(const fp16_t* w) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w)); }
    static __m512 load_x16(const float* x) { return _mm512_loadu_ps(x); }
#endif
#if defined(__AVX2__)
    static __m256 load8(const fp16_t* w) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w)); }
    static __m256 load_x8(const float* x) { return _mm256_loadu_ps(x); }
#endif
    static float one(fp16_t w) { return fp16_to_f32(w); }
    static float one_x(float x) { return x; }
};

// R rows of 16-bit float weights (row_elems apart) against T activation rows:
// out[t * R + r] = sum_i w[r][i] * x[t][i]. Each (row, token) pair has one accumulator of 16
// lanes (8 at the AVX2 level) over the same steps, then its horizontal sum, then the tail past
// the last whole vector in scalar: its result does not depend on R or T, so a token's output is
// the same to the bit alone or among others. A weight vector is converted once for all T tokens
// and an activation vector loaded once for all R rows; R x T (up to 16) chains hide the FMA latency.
template <int R, int T, typename Kind>
inline void dot_16bit(int n, const typename Kind::type* w, size_t row_elems, const typename Kind::act* const* x,
                      float* out) {
    int i = 0;
    float sum[R * T] = {};
#if defined(__AVX512F__)
    constexpr int kLanes = 16;
    using Vec = __m512;
    auto load_w = [](const typename Kind::type* p) { return Kind::load16(p); };
    auto load_x = [](const typename Kind::act* p) { return Kind::load_x16(p); };
    auto fma = [](Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); };
    auto hsum = [](Vec v) { return _mm512_reduce_add_ps(v); };
    const Vec zero = _mm512_setzero_ps();
#elif defined(__AVX2__)
    constexpr int kLanes = 8;
    using Vec = __m256;
    auto load_w = [](const typename Kind::type* p) { return Kind::load8(p); };
    auto load_x = [](const typename Kind::act* p) { return Kind::load_x8(p); };
    auto fma = [](Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); };
    auto hsum = [](Vec v) { return hsum_f32(v); };
    const Vec zero = _mm256_setzero_ps();
#endif
#if defined(__AVX2__)
    Vec acc[R * T];
    for (int k = 0; k < R * T; k++) acc[k] = zero;
    for (; i + kLanes <= n; i += kLanes) {
        Vec wv[R];
        for (int r = 0; r < R; r++) wv[r] = load_w(w + r * row_elems + i);
        for (int t = 0; t < T; t++) {
            const Vec xv = load_x(x[t] + i);
            for (int r = 0; r < R; r++) acc[t * R + r] = fma(wv[r], xv, acc[t * R + r]);
        }
    }
    for (int k = 0; k < R * T; k++) sum[k] = hsum(acc[k]);
#endif
    for (; i < n; i++)
        for (int r = 0; r < R; r++) {
            const float wi = Kind::one(w[r * row_elems + i]);
            for (int t = 0; t < T; t++) sum[t * R + r] += wi * Kind::one_x(x[t][i]);
        }
    for (int k = 0; k < R * T; k++) out[k] = sum[k];
}

#if defined(__AVX512BW__)
// BF16 rows with vdpbf16ps: 32 products an instruction, two to each float lane, the weights used
// as loaded (no widening). The avx512 build has no -mavx512bf16 (Ice Lake and Cascade Lake lack
// it), so the kernel alone is compiled for it and runs where the CPU says it has it. The same
// structure as dot_16bit: one accumulator per (row, token), masked loads for the tail, so the
// result does not depend on R or T either.
template <int R, int T>
__attribute__((target("avx512bf16,avx512f,avx512bw"))) void dot_bf16_dp(int n, const bf16_t* w, size_t row_elems,
                                                                        const bf16_t* const* x, float* out) {
    __m512 acc[R * T];
    for (int k = 0; k < R * T; k++) acc[k] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i wv[R];
        for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_si512((const void*)(w + r * row_elems + i));
        for (int t = 0; t < T; t++) {
            const __m512i xv = _mm512_loadu_si512((const void*)(x[t] + i));
            for (int r = 0; r < R; r++) acc[t * R + r] = _mm512_dpbf16_ps(acc[t * R + r], (__m512bh)wv[r], (__m512bh)xv);
        }
    }
    if (i < n) {  // the tail, zeros past the row's end
        const __mmask32 m = (__mmask32(1) << (n - i)) - 1;
        __m512i wv[R];
        for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_epi16(m, w + r * row_elems + i);
        for (int t = 0; t < T; t++) {
            const __m512i xv = _mm512_maskz_loadu_epi16(m, x[t] + i);
            for (int r = 0; r < R; r++) acc[t * R + r] = _mm512_dpbf16_ps(acc[t * R + r], (__m512bh)wv[r], (__m512bh)xv);
        }
    }
    for (int k = 0; k < R * T; k++) out[k] = _mm512_reduce_add_ps(acc[k]);
}
#endif

// The R x T kernels (R, T <= 4) rows_16bit picks from: dot_16bit, or for BF16 dot_bf16_dp when the
// format's kernel is Dot or Amx (find_format gives those only where they run).
template <typename Kind>
using Dot16Fn = void (*)(int, const typename Kind::type*, size_t, const typename Kind::act* const*, float*);
template <typename Kind, template <int, int> class Pick>
struct Dot16Table {
    static constexpr Dot16Fn<Kind> fns[4][4] = {
        {Pick<1, 1>::fn, Pick<1, 2>::fn, Pick<1, 3>::fn, Pick<1, 4>::fn},
        {Pick<2, 1>::fn, Pick<2, 2>::fn, Pick<2, 3>::fn, Pick<2, 4>::fn},
        {Pick<3, 1>::fn, Pick<3, 2>::fn, Pick<3, 3>::fn, Pick<3, 4>::fn},
        {Pick<4, 1>::fn, Pick<4, 2>::fn, Pick<4, 3>::fn, Pick<4, 4>::fn}};
};
template <typename Kind>
struct Widened {
    template <int R, int T>
    struct Pick {
        static constexpr Dot16Fn<Kind> fn = dot_16bit<R, T, Kind>;
    };
};
#if defined(__AVX512BW__)
template <int R, int T>
struct PickBf16Dp {
    static constexpr Dot16Fn<BF16Kind> fn = dot_bf16_dp<R, T>;
};
#endif

template <typename Kind, Bf16Kernel K>
const Dot16Fn<Kind> (*dot16_table())[4] {
#if defined(__AVX512BW__)
    if constexpr (std::is_same<Kind, BF16Kind>::value && K != Bf16Kernel::Widen) return Dot16Table<BF16Kind, PickBf16Dp>::fns;
#endif
    return Dot16Table<Kind, Widened<Kind>::template Pick>::fns;
}

// Rows r0..r1 against `count` tokens, four rows (in L1) against each four tokens in turn (the
// R, T <= 4 kernels above): the weights stream from memory once a call, the activations from L2.
// BF16 rows of kernel Amx take AMX tiles first where the call allows (amx_bf16_rows, bf16.cpp),
// the rest of the rows the vector kernels.
template <typename Kind, Bf16Kernel K = Bf16Kernel::Widen>
void rows_16bit(int n, const uint8_t* w, size_t row_bytes, int r0, int r1, const void* const* a, int count,
                float* out, size_t stride) {
    if constexpr (std::is_same<Kind, BF16Kind>::value && K == Bf16Kernel::Amx) {
        const Bf16Matrix mat{w, out};
        r0 = amx_bf16_rows(n, &mat, 1, row_bytes, r0, r1, a, count, stride);
        if (r0 >= r1) return;
    }
    using Act16 = typename Kind::act;
    const Dot16Fn<Kind>(*fns)[4] = dot16_table<Kind, K>();
    const size_t row_elems = row_bytes / sizeof(typename Kind::type);
    const typename Kind::type* rows = (const typename Kind::type*)w;
    float v[16];
    for (int r = r0; r < r1; r += 4) {
        const int nr = std::min(4, r1 - r);
        {  // the block's bytes, the tiles' distance ahead (the task's prologue fetched the first)
            const char* ahead = (const char*)(rows + r * row_elems) + kPrefetchAhead;
            for (size_t b = 0; b < nr * row_bytes; b += 64) prefetch_line(ahead + b);
        }
        for (int t0 = 0; t0 < count; t0 += 4) {
            const int nt = std::min(4, count - t0);
            const Act16* x[4];
            for (int t = 0; t < nt; t++) x[t] = (const Act16*)a[t0 + t];
            fns[nr - 1][nt - 1](n, rows + r * row_elems, row_elems, x, v);
            for (int t = 0; t < nt; t++)
                for (int k = 0; k < nr; k++) out[(size_t)(t0 + t) * stride + r + k] = v[t * nr + k];
        }
    }
}

// One row against one token (Format::dot): the pair's steps as in any block of rows_16bit.
template <typename Kind, Bf16Kernel K = Bf16Kernel::Widen>
float dot_16(int n, const void* w, const void* x) {
    float out;
    const typename Kind::act* xs[1] = {(const typename Kind::act*)x};
    dot16_table<Kind, K>()[0][0](n, (const typename Kind::type*)w, 0, xs, &out);
    return out;
}

// ---- Q2_K, Q3_K x Q8_K (portable loops over 16-value sub-blocks; the compiler vectorizes them) -
// Q2_K: value = d * (sc & 15) * q - dmin * (sc >> 4) * 1 for q in 0..3; the min term uses bsums.
#if defined(__AVX2__)
// Σ over the 32 values 128p + 32i + j (j < 32) of q * x, scaled per 16-value half: the 2-bit
// values of plane p shifted by 2i (u8, 0..7 with Q3_K's third bit), x from the Q8_K row;
// returns 8 int32 lanes (lanes 0-3: scale_lo * first half, 4-7: scale_hi * second half).
inline __m256i k2_pair(__m256i q_u8, const int8_t* x, int scale_lo, int scale_hi) {
    const __m256i p16 = _mm256_maddubs_epi16(q_u8, _mm256_loadu_si256((const __m256i*)x));
    const __m256i sc = _mm256_set_m128i(_mm_set1_epi16((short)scale_hi), _mm_set1_epi16((short)scale_lo));
    return _mm256_madd_epi16(p16, sc);
}
#endif

float dot_q2_k(int n, const void* vw, const void* va) {
    const block_q2_k* w = (const block_q2_k*)vw;
    const act_q8_k* a = (const act_q8_k*)va;
    float sum = 0;
#if defined(__AVX2__)
    const __m256i three = _mm256_set1_epi8(3);
    for (int b = 0; b < n / QK_K; b++) {
        __m256i acc = _mm256_setzero_si256();
        int mins = 0;
        for (int p = 0; p < 2; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(w[b].qs + 32 * p));
            for (int i = 0; i < 4; i++) {
                const int s = 8 * p + 2 * i;
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * i), three);
                acc = _mm256_add_epi32(acc, k2_pair(q, a[b].qs + 128 * p + 32 * i, w[b].scales[s] & 15, w[b].scales[s + 1] & 15));
                mins += (w[b].scales[s] >> 4) * a[b].bsums[s] + (w[b].scales[s + 1] >> 4) * a[b].bsums[s + 1];
            }
        }
        sum += a[b].d * (fp16_to_f32(w[b].d) * hsum_i32(acc) - fp16_to_f32(w[b].dmin) * mins);
    }
#else
    for (int b = 0; b < n / QK_K; b++) {
        int scaled = 0, mins = 0;
        for (int p = 0; p < 2; p++)
            for (int i = 0; i < 4; i++)
                for (int half = 0; half < 2; half++) {
                    const int s = 8 * p + 2 * i + half;
                    const uint8_t* q = w[b].qs + 32 * p + 16 * half;
                    const int8_t* x = a[b].qs + 128 * p + 32 * i + 16 * half;
                    int dot = 0;
                    for (int l = 0; l < 16; l++) dot += ((q[l] >> (2 * i)) & 3) * x[l];
                    scaled += (w[b].scales[s] & 15) * dot;
                    mins += (w[b].scales[s] >> 4) * a[b].bsums[s];
                }
        sum += a[b].d * (fp16_to_f32(w[b].d) * scaled - fp16_to_f32(w[b].dmin) * mins);
    }
#endif
    return sum;
}

// Q3_K: value = d * (sc - 32) * (q - 4), q = 2 low bits (qs) + 4 * high bit (hmask); 16 six-bit
// scales: low nibbles of bytes 0..7 (scale 8h + j in nibble h of byte j), high 2 bits of bytes
// 8..11 (scale 4h + j at bits 2h of byte 8 + j).
float dot_q3_k(int n, const void* vw, const void* va) {
    const block_q3_k* w = (const block_q3_k*)vw;
    const act_q8_k* a = (const act_q8_k*)va;
    float sum = 0;
    for (int b = 0; b < n / QK_K; b++) {
        int sc[16];
        for (int s = 0; s < 16; s++)
            sc[s] = (((w[b].scales[s % 8] >> (4 * (s / 8))) & 15) | (((w[b].scales[8 + s % 4] >> (2 * (s / 4))) & 3) << 4)) - 32;
#if defined(__AVX2__)
        // q - 4 with q = low + 4 * high in 0..7 (unsigned for maddubs): Σ (q - 4) x = Σ q x - 4 Σ x
        const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
        const __m256i hm = _mm256_loadu_si256((const __m256i*)w[b].hmask);
        __m256i acc = _mm256_setzero_si256();
        int offset = 0;
        for (int p = 0; p < 2; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(w[b].qs + 32 * p));
            for (int i = 0; i < 4; i++) {
                const int s = 8 * p + 2 * i;
                const __m256i low = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * i), three);
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * p + i), one);
                const __m256i q = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
                acc = _mm256_add_epi32(acc, k2_pair(q, a[b].qs + 128 * p + 32 * i, sc[s], sc[s + 1]));
                offset += sc[s] * a[b].bsums[s] + sc[s + 1] * a[b].bsums[s + 1];
            }
        }
        sum += a[b].d * fp16_to_f32(w[b].d) * (hsum_i32(acc) - 4 * offset);
#else
        int scaled = 0;
        for (int p = 0; p < 2; p++)
            for (int i = 0; i < 4; i++)
                for (int half = 0; half < 2; half++) {
                    const int s = 8 * p + 2 * i + half, bit = 4 * p + i;
                    const uint8_t* q = w[b].qs + 32 * p + 16 * half;
                    const uint8_t* h = w[b].hmask + 16 * half;
                    const int8_t* x = a[b].qs + 128 * p + 32 * i + 16 * half;
                    int dot = 0;
                    for (int l = 0; l < 16; l++) dot += (((q[l] >> (2 * i)) & 3) + 4 * ((h[l] >> bit) & 1) - 4) * x[l];
                    scaled += sc[s] * dot;
                }
        sum += a[b].d * fp16_to_f32(w[b].d) * scaled;
#endif
    }
    return sum;
}

float dot_f32(int n, const void* w, const void* x) { return fdot((const float*)w, (const float*)x, n); }

#if defined(__AVX2__)
constexpr Dot4Fn kDot4Q8_0 = dot4_q8_0, kDot4Q4_0 = dot4_q4_0, kDot4Mxfp4 = dot4_mxfp4;
#else
constexpr Dot4Fn kDot4Q8_0 = nullptr, kDot4Q4_0 = nullptr, kDot4Mxfp4 = nullptr;
#endif
#if defined(__AVX512BW__)
constexpr Dot4Fn kDot4Q4K = dot4_q4_k, kDot4Q5K = dot4_q5_k, kDot4Q6K = dot4_q6_k, kDot4IQ4XS = dot4_iq4_xs;
constexpr Act kActQ4K = Act::Q8_KX;
#elif defined(__AVX2__)
constexpr Dot4Fn kDot4Q4K = dot4_q4_k, kDot4Q5K = dot4_q5_k, kDot4Q6K = dot4_q6_k, kDot4IQ4XS = dot4_iq4_xs;
constexpr Act kActQ4K = Act::Q8_K;
#else
constexpr Dot4Fn kDot4Q4K = nullptr, kDot4Q5K = nullptr, kDot4Q6K = nullptr, kDot4IQ4XS = nullptr;
constexpr Act kActQ4K = Act::Q8_K;
#endif
// the 256-bit Q8_0 tiles' tokens: unsigned for AVX-VNNI's dpbusd, signed for AVX2's dot_s8
#if defined(__AVXVNNI__)
constexpr Act kQ8_0TileAct = Act::Q8_0U;
#else
constexpr Act kQ8_0TileAct = Act::Q8_0;
#endif

const Format kFormats[] = {
    {F32, "F32", 1, 4, Act::F32, dot_f32, nullptr},
    {F16, "F16", 1, 2, Act::F32, dot_16<F16Kind>, nullptr, nullptr, rows_16bit<F16Kind>},
    {Q8_0, "Q8_0", QK, sizeof(block_q8_0), Act::Q8_0, dot_q8_0, kDot4Q8_0},
    {Q4_0, "Q4_0", QK, sizeof(block_q4_0), Act::Q8_0, dot_q4_0, kDot4Q4_0},
    {MXFP4, "MXFP4", QK, sizeof(block_mxfp4), Act::Q8_0, dot_mxfp4, kDot4Mxfp4},
    {Q2_K, "Q2_K", QK_K, sizeof(block_q2_k), Act::Q8_K, dot_q2_k, nullptr},
    {Q3_K, "Q3_K", QK_K, sizeof(block_q3_k), Act::Q8_K, dot_q3_k, nullptr},
    {Q4_K, "Q4_K", QK_K, sizeof(block_q4_k), kActQ4K, dot_q4_k, kDot4Q4K},
    {Q5_K, "Q5_K", QK_K, sizeof(block_q5_k), kActQ4K, dot_q5_k, kDot4Q5K},
    {Q6_K, "Q6_K", QK_K, sizeof(block_q6_k), Act::Q8_K, dot_q6_k, kDot4Q6K},
    {IQ4_XS, "IQ4_XS", QK_K, sizeof(block_iq4_xs), Act::Q8_K, dot_iq4_xs, kDot4IQ4XS},
#if defined(__AVX512VNNI__)
    {Q4_K | kTiled, "Q4_K tiles", QK_K, sizeof(block_q4_k), Act::Q8_KT, nullptr, nullptr, tiles_q4_k},
    {Q5_K | kTiled, "Q5_K tiles", QK_K, sizeof(block_q5_k), Act::Q8_KT, nullptr, nullptr, tiles_q5_k},
    {Q6_K | kTiled, "Q6_K tiles", QK_K, sizeof(block_q6_k), Act::Q8_K, nullptr, nullptr, tiles_q6_k},
    {Q8_0 | kTiled, "Q8_0 tiles", 2 * QK, 2 * sizeof(block_q8_0), Act::Q8_0U, nullptr, nullptr, tiles_q8_0},  // 64 values a tile column
    {IQ4_XS | kTiled, "IQ4_XS tiles", QK_K, sizeof(block_iq4_xs), Act::Q8_KT, nullptr, nullptr, tiles_iq4_xs},
    {MXFP4 | kTiled, "MXFP4 tiles", QK, sizeof(block_mxfp4), Act::Q8_0S, nullptr, nullptr, tiles_mxfp4},
#elif defined(__AVX2__) && !defined(__AVX512BW__)  // (the AVX2 and AVX-VNNI levels)
    {Q4_K | kTiled, "Q4_K tiles", QK_K, sizeof(block_q4_k), Act::Q8_KT, nullptr, nullptr, tiles_q4_k},
    {Q5_K | kTiled, "Q5_K tiles", QK_K, sizeof(block_q5_k), Act::Q8_KT, nullptr, nullptr, tiles_q5_k},
    {Q6_K | kTiled, "Q6_K tiles", QK_K, sizeof(block_q6_k), Act::Q8_K, nullptr, nullptr, tiles_q6_k},
    {Q8_0 | kTiled, "Q8_0 tiles", 2 * QK, 2 * sizeof(block_q8_0), kQ8_0TileAct, nullptr, nullptr, tiles_q8_0},  // 64 values a tile column
    {IQ4_XS | kTiled, "IQ4_XS tiles", QK_K, sizeof(block_iq4_xs), Act::Q8_K, nullptr, nullptr, tiles_iq4_xs},
    {MXFP4 | kTiled, "MXFP4 tiles", QK, sizeof(block_mxfp4), Act::Q8_0S, nullptr, nullptr, tiles_mxfp4},
#endif
};

// BF16 rows, one entry a kernel (Bf16Kernel's order); find_format picks one.
const Format kBf16Formats[] = {
    {BF16, "BF16", 1, 2, Act::BF16, dot_16<BF16Kind>, nullptr, nullptr, rows_16bit<BF16Kind>, Bf16Kernel::Widen},
    {BF16, "BF16", 1, 2, Act::BF16, dot_16<BF16Kind, Bf16Kernel::Dot>, nullptr, nullptr,
     rows_16bit<BF16Kind, Bf16Kernel::Dot>, Bf16Kernel::Dot},
    {BF16, "BF16", 1, 2, Act::BF16, dot_16<BF16Kind, Bf16Kernel::Amx>, nullptr, nullptr,
     rows_16bit<BF16Kind, Bf16Kernel::Amx>, Bf16Kernel::Amx},
};

struct Repack {
    int type;
    RepackFn fn;
};
const Repack kRepacks[] = {{Q4_K, repack_q4_k16}, {Q5_K, repack_q5_k16}, {Q6_K, repack_q6_k16}, {IQ4_XS, repack_iq4_xs16}, {Q8_0, repack_q8_0x16},
                           {MXFP4, repack_mxfp4x16}};

}  // namespace

void dot_rows(const Format* f, int n, const void* w, const void* const* a, int count, float* out) {
    int i = 0;
    if (f->dot4)
        for (; i + 4 <= count; i += 4) f->dot4(n, w, a + i, out + i);
    for (; i < count; i++) out[i] = f->dot(n, w, a[i]);
}

void dot_rows_block(const Format* f, int n, const uint8_t* w, size_t row_bytes, int r0, int r1, const void* const* a,
                    int count, float* out, size_t stride) {
    if (f->rows) return f->rows(n, w, row_bytes, r0, r1, a, count, out, stride);
    const int block = (int)std::max<size_t>(1, std::min<size_t>(64, (16 << 10) / row_bytes));
    float v[4];
    for (int b0 = r0; b0 < r1; b0 += block) {
        const int b1 = std::min(r1, b0 + block);
        int i = 0;
        if (f->dot4)
            for (; i + 4 <= count; i += 4)
                for (int r = b0; r < b1; r++) {
                    f->dot4(n, w + (size_t)r * row_bytes, a + i, v);
                    for (int k = 0; k < 4; k++) out[(size_t)(i + k) * stride + r] = v[k];
                }
        for (; i < count; i++)
            for (int r = b0; r < b1; r++) out[(size_t)i * stride + r] = f->dot(n, w + (size_t)r * row_bytes, a[i]);
    }
}

void prefetch_prologue(const void* start, size_t bytes) {
    const char* p = (const char*)start;
    const size_t n = bytes < (size_t)kPrefetchAhead ? bytes : (size_t)kPrefetchAhead;
    for (size_t b = 0; b < n; b += 64) prefetch_line(p + b);
}

int rows_step(const Format* f) { return f->tile ? kTileRows : 1; }

void dot_step(const Format* f, int n, const uint8_t* w, size_t row_bytes, int r, const void* const* a, int count, float* out) {
    if (f->tile) f->tile(n, w + (size_t)r * row_bytes, a, count, out);
    else dot_rows(f, n, w + (size_t)r * row_bytes, a, count, out);
}

int tile_cols(int type) {
    const Format* f = has_tiles(type) ? find_format(type | kTiled) : nullptr;
    return f ? f->block_elems : 0;
}

bool has_tiles(int type) {
    if (type & kTiled) return false;
    for (const Repack& r : kRepacks)
        if (r.type == type) return find_format(type | kTiled) != nullptr;
    return false;
}

size_t tiled_row_bytes(int type, int rows, int n) {
    if (!has_tiles(type)) throw std::invalid_argument(std::string("repack_tiles: no tiled layout for ggml type ") + std::to_string(type));
    const Format* f = find_format(type | kTiled);  // its block: the values of one tile column
    if (rows <= 0 || rows % kTileRows || n <= 0 || n % f->block_elems)
        throw std::invalid_argument("repack_tiles: " + std::to_string(rows) + " rows of " + std::to_string(n) + " values: need rows % 16 == 0 and whole tile columns (" +
                                    std::to_string(f->block_elems) + " values) of " + f->name);
    return (size_t)(n / f->block_elems) * f->block_bytes;
}

void repack_tiles(int type, const void* src, void* dst, int rows, int n) {
    const size_t group = kTileRows * tiled_row_bytes(type, rows, n);
    for (const Repack& r : kRepacks)
        if (r.type == type)
            for (int g = 0; g < rows / kTileRows; g++) r.fn((const uint8_t*)src + g * group, (uint8_t*)dst + g * group, n);
}

const Format* find_format(int type, Bf16Kernel bf16) {
    if (type == BF16) return &kBf16Formats[(int)std::min(bf16, bf16_best())];
    for (const Format& f : kFormats)
        if (f.type == type) return &f;
    return nullptr;
}

const char* supported_formats() { return "F32, F16, BF16, Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4"; }

float row_absmax(const float* x, int n) { return absmax(x, n); }
void row_round_i8(const float* x, float inv, int8_t* q, int n) { round_to_i8(x, inv, q, n); }

void silu_mul(float* g, const float* u, int n) {
    int i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v));
        const __m256 s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

void silu_rows(float* x, size_t n) {
    size_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    }
#endif
    for (; i < n; i++) x[i] = x[i] / (1.f + std::exp(-x[i]));
}

void swiglu_clamped(float* g, const float* u, int n, float limit, float alpha) {
    int i = 0;
#if defined(__AVX2__)
    const __m256 lim = _mm256_set1_ps(limit), neg = _mm256_set1_ps(-limit), a = _mm256_set1_ps(alpha);
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_min_ps(_mm256_loadu_ps(g + i), lim);
        const __m256 w = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(u + i), lim), neg);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(a, v)));
        const __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_add_ps(w, one)));
    }
#endif
    for (; i < n; i++) {
        const float v = std::min(g[i], limit), w = std::max(std::min(u[i], limit), -limit);
        g[i] = v / (1.f + std::exp(-alpha * v)) * (w + 1.f);
    }
}

void add_row(float* x, const float* b, int n) {
    for (int i = 0; i < n; i++) x[i] += b[i];
}

void rms_norm_rows(const float* x, const float* w, float eps, int rows, int n, float* out) {
    for (int r = 0; r < rows; r++, x += n, out += n) {
        const float inv = 1.f / std::sqrt(fdot(x, x, n) / (float)n + eps);
        int i = 0;
#if defined(__AVX2__)
        const __m256 vi = _mm256_set1_ps(inv);
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi), _mm256_loadu_ps(w + i)));
#endif
        for (; i < n; i++) out[i] = x[i] * inv * w[i];
    }
}

void softmax_topk_rows(const float* logits, int rows, int n, int k, bool renorm, float* w, int64_t* ids) {
    if (rows < 0 || n < 1 || k < 1 || k > n)
        throw std::invalid_argument("softmax_topk: need rows >= 0 and 1 <= k <= n, got rows " + std::to_string(rows) +
                                    ", n " + std::to_string(n) + ", k " + std::to_string(k));
    for (int64_t i = 0; i < (int64_t)rows * n; i++)
        if (std::isnan(logits[i]))
            throw std::invalid_argument("softmax_topk: row " + std::to_string(i / n) + " has a NaN logit (column " +
                                        std::to_string(i % n) + ")");
    for (int r = 0; r < rows; r++, logits += n, w += k, ids += k) {
        float mx = logits[0];
        for (int e = 1; e < n; e++) mx = std::max(mx, logits[e]);
        float sum = 0.f;
        for (int e = 0; e < n; e++) sum += std::exp(logits[e] - mx);
        // insertion into the k best so far, kept sorted: a later expert passes only a strictly larger logit
        int found = 0;
        for (int e = 0; e < n; e++) {
            if (found == k && !(logits[e] > logits[ids[k - 1]])) continue;
            int at = found < k ? found++ : k - 1;
            for (; at > 0 && logits[e] > logits[ids[at - 1]]; at--) ids[at] = ids[at - 1];
            ids[at] = e;
        }
        float picked = 0.f;
        for (int j = 0; j < k; j++) picked += (w[j] = std::exp(logits[ids[j]] - mx) / sum);
        if (renorm)
            for (int j = 0; j < k; j++) w[j] /= picked;
    }
}

size_t act_row_bytes(Act act, int n) {
    switch (act) {
        case Act::F32: return sizeof(float) * n;
        case Act::BF16: return sizeof(bf16_t) * n;
        case Act::Q8_0:
        case Act::Q8_0U: return sizeof(act_q8_0) * (n / QK);
        case Act::Q8_0S: return sizeof(act_q8_0s) * (n / QK);
        case Act::Q8_K:
        case Act::Q8_KX:
        case Act::Q8_KT: return sizeof(act_q8_k) * (n / QK_K);
    }
    return 0;
}

void prepare_act(Act act, const float* x, void* out, int n) {
    switch (act) {
        case Act::F32: std::memcpy(out, x, sizeof(float) * n); break;
        case Act::BF16:
            for (int i = 0; i < n; i++) ((bf16_t*)out)[i] = f32_to_bf16(x[i]);
            break;
        case Act::Q8_0: prep_q8_0(x, (act_q8_0*)out, n); break;
        case Act::Q8_0U: prep_q8_0u(x, (act_q8_0*)out, n); break;
        case Act::Q8_0S: prep_q8_0s(x, (act_q8_0s*)out, n); break;
        case Act::Q8_K: prep_q8_k(x, (act_q8_k*)out, n); break;
        case Act::Q8_KX: prep_q8_kx(x, (act_q8_k*)out, n); break;
        case Act::Q8_KT: prep_q8_kt(x, (act_q8_k*)out, n); break;
    }
}

}  // namespace kt
