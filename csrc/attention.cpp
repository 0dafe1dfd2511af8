// Decode attention over the paged cache: the history is read in place by slot (no gathered copy),
// split over the history's positions (every head per task), the parts merged by log-sum-exp.
#include "attention.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
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

void check_gqa(const char* op, int64_t total_slots, const int64_t* slots, int L, int heads, int kv_heads, int d) {
    if (L <= 0 || heads <= 0 || kv_heads <= 0 || d <= 0 || heads % kv_heads)
        throw std::invalid_argument(std::string(op) + ": need L, d > 0 and heads a positive multiple of kv_heads");
    for (int j = 0; j < L; j++)
        if (slots[j] < 0 || slots[j] >= total_slots)
            throw std::invalid_argument(std::string(op) + ": slot " + std::to_string(slots[j]) + " at position " +
                                        std::to_string(j) + " is outside the cache's " + std::to_string(total_slots));
}

// The attention itself, arguments already checked. The history is cut into chunks of
// consecutive positions, one task each, so that a thread streams whole cache rows (every kv
// head of a slot, contiguous within a page): per chunk, every head's scores, their softmax
// against the chunk's own max, and the weighted sum of the values; the chunks' partial results
// are then merged by their log-sum-exp (as flash decoding does across thread blocks).
constexpr int kChunk = 64;  // positions per task

#if defined(__AVX2__)
// the sums of a0..a7's lanes, as one vector [sum a0, ..., sum a7]
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[h] = q_h . k_(h/g) * scale for heads h0..h0+7 against one cache row (d a multiple of 8)
inline void score8(const float* q, const float* kr, int h0, int g, int d, float scale, float* s) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8)
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)(h0 + i) * d + c),
                                     _mm256_loadu_ps(kr + (size_t)((h0 + i) / g) * d + c), acc[i]);
    _mm256_storeu_ps(s, _mm256_mul_ps(hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]),
                                      _mm256_set1_ps(scale)));
}

// the same for two cache rows at once: each query vector loaded once for both
inline void score8x2(const float* q, const float* kr0, const float* kr1, int h0, int g, int d, float scale, float* s0,
                     float* s1) {
    __m256 a0[8], a1[8];
    size_t off[8];
    for (int i = 0; i < 8; i++) a0[i] = a1[i] = _mm256_setzero_ps(), off[i] = (size_t)((h0 + i) / g) * d;
    for (int c = 0; c < d; c += 8)
        for (int i = 0; i < 8; i++) {
            const __m256 qv = _mm256_loadu_ps(q + (size_t)(h0 + i) * d + c);
            a0[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr0 + off[i] + c), a0[i]);
            a1[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr1 + off[i] + c), a1[i]);
        }
    const __m256 sc = _mm256_set1_ps(scale);
    _mm256_storeu_ps(s0, _mm256_mul_ps(hsum8(a0[0], a0[1], a0[2], a0[3], a0[4], a0[5], a0[6], a0[7]), sc));
    _mm256_storeu_ps(s1, _mm256_mul_ps(hsum8(a1[0], a1[1], a1[2], a1[3], a1[4], a1[5], a1[6], a1[7]), sc));
}

// acc[c0..c0+64) += sum_j p[j * stride] * v_j[c0..c0+64) over n rows (64 floats of accumulators in registers)
inline void weighted_rows64(const float* p, int stride, const float* const* rows, int n, float* acc) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int j = 0; j < n; j++) {
        const __m256 w = _mm256_set1_ps(p[(size_t)j * stride]);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[j] + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
}
#endif

