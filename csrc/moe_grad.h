// The routed experts' backward, for training with frozen experts (LoRA and the like elsewhere):
// given dy = dL/dy of the forward in moe.h, the gradients with respect to its input x and to the
// routing weights w:
//   g = G_e x + b_g, u = U_e x + b_u, h = act(g, u), o = D_e h + b_d,  y[t] = sum_k w[t,k] o
//   dw[t,k] = dy[t] . o = (D_e^T dy[t]) . h + dy[t] . b_d
//   dh = w[t,k] D_e^T dy[t];  dg, du = dh through act;  dx[t] = sum_k G_e^T dg + U_e^T du
// The weights are read as stored (GGML rows of blocks, decoded a run of blocks at a time; no
// tiled layouts), never copied or transposed. g and u are recomputed from x (no activations are
// kept from the forward: RAM stays at the scratch below, about (3 I + H) * 4 bytes a
// (token, expert) pair of a max_tokens chunk). All in float32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "moe.h"

namespace kt {

class MoEGrad {
  public:
    // Uses c's experts, top_k, hidden, intermediate, max_tokens, stored weights (gate/up/down with
    // their types and byte counts), biases and activation; throws std::invalid_argument naming
    // what does not fit (a tiled or undecodable type, too few bytes, sizes that overflow).
    MoEGrad(std::shared_ptr<Runtime> runtime, const MoEConfig& c);
    // x, dy [T, H] float32; ids [T, K] (-1: no expert in that slot), w [T, K] float32; writes
    // dx [T, H] and dw [T, K]. Runs on the calling thread with the runtime's pool, max_tokens
    // tokens at a time.
    void backward(int tokens, const int64_t* ids, const float* w, const float* x, const float* dy, float* dx, float* dw);

  private:
    void chunk(int tokens, const int64_t* ids, const float* w, const float* x, const float* dy, float* dx, float* dw);
    void activation_grad(int p, int i0, int i1, float wt);  // dg, du over columns [i0, i1) of pair p

    std::shared_ptr<Runtime> rt_;
    MoEConfig cfg_;
    size_t gate_row_ = 0, up_row_ = 0, down_row_ = 0;  // bytes per stored row
    int gate_elems_ = 0, up_elems_ = 0, down_elems_ = 0, gate_blk_ = 0, up_blk_ = 0, down_blk_ = 0;
    int i_step_ = 0, h_step_ = 0;  // column chunks of I (down's blocks) and H (gate's and up's) per task
    // [P, I]: g, then dg; u, then du; D^T dy, then h; [P, H]: each pair's dx; [P, I / i_step] dw parts
    std::vector<float> g_, u_, dhr_, dxp_, dwp_;
    std::vector<float> rows_;  // per pool thread: 2 rows of H (gate, up) and one run of down's blocks
    std::vector<int> pair_token_, pair_slot_, expert_start_, active_, fill_, slot_pair_;
};

}  // namespace kt
