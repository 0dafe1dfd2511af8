// MoE forward on GGML-format expert weights:
//   y[t] = sum_k w[t,k] * down_e(act(gate_e(x_t), up_e(x_t))),  e = ids[t,k]
// act(g, u) = silu(g) * u, or gpt-oss's clamped SwiGLU (swiglu_limit > 0); each projection may
// add a per-expert bias.
// Shapes: x [T, H] (f32 or bf16), ids [T, K] int64, w [T, K] f32, y [T, H] (x's dtype);
// gate/up [E, I, H] and down [E, H, I] as stored in the GGUF (rows of blocks), never copied.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "int8.h"
#include "pool.h"
#include "quants.h"

namespace kt {

struct MoEConfig {
    int experts = 0, top_k = 0, hidden = 0, intermediate = 0, max_tokens = 0;
    int gate_type = -1, up_type = -1, down_type = -1;
    const void* gate = nullptr;  // each [E, I, H] / [E, H, I] rows of blocks; all three null: the
                                 // int8/int4 copies are the only weights (int8_min_tokens 1)
    const void* up = nullptr;
    const void* down = nullptr;
    size_t gate_bytes = 0, up_bytes = 0, down_bytes = 0;  // for the bounds check
    // Optional int8 copies for prefill: experts with at least int8_min_tokens tokens in a call use
    // them (the int8 GEMM); the others use the GGML blocks (with no blocks, every expert the copies).
    Int8Weights gate8, up8, down8;
    Int4Weights gate4, up4, down4;  // int4 copies instead (gate4.q set): the same path, half the bytes
    int int8_min_tokens = 0;  // 0: no int8/int4 copies
    Bf16Kernel bf16 = Bf16Kernel::Amx;  // BF16 weights: the best kernel allowed (find_format)
    // Biases, float32 [E, I], [E, I], [E, H]: all three or none.
    const float* gate_bias = nullptr;
    const float* up_bias = nullptr;
    const float* down_bias = nullptr;
    // swiglu_limit > 0: act(g, u) = g' * sigmoid(alpha * g') * (u' + 1), g' = min(g, limit),
    // u' = clamp(u, -limit, limit) (gpt-oss); 0: silu(g) * u.
    float swiglu_limit = 0.f, swiglu_alpha = 1.f;
};

enum class Dtype { F32 = 0, BF16 = 1 };

class MoE {
  public:
    MoE(std::shared_ptr<Runtime> runtime, const MoEConfig& config);
    // Checks everything before touching memory (throws std::invalid_argument), then runs on the
    // calling thread with the runtime's pool. `submit` runs the same on the dispatcher.
    // `hold_deferred`: leave the call's deferred experts (below) for run_deferred, else run them too.
    void forward(int tokens, const int64_t* ids, const float* weights, const void* x, void* y, Dtype dtype,
                 bool hold_deferred = false);
    void submit(int tokens, const int64_t* ids, const float* weights, const void* x, void* y, Dtype dtype);
    // forward, also writing each (token, slot) pair's g and u (biases added, before the activation)
    // to gate_up [T*K, 2I] float32 (g then u a row; zeros for a slot of id -1): what the training
    // backward (MoEGrad) would otherwise recompute from x. Not with deferral (training defers none).
    void forward_keeping(int tokens, const int64_t* ids, const float* weights, const void* x, void* y, Dtype dtype,
                         float* gate_up);
    // Expert deferral (upstream's n_deferred_experts). While deferring, a call of at most max_tokens
    // tokens leaves out each token's `defer` lowest-weight experts (where another token of the call
    // keeps an expert, it is kept for all: its weights are read once), writes y, and then computes
    // the left-out experts into `next`'s carry, which next's following call adds to its own y: their
    // output joins the residual one layer later. Fed from a GPU (Doorbell), that second part runs
    // after `done` is set, while the GPU runs the next layer's attention. Every call of this layer
    // replaces next's carry (with a fresh one or none), so a carry never outlives its forward pass.
    void set_deferral(int defer, std::shared_ptr<MoE> next);
    void set_deferring(bool on) { deferring_.store(on, std::memory_order_relaxed); }
    void run_deferred();  // the last call's left-out experts, if it left any (on the calling thread)
    const MoEConfig& config() const { return cfg_; }
    // Nanoseconds the last call took from its first phase to its output (no caller overhead).
    uint64_t last_ns() const { return last_ns_.load(std::memory_order_relaxed); }
    // Calls (max_tokens chunks) that ran as one parallel region (gate_up_down): tests check the path ran.
    uint64_t one_region_calls() const { return one_region_calls_.load(std::memory_order_relaxed); }
    // Experts whose weights the calls have read, summed over every call since construction (an
    // expert several tokens of a call share counts once): the bytes a batch's steps really stream.
    uint64_t experts_read() const { return experts_read_.load(std::memory_order_relaxed); }

