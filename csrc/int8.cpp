// The int8 prefill GEMM: 4 weight rows x 4 token rows per step (16 accumulators), int32 accumulators over the
// whole row (|sum| <= k * 127 * 255 fits in int32 for k < 66,000), scales applied once at the end.
#include "int8.h"

#include <algorithm>
#include <cmath>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KT_INT8_GEMM 1
#endif

namespace kt {

bool int8_gemm_available() {
#if defined(KT_INT8_GEMM)
    return true;
#else
    return false;
#endif
}

float quantize_row_u8(const float* x, uint8_t* out, int n) {
    float amax = 0;
    for (int i = 0; i < n; i++) amax = std::max(amax, std::fabs(x[i]));
    const float s = amax / 127.f, inv = s ? 1.f / s : 0.f;
    for (int i = 0; i < n; i++) out[i] = (uint8_t)((int)std::nearbyint(x[i] * inv) + 128);
    return s;
}

#if defined(KT_INT8_GEMM)
namespace {
template <int R, int T>
inline void block(const int8_t* const* w, const uint8_t* const* x, int k, int32_t out[R][T]) {
    __m512i acc[R][T];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_si512();
    for (int i = 0; i < k; i += 64) {
        __m512i wv[R];
        for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_si512((const void*)(w[r] + i));
        for (int t = 0; t < T; t++) {
            const __m512i xv = _mm512_loadu_si512((const void*)(x[t] + i));
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], xv, wv[r]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) out[r][t] = _mm512_reduce_add_epi32(acc[r][t]);
}

template <int R, int T>
inline void store(const Int8Weights& w, int r, const float* sx, const int32_t sums[R][T], float* out, size_t stride,
                  int t0) {
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++)
            out[(size_t)(t0 + j) * stride + (r + i)] =
                (float)(sums[i][j] - 128 * w.row_sum[r + i]) * w.scale[r + i] * sx[t0 + j];
}

template <int R, int T>
inline void step(const Int8Weights& w, int k, int r, int t, const uint8_t* const* xs, const float* sx, float* out,
                 size_t stride) {
    const int8_t* rows[R];
    for (int i = 0; i < R; i++) rows[i] = w.w + (size_t)(r + i) * k;
    int32_t sums[R][T];
    block<R, T>(rows, xs + t, k, sums);
    store<R, T>(w, r, sx, sums, out, stride, t);
}
}  // namespace
#endif

void int8_rows(const Int8Weights& w, int k, int r0, int r1, const uint8_t* const* xs, const float* sx, int count,
               float* out, size_t out_stride) {
#if defined(KT_INT8_GEMM)
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        int t = 0;
        for (; t + 4 <= count; t += 4) step<4, 4>(w, k, r, t, xs, sx, out, out_stride);
        for (; t < count; t++) step<4, 1>(w, k, r, t, xs, sx, out, out_stride);
    }
    for (; r + 2 <= r1; r += 2) {
        int t = 0;
        for (; t + 4 <= count; t += 4) step<2, 4>(w, k, r, t, xs, sx, out, out_stride);
        for (; t < count; t++) step<2, 1>(w, k, r, t, xs, sx, out, out_stride);
    }
    for (; r < r1; r++) {
        int t = 0;
        for (; t + 4 <= count; t += 4) step<1, 4>(w, k, r, t, xs, sx, out, out_stride);
        for (; t < count; t++) step<1, 1>(w, k, r, t, xs, sx, out, out_stride);
    }
#else
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < count; t++) {
            const int8_t* row = w.w + (size_t)r * k;
            int32_t sum = 0;
            for (int i = 0; i < k; i++) sum += row[i] * (int)xs[t][i];
            out[(size_t)t * out_stride + r] = (float)(sum - 128 * w.row_sum[r]) * w.scale[r] * sx[t];
        }
#endif
}

}  // namespace kt
