// A streaming read of a buffer with every pool thread: the machine's memory-bandwidth ceiling,
// measured in the same run as the kernels it judges (bench.moe).
#include <cstdint>
#include <algorithm>
#include <vector>

#include "moe.h"  // (declares xor_bytes)
#include "pool.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kt {

uint64_t xor_bytes(const uint8_t* p, size_t n) {
    uint64_t sum = 0;
    size_t i = 0;
#if defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i*)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i*)(p + i + 96)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i*)lanes, _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
    sum = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#endif
    for (; i < n; i++) sum ^= p[i];
    return sum;
}

uint64_t stream_checksum(ThreadPool& pool, const uint8_t* data, size_t bytes) {
    constexpr size_t kChunk = 1 << 20;
    const int chunks = (int)((bytes + kChunk - 1) / kChunk);
    std::vector<uint64_t> partial(pool.size(), 0);
    pool.parallel_for(chunks, [&](int c, int thread) {
        partial[thread] ^= xor_bytes(data + (size_t)c * kChunk, std::min(kChunk, bytes - (size_t)c * kChunk));
    });
    uint64_t total = 0;
    for (uint64_t v : partial) total ^= v;
    return total;
}

}  // namespace kt