#if defined(__AVX2__)
// Grouped-query heads (g a multiple of 4; d of 32 at AVX-512, of 16 at AVX2): per kv head the
// scores of its g heads are a small GEMM, scores [rows, g] = K [rows, d] . Q_g^T, taken HT (8 or 4)
// heads x R rows a tile with the queries transposed (qt [d, heads]): per column one query vector
// and one broadcast key value per row, R independent accumulators and no horizontal sums (256-bit
// registers at both levels). rows[r]: row r's key, at its kv head.
template <int R, int HT>
inline void score_tile(const float* qt, int heads, const float* const* rows, int d, int h0, float scale, float* s) {
    if constexpr (HT == 8) {
        __m256 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int c = 0; c < d; c++) {
            const __m256 qv = _mm256_loadu_ps(qt + (size_t)c * heads + h0);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(rows[r] + c), acc[r]);
        }
        const __m256 sc = _mm256_set1_ps(scale);
        for (int r = 0; r < R; r++) _mm256_storeu_ps(s + (size_t)r * heads + h0, _mm256_mul_ps(acc[r], sc));
    } else {
        static_assert(HT == 4, "score tiles are 8 or 4 heads wide");
        __m128 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm_setzero_ps();
        for (int c = 0; c < d; c++) {
            const __m128 qv = _mm_loadu_ps(qt + (size_t)c * heads + h0);
            for (int r = 0; r < R; r++) acc[r] = _mm_fmadd_ps(qv, _mm_broadcast_ss(rows[r] + c), acc[r]);
        }
        const __m128 sc = _mm_set1_ps(scale);
        for (int r = 0; r < R; r++) _mm_storeu_ps(s + (size_t)r * heads + h0, _mm_mul_ps(acc[r], sc));
    }
}

// The weighted sum of the values, the GEMM out [g, d] = P^T V per kv head, HT heads x kValueCols
// columns a tile (2 HT accumulators): acc[h0 + i, c0..c0+kValueCols) = sum_j p[j, h0 + i] *
// rows[j][c0..c0+kValueCols). 512-bit: 8 or 4 heads x 32 columns; 256-bit: 4 heads x 16 columns
// (8 accumulators within AVX2's 16 registers: 8 heads would spill).
#if defined(__AVX512F__)
using vf = __m512;
constexpr int kLanes = 16, kValueHeads = 8;
inline vf vf_zero() { return _mm512_setzero_ps(); }
inline vf vf_load(const float* x) { return _mm512_loadu_ps(x); }
inline vf vf_bcast(const float* x) { return _mm512_set1_ps(*x); }
inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline void vf_store(float* y, vf v) { _mm512_storeu_ps(y, v); }
#else
using vf = __m256;
constexpr int kLanes = 8, kValueHeads = 4;
inline vf vf_zero() { return _mm256_setzero_ps(); }
inline vf vf_load(const float* x) { return _mm256_loadu_ps(x); }
inline vf vf_bcast(const float* x) { return _mm256_broadcast_ss(x); }
inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline void vf_store(float* y, vf v) { _mm256_storeu_ps(y, v); }
#endif
constexpr int kValueCols = 2 * kLanes;

template <int HT>
inline void value_tile(const float* p, int heads, const float* const* rows, int n, int h0, int c0, int d, float* acc) {
    static_assert(HT == 4 || HT == kValueHeads, "value tiles are 4 heads wide, or kValueHeads");
    vf a[HT][2];
    for (int i = 0; i < HT; i++) a[i][0] = a[i][1] = vf_zero();
    for (int j = 0; j < n; j++) {
        const vf v0 = vf_load(rows[j] + c0), v1 = vf_load(rows[j] + c0 + kLanes);
        const float* pj = p + (size_t)j * heads + h0;
        for (int i = 0; i < HT; i++) {
            const vf w = vf_bcast(pj + i);
            a[i][0] = vf_fma(w, v0, a[i][0]);
            a[i][1] = vf_fma(w, v1, a[i][1]);
        }
    }
    for (int i = 0; i < HT; i++) {
        vf_store(acc + (size_t)(h0 + i) * d + c0, a[i][0]);
        vf_store(acc + (size_t)(h0 + i) * d + c0 + kLanes, a[i][1]);
    }
}

