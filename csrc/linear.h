// y[T, O] = x[T, I] @ W[O, I]^T with W in a GGML format as stored (lm_head, dense and shared MLPs).
#pragma once
#include <memory>
#include <vector>

#include "moe.h"

namespace kt {

class Linear {
  public:
    Linear(std::shared_ptr<Runtime> runtime, int in_features, int out_features, int type, const void* weight,
           size_t weight_bytes, int max_tokens, Bf16Kernel bf16 = Bf16Kernel::Amx);  // bf16: as MoEConfig::bf16
    void forward(int tokens, const void* x, void* y, Dtype dtype);  // submit + sync
    void submit(int tokens, const void* x, void* y, Dtype dtype);

  private:
    void run(int tokens, const void* x, void* y, Dtype dtype);
    std::shared_ptr<Runtime> rt_;
    int in_, out_, max_tokens_;
    const Format* fmt_;
    const uint8_t* w_;
    size_t row_, act_;
    size_t off_act_ = 0;  // scratch: [T, I] floats, then [T] prepared rows
};

}  // namespace kt
