"""Train the bundled demo model: a small DeepSeek-V3-architecture MoE (MLA attention, a shared
expert, sigmoid group-limited router, 16 routed experts, first layer dense) on the English prose
of the Python documentation (see scripts/demo_corpus.py), with a byte-level BPE tokenizer.

    python scripts/demo_corpus.py .demo_data/corpus.txt
    python scripts/train_demo.py --corpus .demo_data/corpus.txt --tokenizer .demo_data/tokenizer --tokenizer_only
    python scripts/train_demo.py --corpus .demo_data/corpus.txt --tokenizer .demo_data/tokenizer \\
        --out .demo_data/ckpt --device cuda --steps 4000 --batch 128 --seq_len 512 --max_minutes 8

The model is transformers' own DeepseekV3ForCausalLM. Experts are balanced the DeepSeek-V3 way
(no auxiliary loss): after each step every MoE layer's `mlp.gate.e_score_correction_bias` moves
by +-u against each expert's share of the routed tokens. The learning rate follows a warmup and
a cosine decay over whichever ends first, --steps or --max_minutes, so a run stopped by the
clock still ends annealed. At the end the weights are saved as fp16 safetensors shards (the
router in fp32, as transformers keeps it) with config.json and the tokenizer, and a few samples
are printed.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"
# llama.cpp's "qwen2" pre-tokenizer (and transformers' Qwen2 one): what a GGUF of this tokenizer says.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# A base LM: the "chat" is the messages' text, one per line; the model continues it.
CHAT_TEMPLATE = ("{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
                 "{{ message['content'] }}{% endfor %}")
SAMPLE_PROMPTS = ["The list", "A function is", "The Python interpreter", "In this tutorial, we"]


# ---------------------------------------------------------------------------------------------
# corpus and tokenizer

def read_pages(corpus: str | Path) -> list[str]:
    """The corpus as pages: paragraphs joined by newlines (the file separates pages by EOS lines)."""
    text = Path(corpus).read_text(encoding="utf-8")
    return [page.strip("\n") for page in text.split(f"\n{EOS}\n") if page.strip()]


def train_tokenizer(pages: list[str], vocab_size: int = 4096):
    """Byte-level BPE with the qwen2 split regex and `<|endoftext|>` (id 0) as bos = eos."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(pages, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None,
                                   chat_template=CHAT_TEMPLATE, model_max_length=1024, clean_up_tokenization_spaces=False)


def load_or_train_tokenizer(path: str | Path, pages: list[str], vocab_size: int):
    from transformers import PreTrainedTokenizerFast
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    t0 = time.time()
    tok = train_tokenizer(pages, vocab_size)
    tok.save_pretrained(path)
    print(f"trained a {len(tok)}-token byte-level BPE in {time.time() - t0:.0f} s -> {path}", flush=True)
    return tok


def encode_pages(tok, pages: list[str]) -> torch.Tensor:
    """All pages as one token stream, each page followed by EOS."""
    eos = tok.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(pages, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int16 if len(tok) < 32768 else torch.int32)


def split_pages(pages: list[str], every: int = 40) -> tuple[list[str], list[str]]:
    """Every `every`-th page held out for validation."""
    return ([p for i, p in enumerate(pages) if i % every != every // 2],
            [p for i, p in enumerate(pages) if i % every == every // 2])


# ---------------------------------------------------------------------------------------------
# model

def demo_config(vocab_size: int = 4096, eos_id: int = 0):
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None)


def build_model(config, device: str, experts_impl: str = "auto"):
    from transformers import AutoModelForCausalLM
    impls = [experts_impl] if experts_impl != "auto" else (["grouped_mm", "eager"] if device.startswith("cuda")
                                                           else ["eager"])
    for i, impl in enumerate(impls):
        try:
            kw = {} if impl == "eager" else {"experts_implementation": impl}
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw).to(device)
            ids = torch.randint(0, config.vocab_size, (2, 16), device=device)
            with autocast(device):  # fail here, not mid-run, if the implementation cannot train
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
            return model, impl
        except Exception as e:  # an older transformers without that experts implementation
            if i == len(impls) - 1:
                raise
            print(f"experts_implementation={impl} unavailable ({type(e).__name__}: {e}); trying {impls[i + 1]}")


class ExpertBalancer:
    """Aux-loss-free balancing (DeepSeek-V3): count each gate's routed tokens in a forward hook;
    after each optimizer step move the gate's e_score_correction_bias by +-u against the load."""

    def __init__(self, model, u: float):
        self.u = u
        self.gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate") and
                      hasattr(m, "e_score_correction_bias")]
        self.counts = [torch.zeros(g.e_score_correction_bias.numel(), device=g.e_score_correction_bias.device)
                       for g in self.gates]
        self.last = [c.clone() for c in self.counts]
        for g, c in zip(self.gates, self.counts):
            g.register_forward_hook(self._hook(c))

    @staticmethod
    def _hook(counts):
        def hook(module, args, output):
            if module.training:
                counts.add_(torch.bincount(output[2].flatten(), minlength=counts.numel()).to(counts.dtype))
        return hook

    @torch.no_grad()
    def step(self) -> None:
        for g, c, last in zip(self.gates, self.counts, self.last):
            if self.u:
                g.e_score_correction_bias += self.u * torch.sign(c.mean() - c)
            last.copy_(c)
            c.zero_()

    def imbalance(self) -> list[float]:
        """Per MoE layer: the busiest expert's load over the mean load, at the last step."""
        return [(c.max() / c.mean().clamp_min(1)).item() for c in self.last]


