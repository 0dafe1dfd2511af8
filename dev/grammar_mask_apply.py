"""How should a grammar's packed bitmask (llguidance: int32 words, bit i % 32 of word i // 32 set
where token i is allowed) be applied to a row of logits on the CPU?

    python dev/grammar_mask_apply.py

Times, for a Qwen-sized vocabulary (151,936) and a dense (half allowed) and a sparse (0.1%)
mask: llguidance's own helper (torch.compile'd), a numpy boolean assignment after
np.unpackbits, and torch's masked_fill_ on the unpacked bits (what engine/grammar.py does).
"""
import time

import numpy as np
import torch

V = 151_936


def timed(fn, n=200) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    import llguidance.torch as lt
    words = (V + 31) // 32
    for density in (0.5, 0.001):
        allowed = np.random.rand(words * 32) < density
        mask = torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())
        logits = torch.randn(V)

        def unpacked():
            return np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:V]

        def numpy_assign():
            logits.numpy()[unpacked() == 0] = -np.inf

        def torch_masked_fill():
            logits.masked_fill_(~torch.from_numpy(unpacked().view(bool)), float("-inf"))

        def llguidance_helper():
            lt.apply_token_bitmask_inplace(logits.view(1, -1), mask.view(1, -1))

        for name, fn in (("numpy assign", numpy_assign), ("torch masked_fill", torch_masked_fill),
                         ("llguidance helper", llguidance_helper)):
            print(f"density {density}: {name:18s} {timed(fn, 20 if 'llguidance' in name else 200):8.0f} us")


if __name__ == "__main__":
    main()
