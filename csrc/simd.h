// Small SIMD helpers shared by the kernels (header-only: each ISA build compiles its own copy).
#pragma once
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kt {

#if defined(__AVX2__)
inline float hsum_f32(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// sum a[i] * b[i] over n floats, in independent accumulators (one would wait on each FMA's latency)
inline float fdot(const float* a, const float* b, int n) {
    int i = 0;
    float s = 0;
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
#if defined(__AVX2__)
    __m256 acc2 = _mm256_setzero_ps(), acc3 = acc2;
    for (; i + 16 <= n; i += 16) {
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc3);
    }
    s += hsum_f32(_mm256_add_ps(acc2, acc3));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#if defined(__AVX2__)
// e^x for x in float range, ~1 ulp: 2^(x log2 e) split into an integer power and a degree-6
// polynomial of the fraction (the classic range reduction).
inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_fmsub_ps(k, _mm256_set1_ps(0.693359375f), x);             // k ln2 (hi) - x
    const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), _mm256_sub_ps(_mm256_setzero_ps(), f));  // x - k ln2
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 1 / (1 + e^-v)
inline __m256 sigmoid_ps(__m256 v) {
    const __m256 one = _mm256_set1_ps(1.f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}

#endif

}  // namespace kt