// g = 12 (GLM-4.5-Air's 96/8 heads) as one 8-head and one 4-head score tile a kv head
inline bool grouped_tiles(int g, int d) { return g % 4 == 0 && d % kValueCols == 0; }
#else
inline bool grouped_tiles(int, int) { return false; }
#endif

// softmax of the scores s [n, heads] per head against the chunk's own max: s <- e^(s - max), and
// each head's max and sum
void chunk_softmax(float* s, int n, int heads, float* mx, float* sum) {
#if defined(__AVX2__)
    for (int h = 0; h + 8 <= heads; h += 8) {  // 8 heads at a time: max, then e^(s - max) and its sum
        __m256 m = _mm256_set1_ps(-INFINITY), t = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) m = _mm256_max_ps(m, _mm256_loadu_ps(s + (size_t)j * heads + h));
        for (int j = 0; j < n; j++) {
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + (size_t)j * heads + h), m));
            _mm256_storeu_ps(s + (size_t)j * heads + h, e);
            t = _mm256_add_ps(t, e);
        }
        _mm256_storeu_ps(mx + h, m);
        _mm256_storeu_ps(sum + h, t);
    }
    for (int h = heads / 8 * 8; h < heads; h++) {
#else
    for (int h = 0; h < heads; h++) {
#endif
        float m = -INFINITY;
        for (int j = 0; j < n; j++) m = std::max(m, s[(size_t)j * heads + h]);
        float t = 0;
        for (int j = 0; j < n; j++) t += (s[(size_t)j * heads + h] = std::exp(s[(size_t)j * heads + h] - m));
        mx[h] = m;
        sum[h] = t;
    }
}

#if defined(__AVX2__)
// attend_chunk for grouped_tiles(g, d): the two GEMMs above per kv head
void attend_chunk_grouped(const float* qt, const float* k, const float* v, const int64_t* slots, int n, int heads,
                          int g, int d, float scale, float* s, float* acc, float* mx, float* sum) {
    const size_t row = (size_t)(heads / g) * d;
    const float* rows[kChunk];
    // Rows a tile at a time, every kv head of a row together: the cache is read in slot order
    // (whole rows, as stored) and the same rows' values are prefetched for the second GEMM: with
    // the cache cold, as in a model step, whole rows stream where kv head by kv head would stride.
    int j = 0;
    auto tile = [&](auto rows_in_tile) {
        constexpr int R = decltype(rows_in_tile)::value;
        for (int r = 0; r < R; r++) {
            const char* vr = (const char*)(v + (size_t)slots[j + r] * row);
            for (size_t b = 0; b < row * sizeof(float); b += 64) _mm_prefetch(vr + b, _MM_HINT_T0);
        }
        for (int kvh = 0; kvh < heads / g; kvh++) {
            const float* kr[R];
            for (int r = 0; r < R; r++) kr[r] = k + (size_t)slots[j + r] * row + (size_t)kvh * d;
            for (int h0 = kvh * g, end = (kvh + 1) * g; h0 < end; h0 += h0 + 8 <= end ? 8 : 4) {
                if (h0 + 8 <= end) score_tile<R, 8>(qt, heads, kr, d, h0, scale, s + (size_t)j * heads);
                else score_tile<R, 4>(qt, heads, kr, d, h0, scale, s + (size_t)j * heads);
            }
        }
        j += R;
    };
    while (j + 8 <= n) tile(std::integral_constant<int, 8>());
    while (j < n) tile(std::integral_constant<int, 1>());
    chunk_softmax(s, n, heads, mx, sum);
    for (int kvh = 0; kvh < heads / g; kvh++) {
        for (int r = 0; r < n; r++) rows[r] = v + (size_t)slots[r] * row + (size_t)kvh * d;
        for (int h0 = kvh * g, end = (kvh + 1) * g; h0 < end;) {
            const bool wide = h0 + kValueHeads <= end;  // (at AVX2 both tiles are 4 heads)
            for (int c0 = 0; c0 < d; c0 += kValueCols) {
                if (wide) value_tile<kValueHeads>(s, heads, rows, n, h0, c0, d, acc);
                else value_tile<4>(s, heads, rows, n, h0, c0, d, acc);
            }
            h0 += wide ? kValueHeads : 4;
        }
    }
}
#endif

