// Python bindings (module_local: each ISA build registers its own types in one process). Tensors cross as addresses + byte counts: the Python side (kernels/cpu.py)
// checks dtype, shape and contiguity; the C++ side checks sizes and ids before touching memory.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "linear.h"
#include "attention.h"
#include "deltanet.h"
#include "logits.h"
#include "checked.h"
#include "moe.h"
#include "moe_grad.h"
#include "dequant.h"

#ifndef KT_MODULE
#error "KT_MODULE (the extension's name) must be defined by the build"
#endif
#ifndef KT_ISA
#error "KT_ISA (avx2, avxvnni, avx512, amx) must be defined by the build"
#endif
#define KT_STR2(x) #x
#define KT_STR(x) KT_STR2(x)

namespace py = pybind11;
using namespace kt;

namespace kt {
uint64_t stream_checksum(ThreadPool& pool, const uint8_t* data, size_t bytes);
}

namespace {
template <typename T>
const T* cptr(uintptr_t p) { return reinterpret_cast<const T*>(p); }
Dtype dtype_of(int code) {
    if (code != 0 && code != 1) throw std::invalid_argument("dtype code must be 0 (float32) or 1 (bfloat16)");
    return (Dtype)code;
}
// The int8 copies `dst` from a tuple of (w, scale, row_sum, amx) addresses, four a copy (amx 0:
// none; all four 0: no copy), in the order of `dst`; `what` names the caller in the error (sizes
// are checked in Python).
void int8_weights(const py::tuple& addresses, std::initializer_list<Int8Weights*> dst, const char* what) {
    if (addresses.size() != 4 * dst.size())
        throw std::invalid_argument(std::string(what) + ": int8 needs " + std::to_string(4 * dst.size()) + " addresses");
    size_t at = 0;
    for (Int8Weights* w : dst) {
        w->w = cptr<int8_t>(addresses[at++].cast<uintptr_t>());
        w->scale = cptr<float>(addresses[at++].cast<uintptr_t>());
        w->row_sum = cptr<int32_t>(addresses[at++].cast<uintptr_t>());
        w->amx = cptr<int8_t>(addresses[at++].cast<uintptr_t>());
        if (!w->w && !w->scale && !w->row_sum && !w->amx) continue;
        if (!w->w && !(w->amx && amx_available()))
            throw std::invalid_argument(std::string(what) + ": an int8 copy without its rows (only AMX tiles, which this " +
                                        "process cannot use, may stand for them)");
    }
}

Bf16Kernel bf16_kernel(int code) {
    if (code < 0 || code > 2) throw std::invalid_argument("bf16 kernel code must be 0 (widen), 1 (dot) or 2 (amx)");
    return (Bf16Kernel)code;
}
}  // namespace

