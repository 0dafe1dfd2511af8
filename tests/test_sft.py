"""Fine-tuning with the routed experts frozen on the CPU kernels: a LoRA step through the training
rule file (KExpertsCPU forward and backward) against the same step in plain transformers + peft
on the same weights; adapters saved and loaded by peft give the same logits; the chat data's
labels keep exactly the assistant's tokens; a short run lowers the loss it trains on."""
import json
import math

import pytest
import torch
from tiny import reference_state_dict, tiny_model, train_tokenizer, with_experts_kwargs
from transformers import AutoModelForCausalLM

pytest.importorskip("peft")

from ktransformers.kernels.cpu import MoEKernel  # noqa: E402
from ktransformers.operators.experts import KTransformersExperts  # noqa: E402
from ktransformers.train import (  # noqa: E402
    SFT_RULES_CPU,
    add_lora,
    load_adapter,
    load_examples,
    load_for_training,
    mean_loss,
    train,
)
from ktransformers.train.data import IGNORE, Example, render  # noqa: E402
from ktransformers.weights.ggml_quants import GGMLType  # noqa: E402
from ktransformers.weights.gguf_write import write_gguf  # noqa: E402

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss")


def lora_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="needs a CUDA device (the training rule file puts the dense part there)")


def pair(tmp_path, family, seed=0, int8_backward=False, targets=None, **experts_kwargs):
    """(ours: the GGUF through MoE-sft-cpu.yaml, reference: transformers on the same weights), each
    with LoRA adapters on `targets` (default: the attention projections), ours' random A and B
    copied to the reference. `int8_backward`: the rule file's (False: the exact backward)."""
    model = tiny_model(family, seed=seed)
    path = tmp_path / f"{family}.gguf"
    types = write_gguf(path, model.config, model.state_dict(), types=GGMLType.F32)
    rules = with_experts_kwargs(SFT_RULES_CPU, tmp_path, int8_backward=int8_backward, **experts_kwargs)
    ours = load_for_training(path, optimize_config_path=rules, device="cpu", progress=False, cpu_infer=2,
                             tokenizer=False).model
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    reference.load_state_dict(reference_state_dict(model, types))
    reference.train()
    torch.manual_seed(seed)
    ours = add_lora(ours, rank=4, alpha=8, init=False, targets=targets)
    reference = add_lora(reference, rank=4, alpha=8, init=False, targets=targets)
    state = {k.removeprefix("base_model.model."): v for k, v in lora_state(ours).items()}
    want = {k.removeprefix("base_model.model."): k for k in lora_state(reference)}
    assert state and state.keys() == want.keys()  # (ours with expert adapters alone is no peft model)
    reference.load_state_dict({want[k]: v for k, v in state.items()}, strict=False)
    return ours, reference, model.config


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_lora_step_equals_transformers_and_peft(tmp_path, family, int8, monkeypatch):
    """The exact backward to float32 rounding; the int8 one (the shipped rule files') within its
    rounding (1.7e-3 measured on qwen3_moe's LoRA gradients)."""
    ours, reference, config = pair(tmp_path, family, int8_backward=int8)
    bound = 3e-2 if int8 else 1e-3
    calls = []
    backward = MoEKernel.backward
    monkeypatch.setattr(MoEKernel, "backward", lambda self, *a: calls.append(self.name) or backward(self, *a))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=gen)
    labels = ids.clone()
    labels[:, :4] = IGNORE  # (a prompt part, as the chat data has)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # a padded row
    labels[1, -3:] = IGNORE
    for model in (ours, reference):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    moe_layers = sum(1 for m in ours.modules() if isinstance(m, KTransformersExperts))
    assert moe_layers and len(calls) == moe_layers  # (every MoE layer backed up through the C++ kernel)
    with torch.no_grad():
        loss_ours = float(ours(input_ids=ids, attention_mask=mask, labels=labels).loss)
        loss_ref = float(reference(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert abs(loss_ours - loss_ref) < 1e-4 * abs(loss_ref)
    g_ours, g_ref = grads(ours), grads(reference)
    assert g_ours.keys() == g_ref.keys() and len(g_ours) >= 8
    for name, want in g_ref.items():
        assert want.abs().max() > 0, name
        err = ((g_ours[name] - want).norm() / want.norm()).item()
        assert err < bound, f"{family} {name}: relative error {err:.2e}"
    # the same optimizer step on both: the next losses agree too
    for model in (ours, reference):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        opt.step()
    with torch.no_grad():
        after_ours = float(ours(input_ids=ids, attention_mask=mask, labels=labels).loss)
        after_ref = float(reference(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert abs(after_ours - after_ref) < bound * abs(after_ref)
    assert abs(after_ref - loss_ref) > 1e-5  # (the step moved something)


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_lora_step_on_the_routed_experts_equals_transformers_and_peft(tmp_path, family, int8):
    """LoRA on the routed experts (gate_up and down of every expert) beside the attention's: ours
    (the frozen experts' per-pair products on the C++ kernels, the adapters in torch) against
    peft's target_parameters on transformers' experts; the same state-dict names, the same loss,
    gradients and next step. gpt-oss: gate and up alternate in the adapter's rows, with biases and
    the clamped SwiGLU."""
    ours, reference, config = pair(tmp_path, family, seed=4, int8_backward=int8, targets=["attention", "experts"])
    bound = 3e-2 if int8 else 1e-3
    experts = [m for m in ours.modules() if isinstance(m, KTransformersExperts)]
    assert experts and all(set(m.adapters) == {"gate_up_proj", "down_proj"} for m in experts)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    labels = ids.masked_fill(mask == 0, IGNORE)
    losses = []
    for model in (ours, reference):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(float(loss.detach()))
    # (int8_backward: the forward's per-pair products run on the int8 copies too)
    assert abs(losses[0] - losses[1]) < (1e-3 if int8 else 1e-4) * abs(losses[1])
    g_ours, g_ref = grads(ours), grads(reference)
    assert g_ours.keys() == g_ref.keys()
    expert_grads = [n for n in g_ref if ".experts." in n]
    assert len(expert_grads) == 4 * len(experts)  # (A and B of gate_up and of down, each layer)
    for name, want in g_ref.items():
        assert want.abs().max() > 0, name
        err = ((g_ours[name] - want).norm() / want.norm()).item()
        assert err < bound, f"{family} {name}: relative error {err:.2e}"
    for model in (ours, reference):
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    with torch.no_grad():
        after = [float(m(input_ids=ids, attention_mask=mask, labels=labels).loss) for m in (ours, reference)]
    assert abs(after[0] - after[1]) < bound * abs(after[1]) and abs(after[1] - losses[1]) > 1e-5


@ON_CUDA
@pytest.mark.parametrize("family, targets", [("deepseek_v3", ["attention"]), ("deepseek_v3", ["attention", "experts"]),
                                             ("gpt_oss", ["attention", "experts"])])
def test_a_lora_step_with_the_dense_part_on_the_gpu(tmp_path, family, targets):
    """MoE-sft.yaml on a CUDA device (float32 there): DeepSeek-V3 with its shared experts on the GPU
    beside the CPU experts, gpt-oss with its experts' biases; the experts' adapters on the GPU.
    The loss and the adapters' gradients equal transformers + peft's on the CPU."""
    from ktransformers.train import SFT_RULES
    model = tiny_model(family, seed=19)
    path = tmp_path / f"{family}.gguf"
    types = write_gguf(path, model.config, model.state_dict(), types=GGMLType.F32)
    rules = with_experts_kwargs(SFT_RULES, tmp_path, int8_backward=False)
    ours = load_for_training(path, optimize_config_path=rules, device="cuda", dtype=torch.float32, progress=False,
                             cpu_infer=2, tokenizer=False).model
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    reference.load_state_dict(reference_state_dict(model, types))
    reference.train()
    ours = add_lora(ours, rank=4, alpha=8, init=False, targets=targets)
    reference = add_lora(reference, rank=4, alpha=8, init=False, targets=targets)
    reference.load_state_dict({k: v.cpu() for k, v in lora_state(ours).items()}, strict=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(20))
    loss = ours(input_ids=ids.cuda(), labels=ids.cuda()).loss
    loss.backward()
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    assert abs(float(loss) - float(want)) < 1e-4 * abs(float(want))
    g_ours, g_ref = grads(ours), grads(reference)
    assert g_ours.keys() == g_ref.keys()
    for name, g in g_ref.items():
        assert ((g_ours[name].cpu() - g).norm() / g.norm()).item() < 1e-3, name


@ON_CUDA
def test_expert_adapters_train_a_bf16_model_on_the_gpu(tmp_path):
    """MoE-sft.yaml as shipped (bf16 on the GPU, int8 backward), adapters on the attention and the
    experts: the loss and the experts' adapters' gradients within bf16's reach of the float32
    model's."""
    model = tiny_model("qwen3_moe", seed=21)
    path = tmp_path / "qwen3_moe.gguf"
    write_gguf(path, model.config, model.state_dict(), types=GGMLType.F32)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(22)).cuda()
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_for_training(path, device="cuda", dtype=dtype, progress=False, cpu_infer=2, tokenizer=False).model
        torch.manual_seed(23)
        ours = add_lora(ours, rank=4, alpha=8, init=False, targets=["attention", "experts"])
        loss = ours(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((float(loss), {n: g for n, g in grads(ours).items() if ".experts." in n}))
    (want, g_want), (got, g_got) = results
    assert g_want and g_got.keys() == g_want.keys()
    assert abs(got - want) < 2e-2 * abs(want)
    for name, g in g_want.items():
        assert ((g_got[name] - g).norm() / g.norm()).item() < 0.1, name


def test_expert_adapters_on_the_torch_experts_op(tmp_path):
    """The experts' adapters on KExpertsTorch (dense weights, torch's own backward) give the same
    loss and gradients as transformers + peft."""
    ours, reference, config = pair(tmp_path, "mixtral", seed=17, targets=["experts"], prefill_op="KExpertsTorch",
                                   generate_op="KExpertsTorch")
    experts = [m for m in ours.modules() if isinstance(m, KTransformersExperts)]
    assert experts and all(type(m.ops["prefill"]).__name__ == "KExpertsTorch" and m.adapters for m in experts)
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(18))
    losses = []
    for model in (ours, reference):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach()))
    assert abs(losses[0] - losses[1]) < 1e-4 * abs(losses[1])
    g_ours = {n.removeprefix("base_model.model."): g for n, g in grads(ours).items()}
    g_ref = {n.removeprefix("base_model.model."): g for n, g in grads(reference).items()}
    assert g_ours.keys() == g_ref.keys() and g_ref
    for name, want in g_ref.items():
        assert ((g_ours[name] - want).norm() / want.norm()).item() < 1e-3, name


def test_expert_adapters_save_and_load_both_ways(tmp_path):
    """An adapter with expert LoRA saved by ours loads on transformers + peft with the same logits,
    and one saved by transformers + peft loads on ours; experts-only adapters (no peft wrapper on
    ours) too; DPO's reference switches the experts' adapters off."""
    import peft
    from ktransformers.train import adapters_disabled, save_adapter
    ours, reference, config = pair(tmp_path, "qwen3_moe", seed=12, targets=["attention", "experts"])
    ids = torch.randint(0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        assert torch.allclose(ours(input_ids=ids).logits, want, atol=1e-4)
        with adapters_disabled(ours), reference.disable_adapter():
            assert torch.allclose(ours(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-4)
    save_adapter(ours, tmp_path / "ours")
    reference.save_pretrained(tmp_path / "theirs")
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    base = reference.get_base_model()
    rules = with_experts_kwargs(SFT_RULES_CPU, tmp_path, int8_backward=False)  # (pair's: the exact products)

    def fresh_model():
        return load_for_training(tmp_path / "qwen3_moe.gguf", optimize_config_path=rules, device="cpu", progress=False,
                                 cpu_infer=2, tokenizer=False).model
    for source in ("ours", "theirs"):
        fresh = fresh_model()
        hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                                            str(tmp_path / source))
        hf.get_base_model().load_state_dict({k: v for k, v in base.state_dict().items() if "lora_" not in k},
                                            strict=False)
        with torch.no_grad():
            assert torch.allclose(load_adapter(fresh, str(tmp_path / source))(input_ids=ids).logits, want, atol=1e-4)
            assert torch.allclose(hf(input_ids=ids).logits, want, atol=1e-4), source
    only = add_lora(fresh_model(), rank=2, targets=["experts.down_proj"], init=False)
    with torch.no_grad():
        want = only(input_ids=ids).logits
    save_adapter(only, tmp_path / "only")
    fresh = fresh_model()
    with torch.no_grad():
        assert torch.allclose(load_adapter(fresh, str(tmp_path / "only"))(input_ids=ids).logits, want, atol=1e-5)


def test_saved_adapter_loads_with_the_same_logits(tmp_path):
    ours, _, config = pair(tmp_path, "qwen3_moe", seed=2)
    ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours(input_ids=ids).logits
    ours.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    # (pair's rules: on AMX, int8_backward's would move the forward to the int8 copies)
    rules = with_experts_kwargs(SFT_RULES_CPU, tmp_path, int8_backward=False)
    fresh = load_for_training(tmp_path / "qwen3_moe.gguf", optimize_config_path=rules, device="cpu", progress=False,
                              cpu_infer=2, tokenizer=False).model
    with torch.no_grad():
        base = fresh(input_ids=ids).logits
        got = load_adapter(fresh, str(tmp_path / "adapter"))(input_ids=ids).logits
    assert not torch.allclose(base, want, atol=1e-4)  # (the adapter changes the logits)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = train_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]})
    return tok


def test_labels_keep_exactly_the_assistant_tokens(chat_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and the sea?"},
                {"role": "assistant", "content": "it is wide and deep"}]
    e = render(chat_tokenizer, messages, "test", 512)
    learned = chat_tokenizer.decode([t for t, label in zip(e.input_ids, e.labels) if label != IGNORE])
    assert learned == "hi<|end|>it is wide and deep<|end|>"
    assert all(label in (IGNORE, t) for t, label in zip(e.input_ids, e.labels))
    short = render(chat_tokenizer, messages, "test", 6)
    assert len(short.input_ids) == 6


def test_bad_records_name_the_line(tmp_path, chat_tokenizer):
    path = tmp_path / "data.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    for bad, message in ((good | {"messages": [{"role": "user", "content": "a"}]}, "no assistant message"),
                         ({"text": "x"}, "expected 'messages'"), ("[1, 2", "not JSON")):
        line = bad if isinstance(bad, str) else json.dumps(bad)
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=rf"data.jsonl:2: {message}"):
            load_examples(path, chat_tokenizer, 64)
    path.write_text(json.dumps({"prompt": "2+2?", "completion": "4"}) + "\n" +
                    json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
    assert [e.learned for e in load_examples(path, chat_tokenizer, 64)] == [
        len(chat_tokenizer("4<|end|>", add_special_tokens=False).input_ids),
        len(chat_tokenizer("yo<|end|>", add_special_tokens=False).input_ids)]


def test_a_short_run_lowers_its_loss(tmp_path):
    ours, _, config = pair(tmp_path, "qwen3_moe", seed=4)
    gen = torch.Generator().manual_seed(5)
    examples = []
    for _ in range(4):
        ids = torch.randint(0, config.vocab_size, (12,), generator=gen).tolist()
        examples.append(Example(ids, [IGNORE] * 4 + ids[4:]))
    before = mean_loss(ours, examples, "cpu")
    reports = train(ours, examples, steps=12, lr=3e-3, batch_size=2, device="cpu", progress=False)
    assert len(reports) == 12 and all(r.tokens == 24 for r in reports)
    assert mean_loss(ours, examples, "cpu") < 0.9 * before


def random_pairs(vocab: int, n: int, seed: int):
    from ktransformers.train.dpo import Pair
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(0, vocab, (5,), generator=gen).tolist()
        answers = [torch.randint(0, vocab, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(2)]
        out.append(Pair(*(Example(prompt + a, [IGNORE] * 5 + a) for a in answers)))
    return out


def test_dpo_loss_and_gradients_equal_transformers_and_peft(tmp_path):
    """The DPO step (policy: the adapters on, reference: off) on ours and on transformers + peft,
    and its loss against the formula written out here."""
    from ktransformers.train.dpo import dpo_loss, reference_logps, sequence_logps
    ours, reference, config = pair(tmp_path, "qwen3_moe", seed=6)
    pairs = random_pairs(config.vocab_size, 3, seed=7)
    losses = []
    for model in (ours, reference):
        ref = torch.tensor(reference_logps(model, pairs, "cpu"))
        logps = sequence_logps(model, [e for p in pairs for e in (p.chosen, p.rejected)], "cpu")
        loss, _, _ = dpo_loss(logps[0::2], logps[1::2], ref[:, 0], ref[:, 1], beta=0.5)
        loss.backward()
        losses.append(float(loss.detach()))
        # the formula, by hand: mean log(1 + exp(-beta * ((pc - rc) - (pr - rr))))
        logps = logps.detach()
        m = 0.5 * ((logps[0::2] - ref[:, 0]) - (logps[1::2] - ref[:, 1]))
        assert abs(float(torch.log1p(torch.exp(-m)).mean()) - losses[-1]) < 1e-6
    assert abs(losses[0] - losses[1]) < 1e-4 * abs(losses[1])
    g_ours, g_ref = grads(ours), grads(reference)
    for name, want in g_ref.items():
        err = ((g_ours[name] - want).norm() / want.norm()).item()
        assert err < 1e-3, f"{name}: relative error {err:.2e}"


def test_dpo_starts_at_log2_and_learns(tmp_path):
    from ktransformers.train.dpo import evaluate_dpo, train_dpo
    model = tiny_model("qwen3_moe", seed=8)
    path = tmp_path / "m.gguf"
    write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q8_0)
    ours = add_lora(load_for_training(path, device="cpu", progress=False, cpu_infer=2, tokenizer=False).model, rank=4)
    pairs = random_pairs(model.config.vocab_size, 4, seed=9)
    loss, accuracy = evaluate_dpo(ours, pairs, 0.1, "cpu")
    assert abs(loss - math.log(2)) < 1e-6 and accuracy == 0.0  # (B = 0: the policy is the reference)
    reports = train_dpo(ours, pairs, steps=10, lr=1e-2, beta=0.1, batch_size=2, device="cpu", progress=False)
    assert len(reports) == 10
    after, accuracy = evaluate_dpo(ours, pairs, 0.1, "cpu")
    assert after < 0.9 * math.log(2) and accuracy == 1.0


def test_bad_preference_records_name_the_line(tmp_path, chat_tokenizer):
    from ktransformers.train.dpo import load_pairs
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    for bad, message in (({"prompt": "a", "chosen": "b"}, "a preference record needs 'prompt', 'chosen' and 'rejected'"),
                         (good | {"chosen": 3}, "'chosen' must be a string or an assistant message")):
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=rf"pairs.jsonl:2: {message}"):
            load_pairs(path, chat_tokenizer, 64)
    path.write_text(json.dumps(good | {"chosen": {"role": "assistant", "content": "yes"}}) + "\n")
    (p,) = load_pairs(path, chat_tokenizer, 64)
    assert chat_tokenizer.decode([t for t, l in zip(p.chosen.input_ids, p.chosen.labels) if l != IGNORE]) == "yes<|end|>"