  private:
    // No stored weights (gate, up and down null): the int8/int4 copies are the experts' only bytes.
    bool copies_only() const { return !cfg_.gate && !cfg_.up && !cfg_.down; }
    void check_stored(const MoEConfig& c);  // formats, byte counts and tile shapes of the stored weights
    void check(int tokens, const int64_t* ids) const;
    void run(int tokens, const int64_t* ids, const float* weights, const void* x, void* y, Dtype dtype);
    void prepare_inputs(int tokens, const void* x, Dtype dtype);
    void group_by_expert(int tokens, const int64_t* ids);
    // fn(expert, r0, r1) over every active expert's rows [0, rows), split in chunks across the pool
    template <typename Fn>
    void for_expert_rows(int rows, Fn fn);
    void gate_up();
    void gate_up_int8(int e, int r0, int r1);
    void down_int8(int e, int r0, int r1);
    // proj 0, 1, 2: gate, up, down; rows [r0, r1) of expert e against m prepared activation rows
    void quant_rows(int proj, int e, int r0, int r1, const uint8_t* const* xs, const float* sx, int m, float* out,
                    size_t stride) const;
    void activate();
    void down();
    // The three steps above as one parallel region for decode calls (about a token an expert, all
    // experts on one path; prefill keeps the barriers: a hot expert's activation would be one
    // thread's tail):
    // gate/up tasks first, then down tasks; the thread finishing an expert's last gate/up chunk
    // activates its pairs, and that expert's down tasks wait (spin) for it instead of the whole
    // pool waiting at two barriers.
    void gate_up_down();
    void gate_up_rows(int e, int r0, int r1);
    void activate_pair(int p);
    void down_rows(int e, int r0, int r1);
    void compute();  // gate, up, activation and down of the grouped pairs
    // y = sum of the pairs' weighted outputs (+ carry [tokens, H] where given)
    void combine(int tokens, const float* weights, void* y, Dtype dtype, const float* carry = nullptr);
    bool split_deferred(int tokens, const int64_t* ids, const float* weights);  // true: some pairs left out
    const float* take_carry(int tokens);
    void compute_deferred();

    std::shared_ptr<Runtime> rt_;
    MoEConfig cfg_;
    const Format *gate_fmt_ = nullptr, *up_fmt_ = nullptr, *down_fmt_ = nullptr;  // null: copies only
    size_t gate_row_ = 0, up_row_ = 0, down_row_ = 0;  // bytes per weight row
    size_t gate_act_ = 0, up_act_ = 0, down_act_ = 0;  // bytes per prepared activation row
    // Buffers for max_tokens tokens, in the runtime's scratch arena (offsets fixed at construction;
    // pointers taken at the start of each run).
    struct Scratch {
        float* x_f32;              // [T, H]
        uint8_t *x_gate, *x_up;    // [T] prepared rows for gate and up weights (x_up may alias x_gate)
        float *g, *u;              // [P, I], P = T * K (token, expert) pairs
        uint8_t* h_act;            // [P] prepared rows for down weights
        float* y_pairs;            // [P, H]
        uint8_t *x_u8, *h_u8;      // int8 path: [T, H] and [P, I] activations + 128
        float *x_s, *h_s;          // their per-row scales
    };
    bool use_int8(int e) const {
        return cfg_.int8_min_tokens > 0 && expert_start_[e + 1] - expert_start_[e] >= cfg_.int8_min_tokens;
    }
    Scratch bind_scratch();
    Scratch s_{};
    size_t off_x_up_ = 0, off_g_ = 0, off_u_ = 0, off_h_ = 0, off_y_ = 0, off_gate_ = 0;
    size_t off_xu8_ = 0, off_hu8_ = 0, off_xs_ = 0, off_hs_ = 0;
    bool separate_up_ = false;
    std::vector<int> pair_token_, pair_slot_, pair_expert_;  // pair -> token, t*K + k, expert
    std::vector<int> expert_start_, active_;   // pairs of expert e: [start[e], start[e+1]); experts hit
    std::vector<int> slot_pair_;               // t*K + k -> pair
    std::vector<int> fill_;                    // scratch for group_by_expert
    float* keep_ = nullptr;                    // forward_keeping's gate_up rows
    size_t chunk_slot0_ = 0;                   // the first slot (t*K + k) of the max_tokens chunk being run
    struct alignas(64) Countdown {  // a cache line each: spinning readers do not slow other experts' counts
        std::atomic<int> left{0};
    };
    std::unique_ptr<Countdown[]> chunks_left_;  // gate_up_down: gate/up chunks not done, per active expert
    std::atomic<uint64_t> last_ns_{0}, one_region_calls_{0}, experts_read_{0};
    // deferral: this layer's setting, and the state of its last call
    int defer_ = 0;
    std::shared_ptr<MoE> next_;
    std::atomic<bool> deferring_{false};
    std::vector<int64_t> ids_now_, ids_later_;  // [T*K]: the pairs computed now / later (-1 elsewhere)
    std::vector<float> w_later_;                // the call's weights, kept for the later part
    std::vector<char> kept_;                    // [E] scratch: experts some token keeps now
    std::vector<int> order_;                    // [K] scratch
    std::atomic<int> later_tokens_{0};          // tokens of the part still to run (0: none)
    // the previous layer's left-out experts, for this layer's next call: [max_tokens, H] float32
    std::vector<float> carry_;
    std::atomic<int> carry_tokens_{0};  // 0: none
};

// The XOR of the bytes [p, p + n), read as the stream probe reads them (stream.cpp).
uint64_t xor_bytes(const uint8_t* p, size_t n);

// One MoE call with its inputs and output at fixed addresses (pinned host buffers), started and
// waited for by plain C functions of one pointer: what cudaLaunchHostFunc / cuLaunchHostFunc
// enqueue on a GPU stream, so that a stream (and a CUDA graph captured from it) runs the CPU
// experts in order with its kernels. No Python runs in them; a failure is kept in `error` (the
// first one) for the caller to raise after the stream is done.
struct MoEHostCall {
    std::shared_ptr<MoE> moe;
    std::shared_ptr<Runtime> runtime;
    int tokens = 0;
    const int64_t* ids = nullptr;
    const float* weights = nullptr;
    const void* x = nullptr;
    void* y = nullptr;
    Dtype dtype = Dtype::F32;
    // The first failure, kept until taken. Guarded: a graph replayed twice in flight (decoding a
    // step ahead) runs the same calls, so one step's error may be set while another's is taken.
    void fail(const std::string& what) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (error.empty()) error = what;
    }
    std::string take_error() {
        std::lock_guard<std::mutex> lock(error_mu);
        std::string e;
        std::swap(e, error);
        return e;
    }

