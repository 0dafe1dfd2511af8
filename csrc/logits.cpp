#include "logits.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace kt {

void mask_logits(void* logits, bool bf16, int64_t logit_rows, int64_t row_stride, int64_t vocab, const int64_t* rows,
                 int64_t n_rows, const int32_t* words, int64_t words_per_row) {
    if (vocab < 0 || n_rows < 0 || logit_rows < 0 || row_stride < vocab || words_per_row < 0)
        throw std::invalid_argument("mask_logits: negative sizes, or rows shorter than the vocabulary");
    for (int64_t j = 0; j < n_rows; j++)
        if (rows[j] < 0 || rows[j] >= logit_rows)
            throw std::invalid_argument("mask_logits: row " + std::to_string(rows[j]) + " is outside the logits' " +
                                        std::to_string(logit_rows) + " rows");
    if (words_per_row * 32 < vocab)
        throw std::invalid_argument("mask_logits: a bitmask row of " + std::to_string(words_per_row) +
                                    " words covers fewer than the " + std::to_string(vocab) + " tokens");
    const float never = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n_rows; j++) {
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(words) + j * words_per_row;
        const int64_t at = rows[j] * row_stride;
        for (int64_t w = 0; w * 32 < vocab; w++) {
            const uint32_t allowed = bits[w];
            if (allowed == 0xffffffffu) continue;
            const int64_t end = w * 32 + 32 < vocab ? w * 32 + 32 : vocab;
            for (int64_t t = w * 32; t < end; t++) {
                if ((allowed >> (t - w * 32)) & 1u) continue;
                if (bf16) static_cast<uint16_t*>(logits)[at + t] = 0xff80;  // (bfloat16 -inf)
                else static_cast<float*>(logits)[at + t] = never;
            }
        }
    }
}

}  // namespace kt
