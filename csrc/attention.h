// Decode-step attention straight from the paged KV cache (one query row per head), the fast path
// beside ktransformers/operators/attention.py's torch reference.
#pragma once
#include <cstddef>
#include <cstdint>

#include "pool.h"

namespace kt {

// out[h] = softmax_j(q[h] . k[slot_j, h / g] * scale) v[slot_j, h / g] for every head h, with
// g = heads / kv_heads; k and v are cache buffers of `total_slots` rows of [kv_heads, d] floats.
// `sinks` [heads] (or null): each head's sink logit, one more term in the softmax's denominator
// (gpt-oss). Throws std::invalid_argument (before reading anything) on a slot outside
// [0, total_slots).
void attend_gqa_decode(ThreadPool& pool, const float* q, const float* k, const float* v, int64_t total_slots,
                       const int64_t* slots, int L, int heads, int kv_heads, int d, float scale, float* out,
                       const float* sinks = nullptr);

// The whole decode step of one sequence's attention after the projections: rotate q [heads, d]
// (in place) and k [kv_heads, d] by RoPE (rotate-half layout over the first `rotary` values of each
// head, cos/sin [rotary]; the rest pass as they are: partial rotary; 0: all d), store the rotated
// k and v in cache slot `write_slot`, then attend as attend_gqa_decode over `slots` (which includes it).
void rope_write_attend_gqa(ThreadPool& pool, float* q, float* k_new, const float* v_new, const float* cos,
                           const float* sin, float* k, float* v, int64_t total_slots, int64_t write_slot,
                           const int64_t* slots, int L, int heads, int kv_heads, int d, float scale, float* out,
                           const float* sinks = nullptr, int rotary = 0);

}  // namespace kt
