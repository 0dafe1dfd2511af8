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

// Symmetric per-row int8 copies of E matrices of rows x cols values of ggml `type` stored one after
// another at src (src_bytes checked): each output row (a row, or with `transpose` a column, of an
// expert's matrix) w = round(x / s), s = amax / 127, with its scale and the sum of its int8 values;
// w [E, R, C], scale and row_sum [E, R] where (R, C) = (rows, cols), or (cols, rows) transposed.
// The output row length must be a multiple of 8. Runs a task per expert on the pool.
class ThreadPool;
void int8_copies(ThreadPool& pool, int type, const void* src, size_t src_bytes, int E, int rows, int cols,
                 bool transpose, int8_t* w, float* scale, int32_t* row_sum);

}  // namespace kt