// One chunk of positions: scores s [n, heads] (row j: every head against slot j), softmax against
// the chunk's max per head (mx, sum), acc [heads, d] = the weighted sum of the values.
void attend_chunk(const float* q, const float* k, const float* v, const int64_t* slots, int n, int heads, int g,
                  int d, float scale, float* s, float* acc, float* mx, float* sum) {
    const size_t row = (size_t)(heads / g) * d;
    const float* rows[kChunk];
    for (int j = 0; j < n; j++) rows[j] = k + (size_t)slots[j] * row;
    int h_vec = 0;
#if defined(__AVX2__)
    const bool vec = d % 64 == 0;
    if (vec) h_vec = heads / 8 * 8;
    int j = 0;
    for (; j + 2 <= n; j += 2)
        for (int h = 0; h < h_vec; h += 8)
            score8x2(q, rows[j], rows[j + 1], h, g, d, scale, s + (size_t)j * heads + h, s + (size_t)(j + 1) * heads + h);
    for (; j < n; j++)
        for (int h = 0; h < h_vec; h += 8) score8(q, rows[j], h, g, d, scale, s + (size_t)j * heads + h);
#endif
    for (int j = 0; j < n; j++)
        for (int h = h_vec; h < heads; h++)
            s[(size_t)j * heads + h] = fdot(q + (size_t)h * d, rows[j] + (size_t)(h / g) * d, d) * scale;
    chunk_softmax(s, n, heads, mx, sum);
    std::fill(acc, acc + (size_t)heads * d, 0.f);
    for (int j = 0; j < n; j++) rows[j] = v + (size_t)slots[j] * row;
#if defined(__AVX2__)
    if (vec) {  // per kv head and 64 columns: its rows stay in L1 while its g heads sum them
        for (int kvh = 0; kvh < heads / g; kvh++)
            for (int c0 = 0; c0 < d; c0 += 64) {
                const float* part[kChunk];
                for (int j = 0; j < n; j++) part[j] = rows[j] + (size_t)kvh * d + c0;
                for (int h = kvh * g; h < (kvh + 1) * g; h++) weighted_rows64(s + h, heads, part, n, acc + (size_t)h * d + c0);
            }
        return;
    }
#endif
    for (int j = 0; j < n; j++)
        for (int h = 0; h < heads; h++) axpy(s[(size_t)j * heads + h], rows[j] + (size_t)(h / g) * d, acc + (size_t)h * d, d);
}

