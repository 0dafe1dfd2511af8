"""engine: generation over a loaded model: chunked prefill and decode on a paged KV cache
(`generate`), CUDA graphs of the decode step (`graphs`), sampling (`sampling`), text streaming
that never splits a character (`streaming`) and where each module computes (`devices`)."""
