"""The benchmarks run and print what they promise (numbers are not checked: speed is measured by
the benchmarks, not by tests)."""
import json
import re
import subprocess
import sys

import pytest

from ktransformers.bench.synth import PRESETS

KEYS = {"shape", "format", "tokens", "threads", "isa", "median_us", "weight_bytes", "gbps", "stream_gbps", "tflops",
        "peer", "kernel_us", "kernel_gbps"}  # the keys, and the in-kernel time of the same calls


def test_bench_moe_json_rows():
    out = subprocess.run([sys.executable, "-m", "ktransformers.bench.moe", "--shapes", "tiny", "--formats", "Q4_K_M",
                          "BF16", "--tokens", "1", "8", "--iters", "3", "--copies", "1", "--stream-gib", "0.05",
                          "--int8", "--no-peer", "--json"], check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 4 and all(set(r) == KEYS for r in rows)
    assert [r["tokens"] for r in rows] == [1, 8, 1, 8]
    assert all(r["median_us"] > 0 and r["weight_bytes"] > 0 and r["stream_gbps"] > 0 and r["peer"] is None for r in rows)
    assert rows[0]["format"].startswith("Q4_K_M") and rows[2]["format"].startswith("BF16")


def test_stream_probe_buffer_kept():
    """bench.moe's probe reads one buffer a size for the whole process (written once, every page
    real), never a new one a probe."""
    from ktransformers.bench import moe
    from ktransformers.kernels.cpu import CPURuntime
    runtime, size = CPURuntime(1), int(0.01 * 2**30)
    assert moe.stream_gbps(runtime, 0.01, 2) > 0
    kept = moe._PROBE_BUFFERS[size]
    assert moe.stream_gbps(runtime, 0.01, 1) > 0 and moe._PROBE_BUFFERS[size] is kept
    assert kept.nbytes == size and (kept == 7).all()
    assert runtime.stream_gbps(buffer=kept, repeats=1) > 0


def test_bench_moe_types_fall_back_as_llama_quantize():
    """A format whose blocks do not divide a projection's rows falls back as llama-quantize does
    (GLM-4.5-Air's 1408-value down rows: Q4_K_M's Q6_K -> Q8_0), and the layer computes on what
    it holds: its output equals the dequantized experts' in float."""
    import gguf
    import torch

    from ktransformers.bench import moe
    from ktransformers.kernels.cpu import CPURuntime
    from ktransformers.weights.ggml_quants import GGMLType
    shape = dict(hidden=256, intermediate=96, experts=4, top_k=2)
    gen = torch.Generator().manual_seed(1)
    layer = moe.build_layers(CPURuntime(1), shape, "Q4_K_M", 1, 4, gen)[0]
    gate, up, down = layer.weights
    assert (gate.ggml_type, up.ggml_type, down.ggml_type) == (GGMLType.Q4_K, GGMLType.Q4_K, GGMLType.Q8_0)
    x = torch.randn(3, 256, generator=gen)
    ids = torch.tensor([[0, 3], [1, 2], [3, 1]])
    w = torch.rand(3, 2, generator=gen)
    # the reference decoder is the gguf package's
    g, u, d = (torch.from_numpy(gguf.quants.dequantize(p.data.numpy(), int(p.ggml_type))).float().reshape(s)
               for p, s in zip(layer.weights, ((4, 96, 256), (4, 96, 256), (4, 256, 96))))
    want = torch.zeros(3, 256)
    for t in range(3):
        for k in range(2):
            e = int(ids[t, k])
            want[t] += w[t, k] * (d[e] @ (torch.nn.functional.silu(g[e] @ x[t]) * (u[e] @ x[t])))
    got = layer.kernel.forward(x, ids, w)
    assert torch.allclose(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


def test_bench_moe_int4_copies():
    from ktransformers.kernels.cpu import load_extension
    out = subprocess.run([sys.executable, "-m", "ktransformers.bench.moe", "--shapes", "tiny", "--formats", "Q4_K_M",
                          "--tokens", "16", "--iters", "3", "--copies", "1", "--stream-gib", "0.05", "--int4", "--no-peer",
                          "--json"], check=True, capture_output=True, text=True).stdout
    row = json.loads(out)
    assert row["format"] == ("Q4_K_M+int4g128" if load_extension().int4_gemm else "Q4_K_M") and row["median_us"] > 0
    both = subprocess.run([sys.executable, "-m", "ktransformers.bench.moe", "--int8", "--int4"], capture_output=True,
                          text=True)
    assert both.returncode == 2 and "alternatives" in both.stderr
    none = subprocess.run([sys.executable, "-m", "ktransformers.bench.moe", "--rounds", "0"], capture_output=True, text=True)
    assert none.returncode == 2 and "--rounds must be at least 1" in none.stderr


DECODE_KEYS = {"engine", "version", "gguf", "threads", "prompt_tokens", "decode_tokens", "prefill_tok_s", "decode_tok_s",
               "decode_floor_tok_s", "stream_gbps", "decode_ratio"}


def test_bench_synth_and_decode_json_rows(tmp_path):
    """A synthetic model (real tensor names, random blocks, a made-up vocabulary) through bench.decode."""
    from gguf import GGUFReader
    config = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
              "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "m.gguf"
    subprocess.run([sys.executable, "-m", "ktransformers.bench.synth", "--config", str(tmp_path / "config.json"),
                    "--layers", "1", "--experts", "4", "--out", str(path)], check=True, capture_output=True)
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert "blk.0.ffn_gate_exps.weight" in names and "blk.1.attn_q.weight" not in names  # --layers 1
    assert [t.shape[-1] for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight"] == [4]  # --experts 4
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 512
    out = subprocess.run([sys.executable, "-m", "ktransformers.bench.decode", "--gguf_path", str(path), "--threads", "1",
                          "--prompt", "20", "--decode", "4", "--repeats", "1", "--stream-gib", "0.05", "--no-peer",
                          "--json", "--breakdown"], check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 1 and set(rows[0]) == DECODE_KEYS and rows[0]["engine"] == "ktransformers"
    assert rows[0]["prefill_tok_s"] > 0 and rows[0]["decode_tok_s"] > 0 and rows[0]["decode_floor_tok_s"] > 0
    # --breakdown: the layers' steps (which the engine calls without their forward hooks) are timed too
    spent = {m[1].strip(): float(m[2]) for m in re.finditer(r"^(\S.*?)\s+([\d.]+) ms/token$", out.stderr, re.M)}
    assert 0 < spent["KDecoderLayer steps (all layers)"] < spent["whole decode step"], spent
    assert 0 < spent["KTransformersLinear lm_head"] < spent["whole decode step"], spent
    # the CPU decode plan's kernels, each timed inside the layers' steps
    parts = {k: v for k, v in spent.items() if k.startswith("cpu_decode: ")}
    assert {"cpu_decode: q_proj", "cpu_decode: routed experts", "cpu_decode: router",
            "cpu_decode: attention (RoPE, cache write, attend)"} <= set(parts), spent
    assert all(v > 0 for v in parts.values()) and sum(parts.values()) < spent["KDecoderLayer steps (all layers)"], spent


def test_e2e_rooflines_split_hot_experts_and_extrapolate(tmp_path):
    """bench.e2e's byte counts: with hot experts, their share of each layer's expert reads moves
    from RAM to the GPU; extrapolating to more layers repeats the MoE layers' mean."""
    from ktransformers.bench.decode import layer_bytes, step_bytes
    from ktransformers.bench.e2e import extrapolated_bytes, hot_split
    from ktransformers.bench.synth import config_from_fields, write_synthetic
    from ktransformers.weights.gguf import GGUFFileSet
    config = config_from_fields({"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256,
                                 "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 3,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8,
                                 "num_experts_per_tok": 2})
    write_synthetic(config, tmp_path / "m.gguf")
    files = GGUFFileSet(tmp_path / "m.gguf")
    ram, gpu = step_bytes(files, config)
    assert hot_split(files, config, {}) == (ram, gpu)
    _, _, per = layer_bytes(files, config)
    ram2, gpu2 = hot_split(files, config, {1: 4, 2: 8})  # half of layer 1's experts, all of layer 2's
    moved = per[1][0] / 2 + per[2][0]
    assert abs(ram2 - (ram - moved)) < 1 and abs(gpu2 - (gpu + moved)) < 1
    e3, d3 = extrapolated_bytes(files, config, 3)
    assert abs(e3 - ram) < 1 and abs(d3 - gpu) < 1
    e6, _ = extrapolated_bytes(files, config, 6)
    assert abs(e6 - 2 * ram) < 2
    e6_hot, d6_hot = extrapolated_bytes(files, config, 6, {1: 4, 2: 8})  # a mean of 1/2 of the experts hot
    assert abs(e6_hot - e6 / 2) < 2 and d6_hot > d3


def test_bench_moe_copies_cover_the_last_level_cache(monkeypatch):
    """bench.moe cycles at least 3 copies of a layer, and enough to hold 8x the largest cache the
    machine reports (the GPU host's 300 MiB L3 served part of 3 copies), fewer where RAM is short."""
    from ktransformers.bench import moe
    shape = moe.SHAPES["qwen3"]
    layer = 128 * 3 * 2048 * 768 * 144 // 256  # (about: the Q4_K part; Q6_K's down is larger)
    monkeypatch.setattr(moe, "l3_bytes", lambda: 0)
    assert moe.default_copies(shape, "Q4_K_M") == 3
    monkeypatch.setattr(moe, "l3_bytes", lambda: 300 * 2**20)
    many = moe.default_copies(shape, "Q4_K_M")
    assert 3 < many <= -(-8 * 300 * 2**20 // layer)
    monkeypatch.setattr(moe.psutil, "virtual_memory", lambda: type("M", (), {"available": 2**30})())
    assert moe.default_copies(shape, "Q4_K_M") == 3  # (RAM: the floor of 3, expert_budget trims experts)
    monkeypatch.undo()
    assert moe.l3_bytes() >= 0  # (read from sysfs here: a number, never an error)


TEXTS = ["hello world, this is a test 12345", "The  quick\n\nbrown fox! ünïcode 日本語 <|im_start|>user", "  x\ty "]


def _random_text(rng) -> str:
    alphabet = "abcdefghij XYZ 0123456789 ,.!?\n\t'\"é日"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))


def _tiny_synthetic(tmp_path, vocab: int):
    from ktransformers.bench.synth import config_from_fields, write_synthetic
    config = config_from_fields({"model_type": "qwen3_moe", "vocab_size": vocab, "hidden_size": 64,
                                 "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_experts": 4,
                                 "num_experts_per_tok": 2})
    path = tmp_path / "m.gguf"
    write_synthetic(config, path, "Q8_0")
    return path


@pytest.mark.parametrize("size", [300, 2000, 40000])
def test_synthetic_vocab_is_a_byte_level_bpe_both_builders_read(tmp_path, size):
    """bench.synth's vocabulary: exactly `size` unique tokens; transformers' GGUF builder and ours
    (the fallback for architectures transformers has none for) tokenize alike, text comes back,
    and the chat template is ChatML's."""
    import random

    from ktransformers.bench.synth import SPECIAL_TOKENS
    from ktransformers.loader import load_tokenizer
    from ktransformers.weights.gguf import GGUFFileSet
    from ktransformers.weights.gguf_tokenizer import byte_level_bpe
    path = _tiny_synthetic(tmp_path, size)
    meta = GGUFFileSet(path).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == len(set(tokens)) == len(meta["tokenizer.ggml.token_type"]) == size
    assert tokens[-len(SPECIAL_TOKENS):] == list(SPECIAL_TOKENS)
    theirs, ours = load_tokenizer(None, path), byte_level_bpe(meta)
    rng = random.Random(size)
    for text in TEXTS + [_random_text(rng) for _ in range(20)]:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == text and all(0 <= i < size for i in ids)
    assert ours("<|im_end|>")["input_ids"] == theirs("<|im_end|>")["input_ids"] == [size - 1]
    msgs = [{"role": "user", "content": "hi there"}]
    for tok in (ours, theirs):
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
        assert tok.eos_token == "<|im_end|>"


def test_tokenizer_fallback_and_its_errors(tmp_path, monkeypatch):
    """Where transformers cannot rebuild a GGUF's tokenizer, a byte-level BPE one is built from the
    tokens and merges; anything else is a ValueError naming the file and both reasons, raised by
    load_model before any weight is read."""
    from transformers import PreTrainedTokenizerFast

    from ktransformers import loader
    from ktransformers.weights.gguf_tokenizer import byte_level_bpe
    path = _tiny_synthetic(tmp_path, 1000)
    real = loader.load_tokenizer(None, path)

    def refuse(*a, **k):
        raise KeyError("no converter for this architecture")
    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", refuse)
    rebuilt = loader.load_tokenizer(None, path)
    assert rebuilt("hello there 42")["input_ids"] == real("hello there 42")["input_ids"]
    with pytest.raises(ValueError, match=r"merges\[1\] is 'a b c'"):
        byte_level_bpe({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
                        "tokenizer.ggml.merges": ["a b", "a b c"]})
    with pytest.raises(ValueError, match="repeated"):
        byte_level_bpe({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "a"], "tokenizer.ggml.merges": []})
    monkeypatch.setattr(loader, "byte_level_bpe", lambda meta, where: byte_level_bpe({"tokenizer.ggml.model": "t5"},
                                                                                      where))
    monkeypatch.setattr(loader, "optimize_and_load_gguf", lambda *a, **k: pytest.fail("weights loaded first"))
    with pytest.raises(ValueError, match=r"cannot build the tokenizer of .*m\.gguf: transformers says KeyError.*"
                                         r"'t5'; only byte-level BPE.*--model_path"):
        loader.load_model(path, progress=False)


def test_a_tokenizer_with_ids_past_the_gguf_vocabulary_is_rebuilt(tmp_path, monkeypatch):
    """transformers 5.17 builds bench.synth's byte-level BPE GGUF with its default <s> and </s>
    added as two new ids taken as BOS and EOS (ids the model has no rows for, an EOS it never
    emits): such a build is replaced by one from the GGUF's tokens, with its BOS and EOS."""
    from transformers import PreTrainedTokenizerFast

    from ktransformers import loader
    path = _tiny_synthetic(tmp_path, 1000)
    real = loader.load_tokenizer(None, path)
    build = PreTrainedTokenizerFast.from_pretrained

    def with_defaults(*a, **k):
        tok = build(*a, **k)
        tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
        return tok
    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", with_defaults)
    assert len(with_defaults(path.parent, gguf_file=path.name)) == 1002
    tok = loader.load_tokenizer(None, path)
    assert len(tok) == 1000 and tok.eos_token == "<|im_end|>" == real.eos_token
    assert tok("<s> hello </s>")["input_ids"] == real("<s> hello </s>")["input_ids"]
    assert max(tok("<s> hello </s>")["input_ids"]) < 1000


SERVE_KEYS = {"concurrency", "requests", "output_tokens", "wall_s", "tok_s", "stream_tok_s", "ttft_ms", "itl_ms",
              "itl_p99_ms", "engine_tok_s", "engine_batch", "speedup", "decode_tokens", "decode_expert_bytes", "stream_gbps",
              "floor_tok_s", "ratio", "ttfts_ms", "prefill_chunk_ms"}


def test_bench_serve_json_rows():
    """bench.serve against the demo model: each level's row, with the engine's own decode rate
    read from the server (it decoded every output token but the first of each request) and its
    floor: the decode steps' expert bytes, which batching can only share (no more a token at
    two streams than at one; the prompts' reads are not among them)."""
    pytest.importorskip("uvicorn")
    out = subprocess.run([sys.executable, "-m", "ktransformers.bench.serve", "--concurrency", "1", "2", "--requests", "1",
                          "--max_tokens", "6", "--cache_lens", "512", "--cpu_infer", "2", "--json"],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["concurrency"] for r in rows] == [1, 2] and all(set(r) == SERVE_KEYS for r in rows)
    assert all(r["engine_tok_s"] > 0 and 1 <= r["engine_batch"] <= r["concurrency"] for r in rows)
    assert rows[0]["itl_p99_ms"] >= rows[0]["itl_ms"] > 0 and rows[0]["speedup"] == 1
    assert [r["decode_tokens"] for r in rows] == [5, 10]
    assert [len(r["ttfts_ms"]) for r in rows] == [1, 2] and all(t > 0 for r in rows for t in r["ttfts_ms"])
    # a request's first token waits for its prompt's prefill (one chunk here): the chunk is part of its TTFT
    assert 0 < rows[0]["prefill_chunk_ms"] <= rows[0]["ttft_ms"]
    per_token = [r["decode_expert_bytes"] / r["decode_tokens"] for r in rows]
    assert 0 < per_token[1] <= per_token[0] and all(r["floor_tok_s"] > 0 and r["stream_gbps"] > 0 for r in rows)


def test_percentile_nearest_rank():
    from ktransformers.bench.serve import percentile
    values = [float(v) for v in range(100, 0, -1)]
    assert percentile(values, 99) == 99 and percentile(values, 50) == 50 and percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3 and percentile([], 50) != percentile([], 50)  # NaN


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_synth_preset_metadata_reads_back_as_the_preset(name):
    """Each bench.synth preset (cut to 4 layers and 16 experts) through the GGUF metadata its files
    carry and back: the loader's config has the preset's shape."""
    from ktransformers.bench.synth import preset_config
    from ktransformers.weights.gguf_config import config_from_metadata, metadata_from_config
    config = preset_config(name, layers=4, experts=16, vocab=512)
    back = config_from_metadata(metadata_from_config(config), 512)
    assert back.model_type == config.model_type
    for attr in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "num_experts", "n_routed_experts",
                 "num_local_experts", "n_shared_experts", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
                 "routed_scaling_factor", "rms_norm_eps"):  # (q/k norms and biases: told by the tensors)
        if getattr(config, attr, None) is not None:
            assert getattr(back, attr, None) == pytest.approx(getattr(config, attr)), attr


def test_deepseek2_file_without_gating_key_is_softmax_v2():
    """A deepseek2 file with no expert_gating_func (DeepSeek-V2/V2.5 files from before the converter
    wrote it) reads as DeepSeek-V2's softmax router, as llama.cpp reads it; sigmoid is V3."""
    from ktransformers.bench.synth import preset_config
    from ktransformers.weights.gguf_config import GATING_SIGMOID, config_from_metadata, metadata_from_config
    meta = metadata_from_config(preset_config("deepseek-v2", layers=2, experts=16, vocab=512))
    del meta["deepseek2.expert_gating_func"]
    assert config_from_metadata(meta, 512).model_type == "deepseek_v2"
    meta["deepseek2.expert_gating_func"] = GATING_SIGMOID
    assert config_from_metadata(meta, 512).model_type == "deepseek_v3"