PYBIND11_MODULE(KT_MODULE, m) {
    m.doc() = "ktransformers CPU kernels (" KT_STR(KT_ISA) " build)";
    m.attr("isa") = KT_STR(KT_ISA);
    m.def("supported_formats", &supported_formats);
    m.def("rms_norm", [](uintptr_t x, uintptr_t w, float eps, int rows, int n, uintptr_t out) {
              if (rows < 0 || n <= 0) throw std::invalid_argument("rms_norm: rows must be >= 0 and n > 0");
              if (!(eps >= 0.f) || !std::isfinite(eps)) throw std::invalid_argument("rms_norm: eps must be finite and >= 0");
              rms_norm_rows(cptr<float>(x), cptr<float>(w), eps, rows, n, reinterpret_cast<float*>(out));
          }, "RMSNorm of float32 rows on the calling thread (addresses checked by the Python wrapper)");
    m.def("softmax_topk", [](uintptr_t logits, int rows, int n, int k, bool renorm, uintptr_t w, uintptr_t ids) {
              softmax_topk_rows(cptr<float>(logits), rows, n, k, renorm, reinterpret_cast<float*>(w),
                                reinterpret_cast<int64_t*>(ids));
          }, "softmax top-k routing of float32 logit rows on the calling thread (addresses checked by the Python wrapper)");
    m.def("has_tiles", &has_tiles, "whether this build has a 16-row tiled layout (and its kernel) for the ggml type");
    m.attr("tiled_flag") = kTiled;
    m.def("tile_cols", &tile_cols, "a tiled layout's row length must be a multiple of this (0: the type has none here)");
    m.def("bf16_best", [] { return (int)bf16_best(); },
          "the best BF16 kernel this build runs on this CPU: 0 widening, 1 AVX512-BF16 dot products, 2 AMX-BF16 tiles");
    m.attr("int8_gemm") = int8_gemm_available();
    m.attr("int8_gemm_vnni") = int8_gemm_vnni();  // (false: AVX2's GEMM, for the backward only)
    m.attr("int4_gemm") = int4_gemm_available();
    m.def("amx_available", &amx_available, "AMX-INT8 built in, and the OS grants this process the tiles");

    py::class_<Runtime, std::shared_ptr<Runtime>>(m, "Runtime", py::module_local())
        .def(py::init<int, std::vector<int>, int>(), py::arg("threads"), py::arg("cpus") = std::vector<int>(),
             py::arg("spin_us") = 300)
        .def("sync", &Runtime::sync, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("threads", [](Runtime& r) { return r.pool().size(); })
        .def("gated_delta_rule", [](Runtime& r, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g, uintptr_t beta,
                                    uintptr_t state, uintptr_t out, int B, int T, int Hk, int Hv, int Dk, int Dv,
                                    bool l2norm) {
                 r.run_inline([&] {
                     gated_delta_rule(r.pool(), cptr<float>(q), cptr<float>(k), cptr<float>(v), cptr<float>(g),
                                      cptr<float>(beta), reinterpret_cast<float*>(state), reinterpret_cast<float*>(out),
                                      B, T, Hk, Hv, Dk, Dv, l2norm);
                 });
             }, py::call_guard<py::gil_scoped_release>(), "the gated delta rule over T tokens of B sequences (deltanet.h)")
        .def("gated_delta_rule_rows", [](Runtime& r, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g,
                                         uintptr_t beta, uintptr_t states, int64_t n_rows, uintptr_t rows_in,
                                         uintptr_t rows_out, uintptr_t out, int B, int T, int Hk, int Hv, int Dk,
                                         int Dv, bool l2norm) {
                 r.run_inline([&] {
                     gated_delta_rule_rows(r.pool(), cptr<float>(q), cptr<float>(k), cptr<float>(v), cptr<float>(g),
                                           cptr<float>(beta), reinterpret_cast<float*>(states), n_rows,
                                           cptr<int64_t>(rows_in), cptr<int64_t>(rows_out),
                                           reinterpret_cast<float*>(out), B, T, Hk, Hv, Dk, Dv, l2norm);
                 });
             }, py::call_guard<py::gil_scoped_release>(), "the gated delta rule over rows of a state table (deltanet.h)")
        .def("gated_delta_decode", [](Runtime& r, int n, int Hk, int Hv, int Dk, int Dv, int K, bool tiled, bool fused,
                                      uintptr_t qkv, uintptr_t z, uintptr_t b, uintptr_t a, uintptr_t neg_A,
                                      uintptr_t dt_bias, uintptr_t conv_w, uintptr_t conv, int64_t rows,
                                      uintptr_t conv_in, uintptr_t conv_out, uintptr_t ssm, uintptr_t ssm_in,
                                      uintptr_t ssm_out, uintptr_t norm_w, float eps, uintptr_t out) {
                 r.run_inline([&] {
                     gated_delta_decode(r.pool(), n, Hk, Hv, Dk, Dv, K, tiled, fused, cptr<float>(qkv), cptr<float>(z),
                                        cptr<float>(b), cptr<float>(a), cptr<float>(neg_A), cptr<float>(dt_bias),
                                        cptr<float>(conv_w), reinterpret_cast<float*>(conv), rows,
                                        cptr<int64_t>(conv_in), cptr<int64_t>(conv_out), reinterpret_cast<float*>(ssm),
                                        cptr<int64_t>(ssm_in), cptr<int64_t>(ssm_out), cptr<float>(norm_w), eps,
                                        reinterpret_cast<float*>(out));
                 });
             }, py::call_guard<py::gil_scoped_release>(),
             "one decode token of a gated DeltaNet layer from its projections: conv step, delta rule and gated norm over state rows (deltanet.h)")
        .def("attend_gqa_decode", [](Runtime& r, uintptr_t q, uintptr_t k, uintptr_t v, int64_t total_slots,
                                     uintptr_t slots, int L, int heads, int kv_heads, int d, float scale, uintptr_t out,
                                     uintptr_t sinks) {
                 r.run_inline([&] {
                     attend_gqa_decode(r.pool(), cptr<float>(q), cptr<float>(k), cptr<float>(v), total_slots,
                                       cptr<int64_t>(slots), L, heads, kv_heads, d, scale, reinterpret_cast<float*>(out),
                                       cptr<float>(sinks));
                 });
             }, py::call_guard<py::gil_scoped_release>(), "decode attention read in place from the paged cache (sinks: 0 for none)")
        .def("rope_write_attend_gqa", [](Runtime& r, uintptr_t q, uintptr_t k_new, uintptr_t v_new, uintptr_t cos,
                                         uintptr_t sin, uintptr_t k, uintptr_t v, int64_t total_slots, int64_t write_slot,
                                         uintptr_t slots, int L, int heads, int kv_heads, int d, float scale, uintptr_t out,
                                         uintptr_t sinks, int rotary) {
                 r.run_inline([&] {
                     rope_write_attend_gqa(r.pool(), reinterpret_cast<float*>(q), reinterpret_cast<float*>(k_new),
                                           cptr<float>(v_new), cptr<float>(cos), cptr<float>(sin),
                                           reinterpret_cast<float*>(k), reinterpret_cast<float*>(v), total_slots, write_slot,
                                           cptr<int64_t>(slots), L, heads, kv_heads, d, scale, reinterpret_cast<float*>(out),
                                           cptr<float>(sinks), rotary);
                 });
             }, py::call_guard<py::gil_scoped_release>(), "RoPE, cache write and decode attention of one sequence (sinks: 0 for none)")
        .def("repack_tiles", [](Runtime& r, int type, uintptr_t src, size_t src_bytes, uintptr_t dst, size_t dst_bytes, int rows, int n) {
                 const size_t row = tiled_row_bytes(type, rows, n), want = checked_product("repack_tiles", {row, (size_t)rows});
                 if (src_bytes != want || dst_bytes != src_bytes)
                     throw std::invalid_argument("repack_tiles: " + std::to_string(rows) + " rows of " + std::to_string(n) + " values are " +
                                                 std::to_string(want) + " bytes; got source " + std::to_string(src_bytes) + ", destination " + std::to_string(dst_bytes));
                 const int groups = rows / kTileRows, per_task = 64;  // 1024 rows a task
                 r.run_inline([&] {
                     r.pool().parallel_for((groups + per_task - 1) / per_task, [&](int task, int) {
                         const int g0 = task * per_task, g1 = std::min(groups, g0 + per_task);
                         const size_t at = (size_t)g0 * kTileRows * row;
                         repack_tiles(type, cptr<uint8_t>(src) + at, (uint8_t*)dst + at, (g1 - g0) * kTileRows, n);
                     });
                 });
             }, py::call_guard<py::gil_scoped_release>(),
             "Rows of a ggml type repacked into its 16-row tiled layout (same byte count), on the pool")
        .def("copy", [](Runtime& r, uintptr_t dst, uintptr_t src, size_t bytes) {
                 if (!dst || !src) throw std::invalid_argument("copy: null address");
                 if ((dst < src && dst + bytes > src) || (src < dst && src + bytes > dst))
                     throw std::invalid_argument("copy: the source and destination overlap");
                 constexpr size_t kChunk = size_t(2) << 20;  // 2 MiB a task: every thread streams its own pages
                 const size_t tasks = (bytes + kChunk - 1) / kChunk;
                 if (tasks > size_t(INT32_MAX)) throw std::invalid_argument("copy: too many bytes");
                 r.run_inline([&] {
                     r.pool().parallel_for((int)tasks, [&](int task, int) {
                         const size_t at = (size_t)task * kChunk, n = std::min(kChunk, bytes - at);
                         std::memcpy((uint8_t*)dst + at, cptr<uint8_t>(src) + at, n);
                     });
                 });
             }, py::call_guard<py::gil_scoped_release>(),
             "memcpy on the pool (sizes checked by the Python caller): e.g. mapped file -> pinned staging")
        .def("stream_checksum", [](Runtime& r, uintptr_t data, size_t bytes) {
                 uint64_t sum = 0;
                 r.run_inline([&] { sum = stream_checksum(r.pool(), reinterpret_cast<const uint8_t*>(data), bytes); });
                 return sum;
             }, py::call_guard<py::gil_scoped_release>(), "XOR of a buffer read by every pool thread (a bandwidth probe)");

    py::class_<MoE, std::shared_ptr<MoE>>(m, "MoE", py::module_local())
        .def(py::init([](std::shared_ptr<Runtime> rt, int experts, int top_k, int hidden, int intermediate, int max_tokens,
                         int gate_type, int up_type, int down_type, uintptr_t gate, size_t gate_bytes, uintptr_t up,
                         size_t up_bytes, uintptr_t down, size_t down_bytes, py::tuple int8, int int8_min_tokens,
                         py::tuple int4, int int4_group, int bf16, py::tuple biases, float swiglu_limit,
                         float swiglu_alpha) {
                 MoEConfig c;
                 c.experts = experts, c.top_k = top_k, c.hidden = hidden, c.intermediate = intermediate;
                 c.max_tokens = max_tokens, c.gate_type = gate_type, c.up_type = up_type, c.down_type = down_type;
                 c.gate = cptr<void>(gate), c.up = cptr<void>(up), c.down = cptr<void>(down);
                 c.gate_bytes = gate_bytes, c.up_bytes = up_bytes, c.down_bytes = down_bytes;
                 c.int8_min_tokens = int8_min_tokens;
                 c.bf16 = bf16_kernel(bf16);
                 if (biases.size()) {  // gate, up, down float32 addresses; shapes checked in Python
                     if (biases.size() != 3) throw std::invalid_argument("MoE: biases needs 3 addresses");
                     c.gate_bias = cptr<float>(biases[0].cast<uintptr_t>());
                     c.up_bias = cptr<float>(biases[1].cast<uintptr_t>());
                     c.down_bias = cptr<float>(biases[2].cast<uintptr_t>());
                 }
                 c.swiglu_limit = swiglu_limit, c.swiglu_alpha = swiglu_alpha;
                 if (int8_min_tokens > 0 && !int4.size()) int8_weights(int8, {&c.gate8, &c.up8, &c.down8}, "MoE");
                 if (int8_min_tokens > 0 && int4.size()) {  // (q, scale, corr) for gate, up, down; sizes checked in Python
                     if (int4.size() != 9) throw std::invalid_argument("MoE: int4 needs 9 addresses");
                     Int4Weights* dst[3] = {&c.gate4, &c.up4, &c.down4};
                     for (int i = 0; i < 3; i++) {
                         dst[i]->q = cptr<uint8_t>(int4[3 * i].cast<uintptr_t>());
                         dst[i]->scale = cptr<float>(int4[3 * i + 1].cast<uintptr_t>());
                         dst[i]->corr = cptr<float>(int4[3 * i + 2].cast<uintptr_t>());
                         dst[i]->group = int4_group;
                     }
                 }
                 return std::make_shared<MoE>(rt, c);
             }),
             py::arg("runtime"), py::arg("experts"), py::arg("top_k"), py::arg("hidden"), py::arg("intermediate"),
             py::arg("max_tokens"), py::arg("gate_type"), py::arg("up_type"), py::arg("down_type"), py::arg("gate"),
             py::arg("gate_bytes"), py::arg("up"), py::arg("up_bytes"), py::arg("down"), py::arg("down_bytes"),
             py::arg("int8") = py::tuple(), py::arg("int8_min_tokens") = 0, py::arg("int4") = py::tuple(),
             py::arg("int4_group") = 0, py::arg("bf16") = (int)Bf16Kernel::Amx, py::arg("biases") = py::tuple(),
             py::arg("swiglu_limit") = 0.f, py::arg("swiglu_alpha") = 1.f)
        .def("forward", [](MoE& moe, int tokens, uintptr_t ids, uintptr_t weights, uintptr_t x, uintptr_t y, int dtype) {
                 moe.forward(tokens, cptr<int64_t>(ids), cptr<float>(weights), cptr<void>(x), (void*)y, dtype_of(dtype));
             }, py::call_guard<py::gil_scoped_release>())
        .def("forward_keeping", [](MoE& moe, int tokens, uintptr_t ids, uintptr_t weights, uintptr_t x, uintptr_t y,
                                   int dtype, uintptr_t gate_up) {
                 moe.forward_keeping(tokens, cptr<int64_t>(ids), cptr<float>(weights), cptr<void>(x), (void*)y,
                                     dtype_of(dtype), reinterpret_cast<float*>(gate_up));
             }, py::call_guard<py::gil_scoped_release>(),
             "forward, also writing each pair's g and u (biases added, before the activation) to gate_up [T*K, 2I]")
        .def_property_readonly("last_ns", &MoE::last_ns, "nanoseconds of the last call, inside the kernel")
        .def_property_readonly("experts_read", &MoE::experts_read,
                               "experts whose weights the calls read, summed since construction (once a call each)")
        .def_property_readonly("one_region_calls", &MoE::one_region_calls,
                               "max_tokens chunks of calls so far that ran gate/up, activation and down as one parallel region")
        .def("submit", [](MoE& moe, int tokens, uintptr_t ids, uintptr_t weights, uintptr_t x, uintptr_t y, int dtype) {
                 moe.submit(tokens, cptr<int64_t>(ids), cptr<float>(weights), cptr<void>(x), (void*)y, dtype_of(dtype));
             })
        .def("set_deferral", &MoE::set_deferral, py::arg("defer"), py::arg("next"),
             "leave each token's `defer` lowest-weight experts to be added to `next`'s following call (0: off)")
        .def("set_deferring", &MoE::set_deferring, py::arg("on"), "defer from now on (decode), or not (prefill)");

    py::class_<MoEGrad, std::shared_ptr<MoEGrad>>(m, "MoEGrad", py::module_local())
        .def(py::init([](std::shared_ptr<Runtime> rt, int experts, int top_k, int hidden, int intermediate, int max_tokens,
                         int gate_type, int up_type, int down_type, uintptr_t gate, size_t gate_bytes, uintptr_t up,
                         size_t up_bytes, uintptr_t down, size_t down_bytes, py::tuple biases, float swiglu_limit,
                         float swiglu_alpha, py::tuple int8) {
                 MoEConfig c;
                 c.experts = experts, c.top_k = top_k, c.hidden = hidden, c.intermediate = intermediate;
                 c.max_tokens = max_tokens, c.gate_type = gate_type, c.up_type = up_type, c.down_type = down_type;
                 c.gate = cptr<void>(gate), c.up = cptr<void>(up), c.down = cptr<void>(down);
                 c.gate_bytes = gate_bytes, c.up_bytes = up_bytes, c.down_bytes = down_bytes;
                 if (biases.size()) {  // gate, up, down float32 addresses; shapes checked in Python
                     if (biases.size() != 3) throw std::invalid_argument("MoEGrad: biases needs 3 addresses");
                     c.gate_bias = cptr<float>(biases[0].cast<uintptr_t>());
                     c.up_bias = cptr<float>(biases[1].cast<uintptr_t>());
                     c.down_bias = cptr<float>(biases[2].cast<uintptr_t>());
                 }
                 c.swiglu_limit = swiglu_limit, c.swiglu_alpha = swiglu_alpha;
                 MoEGradInt8 q;
                 if (int8.size() == 24)  // with the forward's copy of down (pairs' kDown)
                     int8_weights(int8, {&q.gate, &q.up, &q.down_t, &q.gate_t, &q.up_t, &q.down}, "MoEGrad");
                 else if (int8.size())
                     int8_weights(int8, {&q.gate, &q.up, &q.down_t, &q.gate_t, &q.up_t}, "MoEGrad");
                 return std::make_shared<MoEGrad>(rt, c, q);
             }),
             py::arg("runtime"), py::arg("experts"), py::arg("top_k"), py::arg("hidden"), py::arg("intermediate"),
             py::arg("max_tokens"), py::arg("gate_type"), py::arg("up_type"), py::arg("down_type"), py::arg("gate"),
             py::arg("gate_bytes"), py::arg("up"), py::arg("up_bytes"), py::arg("down"), py::arg("down_bytes"),
             py::arg("biases") = py::tuple(), py::arg("swiglu_limit") = 0.f, py::arg("swiglu_alpha") = 1.f,
             py::arg("int8") = py::tuple())
        .def_property_readonly("int8", &MoEGrad::int8, "the products run on int8 copies")
        .def("backward", [](MoEGrad& g, int tokens, uintptr_t ids, uintptr_t weights, uintptr_t x, uintptr_t dy,
                            uintptr_t dx, uintptr_t dw, uintptr_t gate_up) {
                 g.backward(tokens, cptr<int64_t>(ids), cptr<float>(weights), cptr<float>(x), cptr<float>(dy),
                            reinterpret_cast<float*>(dx), reinterpret_cast<float*>(dw), cptr<float>(gate_up));
             }, py::call_guard<py::gil_scoped_release>(),
             "dx [T, H] and dw [T, K] (float32) from x, dy [T, H] and ids, weights [T, K], and the forward's g and u "
             "[T*K, 2I] (0: recomputed; shapes checked in Python)")
        .def("pairs", [](MoEGrad& g, int op, int tokens, uintptr_t ids, uintptr_t a, uintptr_t b, uintptr_t out,
                         uintptr_t out2) {
                 if (op < 0 || op > 3) throw std::invalid_argument("MoEGrad: pairs op must be 0 to 3");
                 g.pairs((MoEGrad::PairOp)op, tokens, cptr<int64_t>(ids), cptr<float>(a), cptr<float>(b),
                         reinterpret_cast<float*>(out), reinterpret_cast<float*>(out2));
             }, py::call_guard<py::gil_scoped_release>(),
             "per-pair products (moe_grad.h's PairOp: 0 gate_up, 1 down, 2 down^T, 3 gate_up^T; 0 for an unused "
             "address; shapes checked in Python)");

    m.def("mask_logits", [](uintptr_t logits, bool bf16, int64_t logit_rows, int64_t row_stride, int64_t vocab,
                            uintptr_t rows, int64_t n_rows, uintptr_t words, int64_t words_per_row) {
              mask_logits(reinterpret_cast<void*>(logits), bf16, logit_rows, row_stride, vocab, cptr<int64_t>(rows), n_rows,
                          cptr<int32_t>(words), words_per_row);
          }, "logits rows set to -inf where a packed token bitmask has a 0 (logits.h; shapes checked in Python)");
    m.def("int8_copies", [](Runtime& r, int type, uintptr_t src, size_t src_bytes, int E, int rows, int cols, bool transpose,
                            uintptr_t w, uintptr_t scale, uintptr_t row_sum) {
              r.run_inline([&] {
                  int8_copies(r.pool(), type, cptr<void>(src), src_bytes, E, rows, cols, transpose,
                              reinterpret_cast<int8_t*>(w), reinterpret_cast<float*>(scale),
                              reinterpret_cast<int32_t*>(row_sum));
              });
          }, py::call_guard<py::gil_scoped_release>(),
          "per-row int8 copies of E stored matrices, transposed or not (dequant.h; outputs sized by the caller)");
    m.def("dequantize", [](int type, uintptr_t src, size_t src_bytes, size_t values, uintptr_t out) {
              const int elems = dequant_block_elems(type), block = dequant_block_bytes(type);
              if (elems == 0) throw std::invalid_argument("dequantize: no decoder for ggml type " + std::to_string(type));
              if (values % elems)
                  throw std::invalid_argument("dequantize: " + std::to_string(values) + " values are not whole blocks of " +
                                              std::to_string(elems));
              const size_t blocks = values / elems;
              if (src_bytes < checked_product("dequantize: bytes", {blocks, (size_t)block}))
                  throw std::invalid_argument("dequantize: " + std::to_string(src_bytes) + " bytes hold fewer than " +
                                              std::to_string(blocks) + " blocks");
              if (blocks > (size_t)INT32_MAX) throw std::invalid_argument("dequantize: too many blocks for one call");
              dequant_blocks(type, cptr<void>(src), (int)blocks, reinterpret_cast<float*>(out));
          }, py::call_guard<py::gil_scoped_release>(), py::arg("type"), py::arg("src"), py::arg("src_bytes"),
          py::arg("values"), py::arg("out"), "`values` float32 values of ggml blocks at src into out");

    py::class_<MoEHostCall, std::shared_ptr<MoEHostCall>>(m, "MoEHostCall", py::module_local())
        .def(py::init([](std::shared_ptr<MoE> moe, std::shared_ptr<Runtime> rt, int tokens, uintptr_t ids,
                         uintptr_t weights, uintptr_t x, uintptr_t y, int dtype) {
                 if (tokens < 1) throw std::invalid_argument("MoEHostCall: tokens must be positive");
                 auto call = std::make_shared<MoEHostCall>();
                 call->moe = moe;
                 call->runtime = rt;
                 call->tokens = tokens;
                 call->ids = cptr<int64_t>(ids);
                 call->weights = cptr<float>(weights);
                 call->x = cptr<void>(x);
                 call->y = (void*)y;
                 call->dtype = dtype_of(dtype);
                 return call;
             }))
        .def_property_readonly("address", [](MoEHostCall& c) { return (uintptr_t)&c; })
        .def("take_error", &MoEHostCall::take_error, py::call_guard<py::gil_scoped_release>(),
             "the first failure since the last take (\"\": none), cleared");
    py::class_<Doorbell, std::shared_ptr<Doorbell>>(m, "Doorbell", py::module_local())
        .def(py::init<std::shared_ptr<Runtime>, int>(), py::arg("runtime"), py::arg("spin_us"))
        .def("add", &Doorbell::add, "register a call; its number is what a ring is set to")
        .def("watch", [](Doorbell& d, uintptr_t ring, uintptr_t done) {
                 d.watch(reinterpret_cast<uint32_t*>(ring), reinterpret_cast<uint32_t*>(done));
             }, "poll a ring/done pair (addresses of pinned host memory that outlives this object)")
        .def("wake", &Doorbell::wake)
        .def("rest", &Doorbell::rest, "stop spinning (this thread and the pool's workers) until the next wake()")
        .def_property_readonly("served", &Doorbell::served)
        .def_property_readonly("bad_rings", &Doorbell::bad_rings)
        .def_property_readonly("busy_ns", &Doorbell::busy_ns, "nanoseconds spent in the calls")
        .def_property_readonly("between_ns", &Doorbell::between_ns,
                               "nanoseconds from a call's end to the next ring seen while spinning")
        .def_property_readonly("betweens", &Doorbell::betweens, "how many such gaps between_ns sums");
    m.attr("moe_host_submit") = (uintptr_t)&moe_host_submit;
    m.attr("moe_host_wait") = (uintptr_t)&moe_host_wait;

    py::class_<Linear, std::shared_ptr<Linear>>(m, "Linear", py::module_local())
        .def(py::init([](std::shared_ptr<Runtime> rt, int in_features, int out_features, int type, uintptr_t weight,
                         size_t weight_bytes, int max_tokens, int bf16) {
                 return std::make_shared<Linear>(rt, in_features, out_features, type, cptr<void>(weight), weight_bytes,
                                                 max_tokens, bf16_kernel(bf16));
             }),
             py::arg("runtime"), py::arg("in_features"), py::arg("out_features"), py::arg("type"), py::arg("weight"),
             py::arg("weight_bytes"), py::arg("max_tokens"), py::arg("bf16") = (int)Bf16Kernel::Amx)
        .def("forward", [](Linear& lin, int tokens, uintptr_t x, uintptr_t y, int dtype) {
                 lin.forward(tokens, cptr<void>(x), (void*)y, dtype_of(dtype));
             }, py::call_guard<py::gil_scoped_release>())
        .def("submit", [](Linear& lin, int tokens, uintptr_t x, uintptr_t y, int dtype) {
                 lin.submit(tokens, cptr<void>(x), (void*)y, dtype_of(dtype));
             });
}