# ---------------------------------------------------------------------------------------------
# training

def batches(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    n = stream.numel() - seq_len
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        yield torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate(model, val: torch.Tensor, seq_len: int, device: str, batches_: int = 8, batch: int = 16) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    it = batches(val, batch, seq_len, gen)
    losses = []
    for _ in range(batches_):
        ids = next(it).to(device)
        with autocast(device):
            losses.append(model(input_ids=ids, labels=ids, use_cache=False).loss.float().item())
    model.train()
    return sum(losses) / len(losses)


def autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def lr_at(progress: float, lr: float, warmup: float, min_ratio: float) -> float:
    if progress < warmup:
        return lr * progress / warmup
    t = (progress - warmup) / max(1e-9, 1 - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@torch.no_grad()
def sample(model, tok, prompt: str, n: int, device: str, temperature: float = 0.0, top_k: int = 40,
           seed: int = 0) -> str:
    """Continuation of `prompt` (full recompute per token: no cache needed at this size)."""
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([tok(prompt)["input_ids"]], device=device)
    eos = tok.eos_token_id
    for _ in range(n):
        with autocast(device):
            logits = model(input_ids=ids[:, -model.config.max_position_embeddings:], use_cache=False).logits[0, -1]
        logits = logits.float()
        if temperature <= 0:
            nxt = logits.argmax()
        else:
            top = torch.topk(logits / temperature, top_k)
            nxt = top.indices[torch.multinomial(top.values.softmax(-1), 1, generator=gen)[0]]
        if nxt.item() == eos:
            break
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train()
    return tok.decode(ids[0].tolist())


def save_checkpoint(model, tok, out: str | Path, max_shard_bytes: int = 14 * 2**20, extra: dict | None = None) -> None:
    """fp16 safetensors shards (router weight + bias fp32) with the HF index, config and tokenizer."""
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in model.state_dict().items():
        keep32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        state[name] = t.detach().to("cpu", torch.float32 if keep32 else torch.float16).contiguous()
    shards: list[dict] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total, **(extra or {})}, "weight_map": weight_map}, indent=1))
    model.config.save_pretrained(out)
    tok.save_pretrained(out)


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32):
    """The model saved by save_checkpoint (transformers' class, weights loaded strictly)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    state = {}
    for fname in sorted(set(index["weight_map"].values())):
        state.update(load_file(path / fname))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="text from scripts/demo_corpus.py")
    p.add_argument("--tokenizer", required=True, help="tokenizer dir: loaded if it has tokenizer.json, else trained there")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokenizer_only", action="store_true", help="build the tokenizer and stop")
    p.add_argument("--out", help="checkpoint dir")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min_lr_ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--bias_update", type=float, default=1e-3, help="u of the aux-loss-free balancing (0: off)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max_minutes", type=float, default=0, help="stop (annealed, saved) after this wall time")
    p.add_argument("--experts_impl", default="auto", help="transformers experts implementation (auto: grouped_mm on CUDA)")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--keep_best", type=int, default=1, help="save the weights of the best validation loss seen")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t_start = time.time()

    pages = read_pages(args.corpus)
    train_pages, val_pages = split_pages(pages)
    tok = load_or_train_tokenizer(args.tokenizer, train_pages, args.vocab)
    if args.tokenizer_only:
        return
    if not args.out:
        p.error("--out is needed to train")
    train, val = encode_pages(tok, train_pages), encode_pages(tok, val_pages)
    print(f"corpus: {len(train_pages)} train pages = {train.numel():,} tokens, {len(val_pages)} val pages = "
          f"{val.numel():,} tokens ({len(pages[0]) and sum(map(len, pages)) / (train.numel() + val.numel()):.2f} "
          f"chars/token)", flush=True)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    config = demo_config(len(tok), tok.eos_token_id)
    model, impl = build_model(config, args.device, args.experts_impl)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, experts_implementation={impl}, device={args.device}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=args.device.startswith("cuda"))
    balancer = ExpertBalancer(model, args.bias_update)
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train, args.batch, args.seq_len, gen)
    budget = args.max_minutes * 60
    t_train = time.time()
    step, tokens, loss_acc, n_acc, last_log = 0, 0, 0.0, 0, time.time()
    history = []
    best: tuple = (float("inf"), 0, 0, None, None)
    failed = None
    while True:
        try:
            elapsed = time.time() - t_start
            progress = max(step / args.steps, elapsed / budget if budget else 0.0)
            if progress >= 1.0:
                break
            lr = lr_at(progress, args.lr, args.warmup, args.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            ids = next(data).to(args.device, non_blocking=True)
            with autocast(args.device):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            balancer.step()
            step += 1
            tokens += ids.numel()
            loss_acc += loss.detach().float()
            n_acc += 1
            if step % args.log_every == 0 or step == 1:
                mean = (loss_acc / n_acc).item()
                now = time.time()
                rate = (n_acc * ids.numel()) / (now - last_log)
                imb = " ".join(f"{x:.2f}" for x in balancer.imbalance())
                print(f"step {step:5d}  loss {mean:.3f}  lr {lr:.2e}  tokens {tokens / 1e6:6.1f}M  {rate / 1e3:6.0f}k tok/s  "
                      f"max/mean expert load {imb}  [{now - t_start:.0f}s]", flush=True)
                history.append({"step": step, "loss": round(mean, 4), "tokens": tokens})
                loss_acc, n_acc, last_log = 0.0, 0, now
            if step % args.eval_every == 0:
                v = evaluate(model, val, args.seq_len, args.device)
                print(f"step {step:5d}  val loss {v:.3f}", flush=True)
                if args.keep_best and v < best[0]:
                    best = (v, step, tokens, {k: t.detach().clone() for k, t in model.state_dict().items()},
                            history[-1]["loss"] if history else None)
        except Exception as e:  # noqa: BLE001 -- keep what was learnt: save, then fail
            import traceback
            traceback.print_exc()
            failed = e
            break

    train_s = time.time() - t_train
    val_loss = evaluate(model, val, args.seq_len, args.device)
    final = {"steps": step, "tokens_seen": tokens, "val_loss": round(val_loss, 4)}
    if args.keep_best and best[0] < val_loss:  # the data is small: later steps may overfit it
        print(f"keeping step {best[1]} (val loss {best[0]:.3f}) over the last step ({val_loss:.3f})", flush=True)
        model.load_state_dict(best[3])
        step, tokens, val_loss = best[1], best[2], best[0]
        history.append({"step": step, "loss": best[4], "tokens": tokens})
    stats = {"steps": step, "tokens_seen": tokens, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
             "last_train_loss": history[-1]["loss"] if history else None, "val_loss": round(val_loss, 4),
             "train_seconds": round(train_s), "parameters": n_params, "experts_implementation": impl,
             "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
             "torch": torch.__version__, "transformers": __import__("transformers").__version__,
             "run": final}
    print("done: " + json.dumps(stats), flush=True)
    save_checkpoint(model, tok, args.out, extra={k: str(v) for k, v in stats.items()})
    print(f"saved -> {args.out}", flush=True)
    if failed is not None:
        raise SystemExit(f"training stopped at step {step} by {type(failed).__name__}: {failed}")
    for prompt in SAMPLE_PROMPTS:
        print(f"--- greedy: {sample(model, tok, prompt, 48, args.device)!r}", flush=True)
        print(f"--- t=0.8:  {sample(model, tok, prompt, 48, args.device, temperature=0.8)!r}", flush=True)


if __name__ == "__main__":
    main()
