// Prefill path: expert weights re-quantized at load to int8 with one float scale per row, and
// activations to int8 with one scale per token row; an int8 GEMM with VNNI (vpdpbusd) then does
// 64 multiply-adds per instruction with no per-block rescaling inside the K loop.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kt {

// Int8 copy of one projection of all experts: w [E, rows, cols] int8, scale and sum [E, rows].
struct Int8Weights {
    const int8_t* w = nullptr;
    const float* scale = nullptr;
    const int32_t* row_sum = nullptr;  // sum of the row's int8 values (for the u8 activation offset)
    // The same values packed for AMX (AMX builds): [E, rows/16, cols/64] tiles of 16 x 64 bytes,
    // tile row kk holding w[n][4kk..4kk+3] for n = 0..15 (the VNNI layout TDPBUSD reads).
    const int8_t* amx = nullptr;
};

bool int8_gemm_available();  // built with AVX512-VNNI
bool amx_available();        // built with AMX-INT8 and the OS lets this process use the tiles

// x row (n floats) -> n unsigned bytes q + 128 with q = round(x / s), s = amax / 127; returns s.
float quantize_row_u8(const float* x, uint8_t* out, int n);

// out[t * out_stride + r] for rows r in [r0, r1) of `w` (row length k, k % 64 == 0) and
// `count` activation rows xs[t] with scales sx[t]:
//   out = (sum_k w[r,k] * (xs[t][k] - 128) ) * scale[r] * sx[t]
void int8_rows(const Int8Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t out_stride);

}  // namespace kt
