// Decode attention over the paged cache: the history is read in place by slot (no gathered copy),
// one task per kv head (its g query heads share every key and value row they read).
#include "attention.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kt {

namespace {
inline void axpy(float a, const float* x, float* y, int n) {  // y += a * x
    int i = 0;
#if defined(__AVX512F__)
    const __m512 va16 = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va16, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
#if defined(__AVX2__)
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

// softmax of s[0..L) in place (max-subtracted), returns nothing: s sums to 1 afterwards
void softmax_inplace(float* s, int L) {
    float m = -INFINITY;
    for (int j = 0; j < L; j++) m = std::max(m, s[j]);
    int j = 0;
    float sum = 0;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    for (; j + 8 <= L; j += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum_f32(acc);
#endif
    for (; j < L; j++) sum += (s[j] = std::exp(s[j] - m));
    const float inv = 1.f / sum;
    for (j = 0; j < L; j++) s[j] *= inv;
}

void check_gqa(const char* op, int64_t total_slots, const int64_t* slots, int L, int heads, int kv_heads, int d) {
    if (L <= 0 || heads <= 0 || kv_heads <= 0 || d <= 0 || heads % kv_heads)
        throw std::invalid_argument(std::string(op) + ": need L, d > 0 and heads a positive multiple of kv_heads");
    for (int j = 0; j < L; j++)
        if (slots[j] < 0 || slots[j] >= total_slots)
            throw std::invalid_argument(std::string(op) + ": slot " + std::to_string(slots[j]) + " at position " +
                                        std::to_string(j) + " is outside the cache's " + std::to_string(total_slots));
}

// The attention itself, arguments already checked. Per kv head: its g query heads are scored
// against each key row while the row is in L1, then each value row is added into the g outputs;
// the scores of a head are a softmax over its L keys.
void attend(ThreadPool& pool, const float* q, const float* k, const float* v, const int64_t* slots, int L, int heads,
            int kv_heads, int d, float scale, float* out) {
    const int g = heads / kv_heads;
    const size_t row = (size_t)kv_heads * d;  // floats per cache slot
    pool.parallel_for(kv_heads, [&](int kvh, int) {
        thread_local std::vector<float> scores;
        scores.resize((size_t)g * L);
        const float* qg = q + (size_t)kvh * g * d;
        for (int j = 0; j < L; j++) {
            const float* kr = k + (size_t)slots[j] * row + (size_t)kvh * d;
            for (int i = 0; i < g; i++) scores[(size_t)i * L + j] = fdot(qg + (size_t)i * d, kr, d) * scale;
        }
        for (int i = 0; i < g; i++) softmax_inplace(&scores[(size_t)i * L], L);
        float* og = out + (size_t)kvh * g * d;
        std::fill(og, og + (size_t)g * d, 0.f);
        for (int j = 0; j < L; j++) {
            const float* vr = v + (size_t)slots[j] * row + (size_t)kvh * d;
            for (int i = 0; i < g; i++) axpy(scores[(size_t)i * L + j], vr, og + (size_t)i * d, d);
        }
    });
}

void rope_rows(float* x, int rows, const float* cos, const float* sin, int d) {
    const int half = d / 2;
    for (int r = 0; r < rows; r++, x += d)
        for (int i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
}

}  // namespace

void attend_gqa_decode(ThreadPool& pool, const float* q, const float* k, const float* v, int64_t total_slots,
                       const int64_t* slots, int L, int heads, int kv_heads, int d, float scale, float* out) {
    check_gqa("attend_gqa_decode", total_slots, slots, L, heads, kv_heads, d);
    attend(pool, q, k, v, slots, L, heads, kv_heads, d, scale, out);
}


void rope_write_attend_gqa(ThreadPool& pool, float* q, float* k_new, const float* v_new, const float* cos,
                           const float* sin, float* k, float* v, int64_t total_slots, int64_t write_slot,
                           const int64_t* slots, int L, int heads, int kv_heads, int d, float scale, float* out) {
    if (write_slot < 0 || write_slot >= total_slots)
        throw std::invalid_argument("rope_write_attend_gqa: write slot " + std::to_string(write_slot) +
                                    " is outside the cache's " + std::to_string(total_slots));
    if (d % 2) throw std::invalid_argument("rope_write_attend_gqa: head_dim must be even");
    check_gqa("rope_write_attend_gqa", total_slots, slots, L, heads, kv_heads, d);  // all before any write
    rope_rows(q, heads, cos, sin, d);
    rope_rows(k_new, kv_heads, cos, sin, d);
    const size_t row = (size_t)kv_heads * d;
    std::copy(k_new, k_new + row, k + (size_t)write_slot * row);
    std::copy(v_new, v_new + row, v + (size_t)write_slot * row);
    attend(pool, q, k, v, slots, L, heads, kv_heads, d, scale, out);
}

}  // namespace kt
