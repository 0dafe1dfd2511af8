// GGML blocks back to float32, one run of blocks at a time: what the experts' backward reads its
// frozen weights through (the transposed products W^T v take a row's values, not its dots).
#pragma once
#include <cstddef>
#include <cstdint>

namespace kt {

// Values per block and bytes per block of a ggml type the kernels compute on (F32, F16, BF16:
// one value a "block"); 0 where the type has no decoder here (a tiled layout included).
int dequant_block_elems(int type);
int dequant_block_bytes(int type);
// out[0 .. blocks * elems) = the values of `blocks` consecutive blocks of `type` at src.
void dequant_blocks(int type, const void* src, int blocks, float* out);

}  // namespace kt
