// Row dot products of GGML weight blocks with quantized activations, and the format table.
#pragma once
#include <cstddef>
#include <cstdint>

#include "blocks.h"

namespace kt {

enum class Act { F32, Q8_0, Q8_K };  // how activations are prepared for a weight format

// dot(n, weight row bytes, prepared activation row) -> float
using DotFn = float (*)(int n, const void* w, const void* a);

struct Format {
    GGMLType type;
    const char* name;
    int block_elems;
    int block_bytes;
    Act act;
    DotFn dot;
};

// nullptr when `type` is not computed on directly.
const Format* find_format(int type);
const char* supported_formats();

// Bytes of one prepared activation row of n values.
size_t act_row_bytes(Act act, int n);
// Prepare an activation row (n floats) for dot products with weights that take `act`.
void prepare_act(Act act, const float* x, void* out, int n);

}  // namespace kt
