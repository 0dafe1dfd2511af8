// Grammar masks on the CPU (engine/grammar.py): rows of a step's logits set to -inf where a
// packed bitmask has a 0 (bit t % 32 of word t / 32: token t allowed; llguidance's layout).
#pragma once
#include <cstdint>

namespace kt {

// Row rows[j] of logits [logit_rows, row_stride] (float32, or bfloat16 with `bf16`) by bitmask row
// j of words [n_rows, words_per_row], over the first `vocab` columns. Throws std::invalid_argument
// (before writing anything) where a row index is out of range, the bitmask is narrower than the
// vocabulary or a size is negative.
void mask_logits(void* logits, bool bf16, int64_t logit_rows, int64_t row_stride, int64_t vocab, const int64_t* rows,
                 int64_t n_rows, const int32_t* words, int64_t words_per_row);

}  // namespace kt