  private:
    std::mutex error_mu;
    std::string error;
};
void moe_host_submit(void* call);  // MoE::submit of the call (returns at once)
void moe_host_wait(void* call);    // waits for the runtime's queued jobs

// The same calls handed over without host functions. A layer (an MoE kernel fed from a GPU) has
// two 32-bit words in pinned host memory: `ring`, to which the GPU stream writes the number of the
// call to run once its inputs are copied (cuStreamWriteValue32), and `done`, set to 1 here once
// y is written, which the stream waits for (cuStreamWaitValue32) before setting it back to 0 and
// copying y to the GPU. One thread polls the rings and runs each call inline, as the pool's
// thread 0: the GPU waits for no host-function node, and no job goes through the dispatcher and
// back. It spins for spin_us after its last call or wake(), then looks every 100 us (after a
// second idle, every millisecond): a ring is never missed, at worst served later. A failing call
// records its error and still sets `done` (a number that names no call counts in bad_rings()).
class Doorbell {
  public:
    Doorbell(std::shared_ptr<Runtime> runtime, int spin_us);
    ~Doorbell();
    Doorbell(const Doorbell&) = delete;
    Doorbell& operator=(const Doorbell&) = delete;
    uint32_t add(std::shared_ptr<MoEHostCall> call);  // the call's number (from 1), what a ring is set to
    // Poll a pair of 4-byte aligned, distinct words (alive as long as this object).
    void watch(uint32_t* ring, uint32_t* done);
    void wake();  // a step is about to ring: spin again (this thread then rouses the pool's workers)
    // The step's rings are all served and the next step is not about to start (Python has the
    // cores: sampling, the next step's inputs): stop spinning now, this thread and the pool's
    // workers, until wake(). A ring that comes anyway is served within the idle nap (100 us, or
    // 1 ms after a second idle).
    void rest();
    uint64_t served() const { return served_.load(std::memory_order_relaxed); }
    uint64_t bad_rings() const { return bad_.load(std::memory_order_relaxed); }
    // Nanoseconds spent in the calls, and between the end of a call and the next ring seen within
    // the spin window (the GPU's part of a decode step plus both hand-off latencies).
    uint64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }
    uint64_t between_ns() const { return between_ns_.load(std::memory_order_relaxed); }
    uint64_t betweens() const { return betweens_.load(std::memory_order_relaxed); }

  private:
    struct Slot {
        uint32_t* ring;
        uint32_t* done;
    };
    void loop();
    std::shared_ptr<MoEHostCall> call(uint32_t number);

    std::shared_ptr<Runtime> rt_;
    const int spin_us_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::shared_ptr<MoEHostCall>> calls_;  // guarded by mu_
    std::vector<Slot> slots_;                          // guarded by mu_; the loop copies it when version_ moves
    std::atomic<uint64_t> version_{0};
    std::atomic<bool> resting_{false};
    std::atomic<bool> stop_{false}, woken_{false};
    std::atomic<uint64_t> served_{0}, bad_{0}, busy_ns_{0}, between_ns_{0}, betweens_{0};
    std::thread thread_;
};

}  // namespace kt