def test_an_adapter_merged_at_load_gives_the_trained_models_logits(tmp_path):
    """load_model(lora_path=...) (the inference rule file, C++ kernels) against the training model
    with the adapter on; the adapter moves the logits, and a foreign or broken one is refused."""
    from ktransformers import load_model
    from ktransformers.weights.source import WeightError
    trained, _, config = pair(tmp_path, "qwen3_moe", seed=10)
    trained.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        base = load_model(tmp_path / "qwen3_moe.gguf", tokenizer=False, progress=False).model(input_ids=ids).logits
        got = load_model(tmp_path / "qwen3_moe.gguf", tokenizer=False, progress=False,
                         lora_path=tmp_path / "adapter").model(input_ids=ids).logits
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(base, want) > 1e-2
    assert rel(got, want) < 1e-3
    with pytest.raises(WeightError, match="not a peft adapter directory"):
        load_model(tmp_path / "qwen3_moe.gguf", tokenizer=False, progress=False, lora_path=tmp_path)
    (tmp_path / "other").mkdir()
    other, _, _ = pair(tmp_path / "other", "deepseek_v3", seed=1)  # (its attention's linears have other names)
    other.save_pretrained(tmp_path / "deepseek-adapter")
    with pytest.raises(WeightError, match="does not have"):
        load_model(tmp_path / "qwen3_moe.gguf", tokenizer=False, progress=False, lora_path=tmp_path / "deepseek-adapter")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_an_expert_adapter_merged_at_load_gives_the_trained_models_logits(tmp_path, family):
    """An adapter on the routed experts (and the attention) merged at load into the experts' stacks
    (gpt-oss: gate and up alternate in its rows), through the inference rule file: the trained
    model's logits."""
    from ktransformers import load_model
    from ktransformers.train import save_adapter
    trained, _, config = pair(tmp_path, family, seed=15, targets=["attention", "experts"])
    trained.save_pretrained(tmp_path / "adapter")  # (save_adapter, through peft's method)
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        got = load_model(tmp_path / f"{family}.gguf", tokenizer=False, progress=False,
                         lora_path=tmp_path / "adapter").model(input_ids=ids).logits
        for m in trained.modules():
            if isinstance(m, KTransformersExperts):
                m.adapters_enabled = False
        without = trained(input_ids=ids).logits  # (the attention's adapters alone)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(without, want) > 1e-2
    assert rel(got, want) < 1e-3
    save_adapter(trained, tmp_path / "again")
    assert (tmp_path / "again" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()


def test_the_training_memory_plan_refuses_with_numbers(tmp_path):
    from ktransformers.optimize.memory import MemoryBudgetError
    from ktransformers.train.memory import check_training, plan_training
    model, _, config = pair(tmp_path, "qwen3_moe", seed=12, int8_backward=True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def kinds(**kw):
        return plan_training(model, config, device="cpu", dtype=torch.float32, **kw).per_device_kind()["cpu"]
    one, two = kinds(tokens=100), kinds(tokens=200)
    assert one["adapters, gradients and optimizer state"] == 16 * trainable
    assert two["activations"] == 2 * one["activations"] > 0
    assert two["MoE layers' saved inputs"] == 2 * one["MoE layers' saved inputs"]
    checkpointed = kinds(tokens=100, checkpointing=True)
    assert checkpointed["activations (checkpointed)"] < one["activations"]
    layers = sum(1 for m in model.modules() if isinstance(m, KTransformersExperts))
    E, H, I, K = config.num_experts, config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    # (the forward's g and u, which the backward takes; int8 copies of D^T, G^T and U^T: 1 byte a weight)
    assert one["the MoE layers' g and u"] == layers * 100 * K * 2 * I * 4 == layers * checkpointed["the MoE layers' g and u"]
    assert one["the backward's int8 copies"] == layers * E * H * I * 3
    plan = plan_training(model, config, tokens=100, device="cpu", dtype=torch.float32)
    check_training(plan, {"cpu": 1 << 40})
    with pytest.raises(MemoryBudgetError, match=r"cpu needs .* more \(adapters.*\) but has 1000 B free: lower"):
        check_training(plan, {"cpu": 1000})


def test_the_training_memory_plan_counts_expert_adapters(tmp_path):
    from ktransformers.train.memory import plan_training
    model, _, config = pair(tmp_path, "qwen3_moe", seed=14, targets=["attention", "experts"])
    layers = sum(1 for m in model.modules() if isinstance(m, KTransformersExperts))

    def kinds(**kw):
        return plan_training(model, config, device="cpu", dtype=torch.float32, **kw).per_device_kind()["cpu"]
    one, two, kept = kinds(tokens=100), kinds(tokens=200), kinds(tokens=100, checkpointing=True)
    H, I, K = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    assert one["the expert adapters' saved pairs"] == layers * 100 * K * (2 * H + 4 * I) * 4
    assert two["the expert adapters' saved pairs"] == 2 * one["the expert adapters' saved pairs"]
    assert kept["the expert adapters' saved pairs"] * layers == one["the expert adapters' saved pairs"]
    assert one["adapters, gradients and optimizer state"] == 16 * sum(p.numel() for p in model.parameters()
                                                                     if p.requires_grad)


def test_sft_flags_are_checked(capsys):
    from ktransformers.sft import parse_args
    for argv, message in ((["--lora_rank", "0"], "--lora_rank must be at least 1"),
                          (["--dpo", "--grad_accum", "4"], "--grad_accum and --warmup_steps are SFT's")):
        with pytest.raises(SystemExit):
            parse_args(["--data", "d.jsonl", "--output_dir", "o", *argv])
        assert message in capsys.readouterr().err
