// Prefill path: expert weights re-quantized at load to int8 with one float scale per row (or to int4
// with one per group of columns, below), and activations to int8 with one scale per token row; an
// int8 GEMM with VNNI (vpdpbusd) or AMX tiles then does 64 multiply-adds per instruction.
#pragma once
#include <cstddef>
#include <cstdint>

// What this build's -m flags allow: the VNNI GEMMs (int8.cpp, int4.cpp), and AMX tiles beside them;
// at the AVX-VNNI level the int8 GEMM alone, on 256-bit registers (KT_INT8_GEMM_256); at the AVX2
// level the same GEMM on vpmaddubsw/vpmaddwd (KT_INT8_GEMM_256 and KT_INT8_GEMM_MADDUBS).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KT_INT8_GEMM 1
#elif defined(__AVXVNNI__)
#include <immintrin.h>
#define KT_INT8_GEMM_256 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define KT_INT8_GEMM_256 1
#define KT_INT8_GEMM_MADDUBS 1
#endif
#if defined(KT_INT8_GEMM) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define KT_AMX 1
#endif

namespace kt {

// Int8 copy of one projection of all experts: w [E, rows, cols] int8, scale and sum [E, rows].
// In AMX builds the copy may keep its values as the AMX tiles alone (w null), half the RAM.
struct Int8Weights {
    const int8_t* w = nullptr;
    const float* scale = nullptr;
    const int32_t* row_sum = nullptr;  // sum of the row's int8 values (for the u8 activation offset)
    // The same values packed for AMX (AMX builds): [E, rows/16, cols/64] tiles of 16 x 64 bytes,
    // tile row kk holding w[n][4kk..4kk+3] for n = 0..15 (the VNNI layout TDPBUSD reads).
    const int8_t* amx = nullptr;
    bool values() const { return w || amx; }
    // expert e's part of a copy of e's `rows` x `cols` matrices
    Int8Weights expert(size_t e, size_t rows, size_t cols) const {
        const size_t at = e * rows;
        return {w ? w + at * cols : nullptr, scale + at, row_sum + at, amx ? amx + at * cols : nullptr};
    }
};

bool int8_gemm_available();  // built with AVX512-VNNI, AVX-VNNI or AVX2
// The int8 GEMM runs on VNNI's vpdpbusd (or AMX): a prefill on int8 copies beats the GGML blocks'
// kernels. AVX2's vpmaddubsw GEMM does not (it needs a sign step and a widening a product, where
// the blocks' unsigned nibbles need neither), so there it serves the training backward only.
bool int8_gemm_vnni();
bool int4_gemm_available();  // built with AVX512-VNNI (the int4 blocks are 512-bit VNNI tiles)
bool amx_available();        // built with AMX-INT8 and the OS lets this process use the tiles

// x row (n floats) -> n unsigned bytes q + 128 with q = round(x / s), s = amax / 127; returns s.
float quantize_row_u8(const float* x, uint8_t* out, int n);

// out[t * out_stride + r] for rows r in [r0, r1) of `w` (row length k, k % 64 == 0) and
// `count` activation rows xs[t] with scales sx[t]:
//   out = (sum_k w[r,k] * (xs[t][k] - 128) ) * scale[r] * sx[t]
void int8_rows(const Int8Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t out_stride);

// Int4 copy of one projection of all experts, symmetric in groups of `group` values along each row
// (rows % 16 == 0, cols % group == 0, group % 64 == 0). Each 16-row x 64-column block is the
// int8 VNNI tile that TDPBUSD reads (tile row kk holds w[n][4kk..4kk+3] + 8 for n = 0..15), two
// values a byte: byte p of the block's 512 holds tile byte p in its low nibble and tile byte
// p + 512 in its high one, so 64 loaded bytes give tile rows c and c + 8.
struct Int4Weights {
    const uint8_t* q = nullptr;    // [E, rows/16, cols/64, 512]
    const float* scale = nullptr;  // [E, rows/16, cols/group, 16]: the groups' steps, 16 rows a vector
    const float* corr = nullptr;   // [E, rows]: 128 * sum over groups of step * (sum of the group's w)
    int group = 0;
};

// As int8_rows, for one expert's int4 copy (rows r0..r1 of it):
//   out = (sum_g scale[r,g] * sum_{k in g} w[r,k] * xs[t][k] - corr[r]) * sx[t]
void int4_rows(const Int4Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t out_stride);

}  // namespace kt