void attend(ThreadPool& pool, const float* q, const float* k, const float* v, const int64_t* slots, int L, int heads,
            int kv_heads, int d, float scale, float* out, const float* sinks) {
    const int g = heads / kv_heads;
    const int chunks = (L + kChunk - 1) / kChunk;
    const size_t part = (size_t)heads * (d + 2);  // per chunk: acc [heads, d], max [heads], sum [heads]
    thread_local std::vector<float> parts;  // the calling thread's; tasks write disjoint chunks of it
    parts.resize((size_t)chunks * part);
    float* all = parts.data();
    thread_local std::vector<float> qt;  // the queries transposed [d, heads], for the grouped tiles
    const bool grouped = grouped_tiles(g, d);
    if (grouped) {
        qt.resize((size_t)d * heads);
        for (int h = 0; h < heads; h++)
            for (int c = 0; c < d; c++) qt[(size_t)c * heads + h] = q[(size_t)h * d + c];
    }
    const float* q_t = qt.data();  // (a thread_local named inside the tasks would be each worker's own)
    pool.parallel_for(chunks, [&](int c, int) {
        thread_local std::vector<float> scores;
        scores.resize((size_t)heads * kChunk);
        const int j0 = c * kChunk, n = std::min(kChunk, L - j0);
        float* acc = all + (size_t)c * part;
        float *mx = acc + (size_t)heads * d, *sum = mx + heads;
#if !defined(__AVX2__)
        (void)q_t;
#else
        if (grouped) {
            attend_chunk_grouped(q_t, k, v, slots + j0, n, heads, g, d, scale, scores.data(), acc, mx, sum);
            return;
        }
#endif
        attend_chunk(q, k, v, slots + j0, n, heads, g, d, scale, scores.data(), acc, mx, sum);
    });
    // merge: out = sum_c e^(m_c - M) acc_c / (sum_c e^(m_c - M) l_c [+ e^(sink - M)])
    for (int h = 0; h < heads; h++) {
        float M = sinks ? sinks[h] : -INFINITY;
        for (int c = 0; c < chunks; c++) M = std::max(M, all[(size_t)c * part + (size_t)heads * d + h]);
        float* oh = out + (size_t)h * d;
        std::fill(oh, oh + d, 0.f);
        float total = sinks ? std::exp(sinks[h] - M) : 0.f;
        for (int c = 0; c < chunks; c++) {
            const float* pc = all + (size_t)c * part;
            const float w = std::exp(pc[(size_t)heads * d + h] - M);
            total += w * pc[(size_t)heads * d + heads + h];
            axpy(w, pc + (size_t)h * d, oh, d);
        }
        const float inv = 1.f / total;
        for (int i = 0; i < d; i++) oh[i] *= inv;
    }
}

// rows of d values, the first `rotary` of each rotated (rotate-half pairs i, i + rotary / 2)
void rope_rows(float* x, int rows, const float* cos, const float* sin, int d, int rotary) {
    const int half = rotary / 2;
    for (int r = 0; r < rows; r++, x += d)
        for (int i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
}

}  // namespace

void attend_gqa_decode(ThreadPool& pool, const float* q, const float* k, const float* v, int64_t total_slots,
                       const int64_t* slots, int L, int heads, int kv_heads, int d, float scale, float* out,
                       const float* sinks) {
    check_gqa("attend_gqa_decode", total_slots, slots, L, heads, kv_heads, d);
    attend(pool, q, k, v, slots, L, heads, kv_heads, d, scale, out, sinks);
}


void rope_write_attend_gqa(ThreadPool& pool, float* q, float* k_new, const float* v_new, const float* cos,
                           const float* sin, float* k, float* v, int64_t total_slots, int64_t write_slot,
                           const int64_t* slots, int L, int heads, int kv_heads, int d, float scale, float* out,
                           const float* sinks, int rotary) {
    if (write_slot < 0 || write_slot >= total_slots)
        throw std::invalid_argument("rope_write_attend_gqa: write slot " + std::to_string(write_slot) +
                                    " is outside the cache's " + std::to_string(total_slots));
    if (rotary == 0) rotary = d;
    if (rotary % 2 || rotary < 0 || rotary > d)
        throw std::invalid_argument("rope_write_attend_gqa: the rotated part of a head (" + std::to_string(rotary) +
                                    ") must be even and at most head_dim (" + std::to_string(d) + ")");
    check_gqa("rope_write_attend_gqa", total_slots, slots, L, heads, kv_heads, d);  // all before any write
    rope_rows(q, heads, cos, sin, d, rotary);
    rope_rows(k_new, kv_heads, cos, sin, d, rotary);
    const size_t row = (size_t)kv_heads * d;
    std::copy(k_new, k_new + row, k + (size_t)write_slot * row);
    std::copy(v_new, v_new + row, v + (size_t)write_slot * row);
    attend(pool, q, k, v, slots, L, heads, kv_heads, d, scale, out, sinks);
}

}  // namespace kt
