// Size products with overflow checks: a size computed from caller-given dimensions that wraps
// size_t would pass a byte-count check and let a kernel read past its buffer.
#pragma once
#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace kt {

// The product of `factors` (each >= 0), or std::invalid_argument naming `what` where it overflows.
inline size_t checked_product(const char* what, std::initializer_list<size_t> factors) {
    size_t p = 1;
    for (size_t f : factors)
        if (__builtin_mul_overflow(p, f, &p)) throw std::invalid_argument(std::string(what) + ": the size overflows 64 bits");
    return p;
}

// The sum of `terms`, or std::invalid_argument naming `what` where it overflows.
inline size_t checked_sum(const char* what, std::initializer_list<size_t> terms) {
    size_t s = 0;
    for (size_t t : terms)
        if (__builtin_add_overflow(s, t, &s)) throw std::invalid_argument(std::string(what) + ": the size overflows 64 bits");
    return s;
}

}  // namespace kt
