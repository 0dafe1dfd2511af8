// The avxvnni build of the CPU kernels (the AVX2 level with vpdpbusd on 256-bit registers): one
// translation unit per ISA level (setup.py compiles each with its own -m flags), so no object file
// is shared between levels.
#include "../quants.cpp"
#include "../int8.cpp"
#include "../int4.cpp"
#include "../bf16.cpp"
#include "../pool.cpp"
#include "../moe.cpp"
#include "../dequant.cpp"
#include "../moe_grad.cpp"
#include "../linear.cpp"
#include "../stream.cpp"
#include "../attention.cpp"
#include "../deltanet.cpp"
#include "../logits.cpp"
#include "../bindings.cpp"
