// The routed experts' backward, for training with frozen experts (LoRA and the like elsewhere):
// given dy = dL/dy of the forward in moe.h, the gradients with respect to its input x and to the
// routing weights w:
//   g = G_e x + b_g, u = U_e x + b_u, h = act(g, u), o = D_e h + b_d,  y[t] = sum_k w[t,k] o
//   dw[t,k] = dy[t] . o = (D_e^T dy[t]) . h + dy[t] . b_d
//   dh = w[t,k] D_e^T dy[t];  dg, du = dh through act;  dx[t] = sum_k G_e^T dg + U_e^T du
// The weights are read as stored (GGML rows of blocks, decoded a run of blocks at a time; no
// tiled layouts), never copied or transposed. g and u are recomputed from x (no activations are
// kept from the forward: RAM stays at the scratch, about (3 I + H) * 4 bytes a (token, expert)
// pair of a max_tokens chunk, in the runtime's arena that every layer shares). All in float32.
// With int8 copies (MoEGradInt8: the forward's gate and up, and the transposed D^T, G^T and
// U^T, re-quantized once by the caller) the three products run on the int8 GEMM (VNNI, AMX or
// AVX2's vpmaddubsw) instead, activations rounded to int8 per row as the forward's are.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "moe.h"

namespace kt {

struct MoEGradInt8 {
    Int8Weights gate, up;        // [E, I, H]
    Int8Weights down_t;          // [E, I, H]: D^T
    Int8Weights gate_t, up_t;    // [E, H, I]: G^T, U^T (apart: dg and du get a scale each)
    bool set() const { return gate.w && up.w && down_t.w && gate_t.w && up_t.w; }
};

class MoEGrad {
  public:
    // Uses c's experts, top_k, hidden, intermediate, max_tokens, stored weights (gate/up/down with
    // their types and byte counts), biases and activation; throws std::invalid_argument naming
    // what does not fit (a tiled or undecodable type, too few bytes, sizes that overflow).
    MoEGrad(std::shared_ptr<Runtime> runtime, const MoEConfig& c, const MoEGradInt8& int8 = {});
    bool int8() const { return q_.set(); }
    // x, dy [T, H] float32; ids [T, K] (-1: no expert in that slot), w [T, K] float32; writes
    // dx [T, H] and dw [T, K]. Runs on the calling thread with the runtime's pool, max_tokens
    // tokens at a time.
    void backward(int tokens, const int64_t* ids, const float* w, const float* x, const float* dy, float* dx, float* dw);

  private:
    void chunk(int tokens, const int64_t* ids, const float* w, const float* x, const float* dy, float* dx, float* dw);
    void activation_grad(int p, int i0, int i1, float wt);  // dg, du over columns [i0, i1) of pair p
    // rows [r0, r1) of expert e's int8 matrix `all` (rows x k) against pairs p0..p1's int8 rows
    // (act + p or its token's row, k bytes apart): out[p * stride + r]
    void int8_pairs(const Int8Weights& all, int rows, int k, int e, int r0, int r1, int p0, int p1,
                    const uint8_t* act, const float* scale, bool by_token, float* out, size_t stride) const;
    void quantize_inputs(int tokens, const float* x, const float* dy);  // x, dy -> int8 rows (int8 mode)
    void group(int tokens, const int64_t* ids);  // the (token, expert) pairs by expert
    // expert e's columns [i0, i1) of I: g, u, D^T dy, then dw's part and dg, du (int8 copies / stored blocks)
    void inner_int8(int e, int i0, int i1, const float* w);
    void inner_blocks(int e, int i0, int i1, const float* w, const float* x, const float* dy, float* buf);
    void outer_blocks(int e, int c0, int c1, float* buf);  // each pair's dx over columns [c0, c1) of H

    std::shared_ptr<Runtime> rt_;
    MoEConfig cfg_;
    size_t gate_row_ = 0, up_row_ = 0, down_row_ = 0;  // bytes per stored row
    int gate_elems_ = 0, up_elems_ = 0, down_elems_ = 0, gate_blk_ = 0, up_blk_ = 0, down_blk_ = 0;
    int i_step_ = 0, h_step_ = 0;  // column chunks of I (down's blocks) and H (gate's and up's) per task
    // In the runtime's scratch arena (offsets fixed here, pointers bound at each call):
    // [P, I]: g, then dg; u, then du; D^T dy; [P, H]: each pair's dx (int8 mode: G^T dg, and U^T du
    // apart); [P, I / i_step] dw parts; per pool thread: 2 rows of H (gate, up) or of I, or a run
    // of blocks; int8 mode: x, dy [T, H], dg, du [P, I] as int8 rows + 128, and their scales.
    void bind_scratch();
    size_t off_g_ = 0, off_u_ = 0, off_dhr_ = 0, off_dxp_ = 0, off_dwp_ = 0, off_rows_ = 0, off_dxp_up_ = 0;
    size_t off_x8_ = 0, off_dy8_ = 0, off_dg8_ = 0, off_du8_ = 0, off_x8s_ = 0, off_dy8s_ = 0, off_dg8s_ = 0,
           off_du8s_ = 0, per_thread_ = 0;
    float *g_ = nullptr, *u_ = nullptr, *dhr_ = nullptr, *dxp_ = nullptr, *dwp_ = nullptr, *rows_ = nullptr,
          *dxp_up_ = nullptr;
    uint8_t *x8_ = nullptr, *dy8_ = nullptr, *dg8_ = nullptr, *du8_ = nullptr;
    float *x8s_ = nullptr, *dy8s_ = nullptr, *dg8s_ = nullptr, *du8s_ = nullptr;
    MoEGradInt8 q_;
    std::vector<int> pair_token_, pair_slot_, expert_start_, active_, fill_, slot_pair_;
};

}  // namespace kt
