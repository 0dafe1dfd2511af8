// BF16 rows with AMX-BF16 tiles (amx build), and which BF16 kernels run here.
//
// TDPBF16PS multiplies a 16 x 32 bf16 A tile by a 32 x 16 B tile (stored as 16 rows of 16 bf16
// pairs) into 16 x 16 floats. The weights are the A side, straight from the stored rows: a tile
// load takes 64 bytes of each of 16 rows at the row stride, so BF16 weights need no repacked
// copy. The tokens' activations are the B side: row kk of a B tile holds pair kk (values 2kk,
// 2kk + 1 of the 32) of each of 16 tokens, a 16 x 16 transpose of 32-bit pairs done once a call
// for all its rows. C tiles hold [weight row][token]: stored, then written out a token at a time.
#include "amx.h"
#include "int8.h"
#include "quants.h"

#include <algorithm>
#include <vector>

namespace kt {

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define KT_AMX_BF16 1
#endif

Bf16Kernel bf16_best() {
#if defined(__AVX512BF16__)
    const bool dot = true;
#elif defined(__AVX512BW__)
    static const bool dot = __builtin_cpu_supports("avx512bf16");  // the avx512 build: the CPU decides
#else
    const bool dot = false;
#endif
#if defined(KT_AMX_BF16)
    const bool amx = amx_available();
#else
    const bool amx = false;
#endif
    return amx ? Bf16Kernel::Amx : dot ? Bf16Kernel::Dot : Bf16Kernel::Widen;
}

#if defined(KT_AMX_BF16)
namespace {
// r[j] = 16 pairs of token j  ->  r[kk] = pair kk of tokens 0..15 (a 16 x 16 transpose of 32-bit
// lanes: pairs of rows interleaved at 32, then 64 bits, then 128-bit lanes swapped in two rounds).
inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // each 128-bit lane L of r[4g + c] now holds column c (of 4) of rows 4g..4g+3, lane L's
    // columns 4L..4L+3: gather the lanes of the four row groups
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);            // lanes 0, 2 of each
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);        // lanes 1, 3
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);        // columns 0..3 of every row
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);    // columns 8..11
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);   // columns 4..7
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);  // columns 12..15
    }
}

// The B tiles of `m` (<= 16) tokens: [n / 32][16 pairs][16 tokens], tokens past m zero.
void pack_tokens(const void* const* a, int m, int n, uint32_t* b) {
    for (int kb = 0; kb < n / 32; kb++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = j < m ? _mm512_loadu_si512((const uint8_t*)a[j] + (size_t)kb * 64) : _mm512_setzero_si512();
        transpose16(r);
        for (int kk = 0; kk < 16; kk++) _mm512_storeu_si512(b + (size_t)kb * 256 + kk * 16, r[kk]);
    }
}

// RB (1 or 2) blocks of 16 weight rows (`w`, row_bytes apart) against TT (1 or 2) blocks of 16
// tokens (`b`, `b + block`): C tile 2 rb + tt += A tile 4 + rb x B tile 6 + tt. A step reads 64
// bytes of each of 16 RB rows, so it asks for each row's line `ahead` bytes on (0: none): one
// stream a row is more than the hardware prefetchers follow.
template <int RB, int TT>
void tile_block(const uint8_t* w, size_t row_bytes, const uint32_t* b, size_t block, int n, int ahead,
                float c[2][2][16][16]) {
    zero_accumulators<RB, TT>();
    for (int kb = 0; kb < n / 32; kb++) {
        if (ahead)
            for (int row = 0; row < 16 * RB; row++) _mm_prefetch((const char*)w + row * row_bytes + kb * 64 + ahead, _MM_HINT_T0);
        _tile_loadd(4, w + (size_t)kb * 64, row_bytes);
        if (RB > 1) _tile_loadd(5, w + 16 * row_bytes + (size_t)kb * 64, row_bytes);
        _tile_loadd(6, b + (size_t)kb * 256, 64);
        if (TT > 1) _tile_loadd(7, b + block + (size_t)kb * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (TT > 1) _tile_dpbf16ps(1, 4, 7);
        if (RB > 1) _tile_dpbf16ps(2, 5, 6);
        if (RB > 1 && TT > 1) _tile_dpbf16ps(3, 5, 7);
    }
    store_accumulators<RB, TT>(c);
}

using TileBlockFn = void (*)(const uint8_t*, size_t, const uint32_t*, size_t, int, int, float[2][2][16][16]);
// Each row's prefetch distance: 16 or 32 rows stream side by side, so each needs only a little
// of the tiles' distance (kPrefetchAhead).
constexpr int kRowAhead = 512;
constexpr TileBlockFn kTileBlocks[2][2] = {{tile_block<1, 1>, tile_block<1, 2>}, {tile_block<2, 1>, tile_block<2, 2>}};
constexpr int kAmxTokens = 64;  // tokens whose B tiles are packed at once (n = 7168: 896 KiB, in L2)
}  // namespace
#endif

int amx_bf16_rows(int n, const Bf16Matrix* mats, int count_mats, size_t row_bytes, int r0, int r1,
                  const void* const* a, int count, size_t stride) {
#if defined(KT_AMX_BF16)
    if (count < kAmxBf16MinTokens || r1 - r0 < 32 || n % 32 || !amx_available()) return r0;
    configure_tiles();
    const int last = r0 + (r1 - r0) / 16 * 16;
    const size_t block = (size_t)(n / 32) * 256;  // 32-bit pairs of one 16-token block
    const int ahead = kRowAhead;
    thread_local std::vector<uint32_t> b;
    if (b.size() < kAmxTokens / 16 * block) b.resize(kAmxTokens / 16 * block);
    alignas(64) float c[2][2][16][16];
    for (int t0 = 0; t0 < count; t0 += kAmxTokens) {
        const int m = std::min(kAmxTokens, count - t0), blocks = (m + 15) / 16;
        for (int tb = 0; tb < blocks; tb++) pack_tokens(a + t0 + 16 * tb, std::min(16, m - 16 * tb), n, &b[tb * block]);
        for (int x = 0; x < count_mats; x++) {
            const uint8_t* w = mats[x].w;
            float* out = mats[x].out;
            for (int r = r0; r < last;) {
                const int rb = r + 32 <= last ? 2 : 1;
                for (int tb = 0; tb < blocks; tb += 2) {
                    const int tt = tb + 1 < blocks ? 2 : 1;
                    kTileBlocks[rb - 1][tt - 1](w + (size_t)r * row_bytes, row_bytes, &b[tb * block], block, n, ahead, c);
                    for (int i = 0; i < rb; i++)
                        for (int j = 0; j < tt; j++)
                            for (int k = 0; k < 16 && 16 * (tb + j) + k < m; k++) {
                                float* dst = out + (size_t)(t0 + 16 * (tb + j) + k) * stride + r + 16 * i;
                                for (int row = 0; row < 16; row++) dst[row] = c[i][j][row][k];
                            }
                }
                r += 16 * rb;
            }
        }
    }
    return last;
#else
    (void)n, (void)mats, (void)count_mats, (void)row_bytes, (void)r1, (void)a, (void)count, (void)stride;
    return r0;
#endif
}

}  // namespace kt
