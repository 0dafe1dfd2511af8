"""How far are our logits, llama.cpp's and transformers' fp32 apart on a GGUF that llama.cpp's own
converter makes from a tiny random model (f32 and bf16), and how much of the bf16 distance is the
file's rounding (the torch reference ops on the same weights) rather than the kernels?

    PYTHONPATH=. python dev/llamacpp_fidelity.py deepseek_v3 [LLAMA_VENV/bin/python]
    (ONE_GROUP=1: DeepSeek-V3's router with one expert group)

Needs the llama-cpp-python sdist's vendored llama.cpp under /tmp/llsrc (or LLAMA_SRC) and a venv with llama_cpp
(../shared/PEERS.md). KL(transformers fp32 || engine) per position, averaged.
"""
import sys, subprocess, json, torch, numpy as np
from pathlib import Path
sys.path.insert(0, "tests"); sys.path.insert(0, "scripts")
from tiny import tiny_model, RULES
from check_llamacpp_gguf import CONVERT, CONVERT_ARGS, make_tokenizer
from ktransformers import optimize_and_load_gguf
from ktransformers.loader import RULES_DIR, build_skeleton
fam = sys.argv[1] if len(sys.argv) > 1 else "deepseek_v3"
work = Path("/tmp/fid") / fam
model = tiny_model(fam)
import os
if os.environ.get("ONE_GROUP"):
    import tiny as T
    c = T.tiny_config(fam); c.n_group = 1; c.topk_group = 1
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(c, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters(): p.copy_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.1) + (1.0 if n.endswith("norm.weight") else 0))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"): b.copy_(torch.randn_like(b) * 0.01)
model.save_pretrained(work); make_tokenizer(work, model.config.vocab_size, fam)
L = os.environ.get("LLAMA_SRC", "/tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp")
ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ref = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].double(), -1)
def kl(lp):  # KL(ref || ours), mean over positions
    lp = torch.log_softmax(lp.double(), -1)
    return (ref.exp() * (ref - lp)).sum(-1).mean().item()
out = {}
for outtype in ("f32", "bf16"):
    path = work / f"m-{outtype}.gguf"
    subprocess.run([sys.executable, "-c", CONVERT, L, str(work), "--outfile", str(path), "--outtype", outtype,
                    *CONVERT_ARGS.get(fam, [])], check=True, capture_output=True)
    for rules in ("cpu", "torch"):
        ours = build_skeleton(model.config, torch.float32)
        rf = RULES_DIR / RULES[fam]
        if rules == "torch":
            t = rf.read_text().replace("KExpertsCPU", "KExpertsTorch").replace("KLinearCPU", "KLinearTorch")
            rf = work / "ref.yaml"; rf.write_text(t)
        optimize_and_load_gguf(ours, rf, path, model.config)
        with torch.no_grad():
            out[f"ours-{rules}-{outtype}"] = kl(ours(input_ids=ids, use_cache=False).logits[0])
    lp = subprocess.run([sys.argv[2] if len(sys.argv) > 2 else "/root/.cache/llama-venv/bin/python", "-c", r'''
import sys, json, llama_cpp, numpy as np
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, logits_all=True, verbose=False, n_threads=2)
ids = json.loads(sys.argv[2]); llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[:len(ids)], dtype=np.float32))
''', str(path), json.dumps(ids[0].tolist()), str(work / "ll.npy")], capture_output=True, text=True)
    if lp.returncode: print(lp.stderr[-2000:])
    else:
        out[f"llama.cpp-{outtype}"] = kl(torch.from_numpy(np.load(work / "ll.npy")))
        globals().setdefault("ll", {})[outtype] = torch.from_numpy(np.load(work / "ll.npy")).double()
for k, v in out.items(): print(f"{fam} {k:22} KL {v:.2e}")

a, b = torch.log_softmax(ll["f32"], -1), torch.log_softmax(ll["bf16"], -1)
print(f"{fam} llama.cpp bf16 vs its own f32    KL {(a.exp() * (a - b)).sum(-1).mean().item():.2e}")
