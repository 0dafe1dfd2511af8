// Question: on this machine, can a T=1 kernel whose arithmetic from cache runs at only 1.2-1.5x one core's
// stream hide that arithmetic under its reads from RAM, and what does the software prefetch give?
// A synthetic loop: one core reads a 1 GiB huge-page buffer line by line, doing W vpmaddubsw on each
// 32 bytes (W sets the compute rate; 'cache' is the same loop over 128 KiB), with a prefetch D bytes
// ahead, hint h (0 none, 1 t0, 2 t1, 3 nta). GB/s of the buffer.
//   g++ -O2 -mavx2 -o /tmp/overlap dev/overlap_synthetic.cpp && /tmp/overlap
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
static inline void pf(const char* p, int h) {
    if (h == 1) __asm__ volatile("prefetcht0 %0" : : "m"(*p));
    else if (h == 2) __asm__ volatile("prefetcht1 %0" : : "m"(*p));
    else if (h == 3) __asm__ volatile("prefetchnta %0" : : "m"(*p));
}
template <int W>
double run(const char* buf, size_t n, int D, int h, int reps) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
    const __m256i k = _mm256_set1_epi8(3);
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; r++)
        for (size_t i = 0; i < n; i += 64) {
            if (h) pf(buf + i + D, h);
            __m256i a = _mm256_load_si256((const __m256i*)(buf + i)), b = _mm256_load_si256((const __m256i*)(buf + i + 32));
            for (int w = 0; w < W; w++) {  // ~ the dot kernels' maddubs work per line
                a = _mm256_maddubs_epi16(a, k);
                b = _mm256_maddubs_epi16(b, k);
            }
            acc0 = _mm256_add_epi16(acc0, a); acc1 = _mm256_add_epi16(acc1, b);
        }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    volatile int sink = _mm256_extract_epi32(_mm256_add_epi16(acc0, acc1), 0); (void)sink;
    return (double)n * reps / s / 1e9;
}
template <int W> void row(char* big, size_t N, char* small, size_t S) {
    double c = run<W>(small, S, 0, 0, 2000);
    printf("W=%2d  cache %5.1f GB/s |", W, c);
    int hs[] = {0, 1, 2, 3};
    int ds[] = {1024, 4096, 8192};
    for (int h : hs) for (int d : ds) { if (!h && d != 1024) continue; double m = run<W>(big, N - 16384, d, h, 1); printf(" h%d/%d %5.1f", h, d, m); }
    printf("\n");
}
int main() {
    size_t N = (size_t)1 << 30, S = 128 << 10;
    char* big = (char*)mmap(nullptr, N, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(big, N, MADV_HUGEPAGE);
    memset(big, 1, N);
    char* small = (char*)aligned_alloc(64, S); memset(small, 1, S);
    row<0>(big, N, small, S); row<1>(big, N, small, S); row<2>(big, N, small, S); row<3>(big, N, small, S);
    row<4>(big, N, small, S); row<6>(big, N, small, S); row<8>(big, N, small, S);
}
