// Row dot products of GGML weight blocks with quantized activations, and the format table.
#pragma once
#include <cstddef>
#include <cstdint>

#include "blocks.h"

namespace kt {

// How activations are prepared for a weight format. Q8_KX: Q8_K with each 128 values stored as
// [0..31, 64..95, 32..63, 96..127], the order 512-bit Q4_K code consumes them in.
enum class Act { F32, Q8_0, Q8_K, Q8_KX };

// dot(n, weight row bytes, prepared activation row) -> float
using DotFn = float (*)(int n, const void* w, const void* a);
// The same weight row against 4 activation rows at once (weights decoded once): out[0..3].
using Dot4Fn = void (*)(int n, const void* w, const void* const a[4], float out[4]);

struct Format {
    GGMLType type;
    const char* name;
    int block_elems;
    int block_bytes;
    Act act;
    DotFn dot;
    Dot4Fn dot4;  // nullptr: call dot per row
};

// out[i] = dot(w, a[i]) for i < count, four at a time where the format has a dot4.
void dot_rows(const Format* f, int n, const void* w, const void* const* a, int count, float* out);

// nullptr when `type` is not computed on directly.
const Format* find_format(int type);
const char* supported_formats();

// Bytes of one prepared activation row of n values.
size_t act_row_bytes(Act act, int n);
// Prepare an activation row (n floats) for dot products with weights that take `act`.
void prepare_act(Act act, const float* x, void* out, int n);
// amax of n floats, and round(x * inv) to int8 (nearest even), for n % 8 == 0
float row_absmax(const float* x, int n);
void row_round_i8(const float* x, float inv, int8_t* q, int n);
// g[i] = silu(g[i]) * u[i]
void silu_mul(float* g, const float* u, int n);
// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for `rows` rows of n floats (RMSNorm at decode).
void rms_norm_rows(const float* x, const float* w, float eps, int rows, int n, float* out);

}  // namespace kt
