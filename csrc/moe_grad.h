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
// With int8 copies (MoEGradInt8: the transposed D^T, G^T and U^T, and the forward's gate and up
// where g and u are to be recomputed, re-quantized once by the caller) the products run on the
// int8 GEMM (VNNI, AMX or AVX2's vpmaddubsw) instead, activations rounded to int8 per row as the
// forward's are.
//
// pairs() gives the same products one at a time, per (token, slot) pair, for adapters on the
// experts (LoRA): the activation, the adapters' low-rank terms and the weighted sum then run in
// torch, whose autograd joins them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "moe.h"

namespace kt {

struct MoEGradInt8 {
    // [E, I, H], optional (g and u, where the forward does not hand them over, else from the stored blocks)
    Int8Weights gate, up;
    Int8Weights down_t;          // [E, I, H]: D^T
    Int8Weights gate_t, up_t;    // [E, H, I]: G^T, U^T (apart: dg and du get a scale each)
    Int8Weights down;            // [E, H, I]: D, the forward's copy (optional: pairs' kDown, else the stored blocks)
    bool set() const { return down_t.values() && gate_t.values() && up_t.values(); }
    bool gate_up() const { return gate.values() && up.values(); }
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
    // tokens at a time. gate_up: the forward's g and u [T*K, 2I] (MoE::forward_keeping), which
    // then are not recomputed (null: recomputed from x).
    void backward(int tokens, const int64_t* ids, const float* w, const float* x, const float* dy, float* dx, float* dw,
                  const float* gate_up = nullptr);

    // Products per (token, slot) pair of ids [T, K] (a slot of id -1 gets a zero row), without the
    // biases (the caller adds them); float32, run like backward:
    //   kGateUp:  a = x [T, H]             -> out = G_e x, out2 = U_e x      [T*K, I]
    //   kDown:    a = h [T*K, I]           -> out = D_e h                    [T*K, H]
    //   kDownT:   a = dout [T*K, H]        -> out = D_e^T dout               [T*K, I]
    //   kGateUpT: a = dg, b = du [T*K, I]  -> out = the sum over each token's slots of
    //                                         G_e^T dg + U_e^T du           [T, H]
    enum PairOp { kGateUp = 0, kDown = 1, kDownT = 2, kGateUpT = 3 };
    void pairs(PairOp op, int tokens, const int64_t* ids, const float* a, const float* b, float* out, float* out2);

  private:
    void check_ids(int tokens, const int64_t* ids) const;
    void pairs_chunk(PairOp op, int tokens, const int64_t* ids, const float* a, const float* b, float* out, float* out2);
    void scatter_pairs(int tokens, const float* src, int n, float* dst);  // pair rows -> slot rows (zeros for -1)
    void pairs_dx();  // each pair's dx = G^T g_ + U^T u_ (dg, du there), into dxp_ (and dxp_up_)
    void token_dx(int t, float* out) const;  // the sum of token t's pairs' dx
    void chunk(int tokens, const int64_t* ids, const float* w, const float* x, const float* dy, float* dx, float* dw,
               const float* gate_up);
    // dg, du over columns [i0, i1) of pair p into g_, u_, from g_, u_ or the forward's gate_up rows
    void activation_grad(int p, int i0, int i1, float wt, const float* gate_up);
    // rows [r0, r1) of expert e's int8 matrix `all` (rows x k) against pairs p0..p1's int8 rows
    // (act + p or its token's row, k bytes apart): out[p * stride + r]
    void int8_pairs(const Int8Weights& all, int rows, int k, int e, int r0, int r1, int p0, int p1,
                    const uint8_t* act, const float* scale, bool by_token, float* out, size_t stride) const;
    void quantize_inputs(int tokens, const float* x, const float* dy);  // x (null: not), dy -> int8 rows (int8 mode)
    void group(int tokens, const int64_t* ids);  // the (token, expert) pairs by expert
    // expert e's columns [i0, i1) of I: g, u, D^T dy, then dw's part and dg, du (int8 copies / stored blocks)
    void inner_int8(int e, int i0, int i1, const float* w, const float* x, const float* gate_up, float* buf);
    void inner_blocks(int e, int i0, int i1, const float* w, const float* x, const float* dy, const float* gate_up,
                      float* buf);
    // stored-block products of expert e: g_, u_ over columns [i0, i1) of I from x (rows by token);
    // dhr_ over [i0, i1) from src (rows by token or by slot); dxp_ rows [r0, r1) of H from h by slot
    void gate_up_blocks(int e, int i0, int i1, const float* x, bool bias, float* buf);
    void down_t_blocks(int e, int i0, int i1, const float* src, bool by_token, float* buf);
    void down_blocks(int e, int r0, int r1, const float* h, float* buf);
    // the row of pair p in a [T, n] array (by_token) or a [T*K, n] one
    const float* pair_row(const float* base, int p, bool by_token, size_t n) const {
        return base + (size_t)(by_token ? pair_token_[p] : pair_slot_[p]) * n;
    }
    void outer_blocks(int e, int c0, int c1, float* buf);  // each pair's dx over columns [c0, c1) of H

    std::shared_ptr<Runtime> rt_;
    MoEConfig cfg_;
    size_t gate_row_ = 0, up_row_ = 0, down_row_ = 0;  // bytes per stored row
    int gate_elems_ = 0, up_elems_ = 0, down_elems_ = 0, gate_blk_ = 0, up_blk_ = 0, down_blk_ = 0;
    int i_step_ = 0, h_step_ = 0;  // column chunks of I (down's blocks) and H (gate's and up's) per task
    // In the runtime's scratch arena (offsets fixed here, pointers bound at each call):
    // [P, I]: g, then dg; u, then du; D^T dy; [P, H]: each pair's dx (int8 mode: G^T dg, and U^T du
    // apart); [P, I / i_step] dw parts; per pool thread: 2 rows of H (gate, up) or of I, or a run
    // of blocks; int8 mode: x, dy [T, H], dg, du [P, I] as int8 rows + 128, and their scales;
    // pairs' kDownT in int8 mode: dout [P, H] as int8 rows, and their scales.
    void bind_scratch();
    size_t off_g_ = 0, off_u_ = 0, off_dhr_ = 0, off_dxp_ = 0, off_dwp_ = 0, off_rows_ = 0, off_dxp_up_ = 0;
    size_t off_x8_ = 0, off_dy8_ = 0, off_dg8_ = 0, off_du8_ = 0, off_x8s_ = 0, off_dy8s_ = 0, off_dg8s_ = 0,
           off_du8s_ = 0, off_o8_ = 0, off_o8s_ = 0, per_thread_ = 0;
    float *g_ = nullptr, *u_ = nullptr, *dhr_ = nullptr, *dxp_ = nullptr, *dwp_ = nullptr, *rows_ = nullptr,
          *dxp_up_ = nullptr;
    uint8_t *x8_ = nullptr, *dy8_ = nullptr, *dg8_ = nullptr, *du8_ = nullptr, *o8_ = nullptr;
    float *x8s_ = nullptr, *dy8s_ = nullptr, *dg8s_ = nullptr, *du8s_ = nullptr, *o8s_ = nullptr;
    MoEGradInt8 q_;
    std::vector<int> pair_token_, pair_slot_, expert_start_, active_, fill_, slot_pair_;
};

}  // namespace kt
