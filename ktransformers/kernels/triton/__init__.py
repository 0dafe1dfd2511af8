"""GPU kernels in Triton, each beside the torch reference it is tested against.

    quant_linear   int4 / int8 group-quantized weight x bf16 activation GEMM (KLinearMarlin, KLinearQ8)
    fp8            FP8 e4m3 weights with 128x128 block scales (KLinearFP8)
    attention      paged decode attention (MLA in latent space, GQA) and causal prefill attention
    fused_moe      experts resident on the GPU (bf16 or int4), token-grouped
    norm_rope      RMSNorm rows; Qwen3's q/k norms with RoPE for q and k in one launch (decode)
    router         the softmax top-k routing epilogue in one launch (decode)

The kernels run on CUDA tensors; with TRITON_INTERPRET=1 set before the first import, Triton's
interpreter runs them on CPU tensors (slowly), which is how the CPU-only CI checks their logic.
"""
