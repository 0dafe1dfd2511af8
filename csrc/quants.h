// Row dot products of GGML weight blocks with quantized activations, and the format table.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>

#include "blocks.h"

namespace kt {

// How activations are prepared for a weight format. Q8_KX: Q8_K with each 128 values stored as
// [0..31, 64..95, 32..63, 96..127], the order 512-bit Q4_K code consumes them in. Q8_KT: Q8_K
// with bsums[0..7] holding the sums of each 32 values in the order 0, 2, 1, 3, 4, 6, 5, 7 (pairs
// of them are what the 16-row Q4_K tiles multiply their mins by), bsums[8..15] zero.
// Q8_0U: Q8_0 with every value + 128 as an unsigned byte (the unsigned side of dpbusd against
// the Q8_0 tiles' signed weights). Q8_0S: Q8_0 with each block's sum of values (the signed side
// of dpbusd against weights made unsigned by an offset, which the sums take back).
// BF16: each value rounded to the nearest bf16 (BF16 weights).
enum class Act { F32, BF16, Q8_0, Q8_0U, Q8_0S, Q8_K, Q8_KX, Q8_KT };

// dot(n, weight row bytes, prepared activation row) -> float
using DotFn = float (*)(int n, const void* w, const void* a);
// The same weight row against 4 activation rows at once (weights decoded once): out[0..3].
using Dot4Fn = void (*)(int n, const void* w, const void* const a[4], float out[4]);

// 16-row tiles: a matrix's rows in groups of 16 whose blocks are interleaved (tile_q4_k16 and
// the like: same bytes per row, repacked once at load), so that one 512-bit register (two
// 256-bit ones at the AVX2 level) holds a few values of each of the 16 rows and a dot product
// needs no horizontal sums. The kernel
// computes all 16 rows of a group against `count` activation rows: out[i * 16 + k] = row k, token i.
using TileFn = void (*)(int n, const void* tiles, const void* const* a, int count, float* out);
// One group of 16 rows (each n values, stored one after another) into its tiles.
using RepackFn = void (*)(const void* rows, void* tiles, int n);
constexpr int kTileRows = 16;
constexpr int kTiled = 256;  // type id | kTiled: the tiled layout of that ggml type

// BF16 rows (bf16.cpp): the widening kernel (every bf16 to float32), vdpbf16ps dot products where
// the CPU has AVX512-BF16, and AMX-BF16 tiles for blocks of rows and tokens where the build has
// them and the OS grants them, best last. A kernel takes the best its caller allows that runs
// here (find_format); tests allow each in turn to check them against each other.
enum class Bf16Kernel { Widen = 0, Dot = 1, Amx = 2 };
Bf16Kernel bf16_best();  // the best BF16 kernel this build runs on this CPU

struct Format {
    int type;  // ggml type id, | kTiled for a tiled layout
    const char* name;
    int block_elems;
    int block_bytes;  // per row (a tile group holds kTileRows times this per block column)
    Act act;
    DotFn dot;     // rows as stored; nullptr for tiled layouts
    Dot4Fn dot4;   // nullptr: call dot per row
    TileFn tile = nullptr;  // tiled layouts only
    // Rows r0..r1 (stored one after another, row_bytes apart) against `count` activation rows:
    // out[i * stride + r] for token i. Formats whose kernel blocks rows and tokens itself (the
    // 16-bit floats); nullptr: dot_rows_block pairs dot4 with blocks of rows.
    void (*rows)(int n, const uint8_t* w, size_t row_bytes, int r0, int r1, const void* const* a, int count,
                 float* out, size_t stride) = nullptr;
    Bf16Kernel bf16 = Bf16Kernel::Widen;  // BF16 rows: the kernel `rows` and `dot` use
};

// The rows [r, r + step) of w (step: 1, or kTileRows for a tiled format, r a multiple of it)
// against count activation rows: out[i * step + k] = row r + k, token i. `w` is the matrix.
int rows_step(const Format* f);
void dot_step(const Format* f, int n, const uint8_t* w, size_t row_bytes, int r, const void* const* a, int count, float* out);
// Whether this build has a tiled layout (and its kernel) for ggml type `type`.
bool has_tiles(int type);
int tile_cols(int type);  // the tiled layout's columns come in multiples of this (0: no tiles)
// Bytes of one row of `rows` x `n` values of `type`, the same tiled or not; throws
// std::invalid_argument naming what is wrong when there are no tiles or the sizes don't fit them.
size_t tiled_row_bytes(int type, int rows, int n);
// Repack `rows` rows of ggml type `type` (n values each) into the tiled layout (checked as above).
void repack_tiles(int type, const void* src, void* dst, int rows, int n);
// Software prefetch of the tiled kernels: the lines kPrefetchAhead bytes past the tile being read,
// into L2 (T1; quants.cpp's prefetch_line says why). A one-token call does little arithmetic a
// byte, so the hardware prefetchers alone leave it waiting on memory; a few KiB ahead hide the
// latency (within that range the distance matters little).
constexpr int kPrefetchAhead = 4096;
// The first min(bytes, kPrefetchAhead) bytes of a run of weights about to be read, at once:
// the kernels prefetch kPrefetchAhead ahead of where they read, so without it a run's first
// bytes would come by demand misses. (The MoE's GGML-block tasks issue it for their gate and up
// runs together at the start; the up run's lines then wait in L2.)
void prefetch_prologue(const void* start, size_t bytes);

// out[i] = dot(w, a[i]) for i < count, four at a time where the format has a dot4.
void dot_rows(const Format* f, int n, const void* w, const void* const* a, int count, float* out);
// out[i * stride + r] = dot(row r of w, a[i]) for rows r0 <= r < r1 of a format without tiles
// (rows of row_bytes), i < count: a block of rows (~16 KiB, which stays in L1) against each four
// tokens in turn, so that each token's activations are read once a block, not once a row. The
// same dot and dot4 calls as dot_rows per row: the same results, to the bit.
void dot_rows_block(const Format* f, int n, const uint8_t* w, size_t row_bytes, int r0, int r1, const void* const* a,
                    int count, float* out, size_t stride);

// The AMX part of BF16 rows calls: rows r0..r1 of each of `mats` matrices (rows of row_bytes,
// n values) against the same `count` tokens' activations, out[t * stride + r] as Format::rows
// writes them. The tokens are packed once for all the matrices (an MoE's gate and up). It does the
// whole 16-row blocks from r0 when there are >= 32 rows, >= kAmxBf16MinTokens tokens and
// n % 32 == 0, and returns the first row not done (r0 when it did nothing).
constexpr int kAmxBf16MinTokens = 4;
struct Bf16Matrix {
    const uint8_t* w;
    float* out;
};
int amx_bf16_rows(int n, const Bf16Matrix* mats, int count_mats, size_t row_bytes, int r0, int r1,
                  const void* const* a, int count, size_t stride);

// nullptr when `type` is not computed on directly. BF16 rows: the best kernel up to `bf16` that
// runs here.
const Format* find_format(int type, Bf16Kernel bf16 = Bf16Kernel::Amx);
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
// x[i] = silu(x[i])
void silu_rows(float* x, size_t n);
// gpt-oss's clamped SwiGLU: g' = min(g[i], limit), u' = clamp(u[i], -limit, limit),
// g[i] = g' * sigmoid(alpha * g') * (u' + 1)
void swiglu_clamped(float* g, const float* u, int n, float limit, float alpha);
// x[i] += b[i]
void add_row(float* x, const float* b, int n);
// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for `rows` rows of n floats (RMSNorm at decode).
void rms_norm_rows(const float* x, const float* w, float eps, int rows, int n, float* out);
// Softmax top-k routing of `rows` rows of n logits: for each row, the k largest logits' experts in
// ids [rows, k] (largest first; of equal logits the lower index first) and their softmax
// probabilities over all n in w [rows, k], divided by their sum over the k with `renorm`. Throws
// std::invalid_argument (before writing anything) where a logit is NaN, or where k is not in 1..n.
void softmax_topk_rows(const float* logits, int rows, int n, int k, bool renorm, float* w, int64_t* ids);

}  // namespace kt
