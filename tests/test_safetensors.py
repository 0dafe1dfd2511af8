"""safetensors checkpoints: sharded BF16 (per-expert tensors, Mixtral's w1/w2/w3 names) and
DeepSeek-V3's FP8 e4m3 weights with 128x128 weight_scale_inv blocks."""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from ktransformers import optimize_and_load_gguf
from ktransformers.loader import RULES_DIR, build_skeleton
from ktransformers.weights.safetensors import SafetensorsSource, dequant_fp8_blocks
from ktransformers.weights.source import WeightError
from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.gguf_write import converter_tensors
from tiny import FAMILIES, RULES, round_like_cpu_kernels, tiny_model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_bf16_checkpoint(tmp_path, family):
    model = tiny_model(family).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="500KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    unrounded = logits(reference, ids := torch.randint(0, 320, (2, 7)))
    round_like_cpu_kernels(reference, GGMLType.BF16)  # the kernels take bf16 activations for bf16 weights
    ours = build_skeleton(model.config, torch.float32)
    optimize_and_load_gguf(ours, RULES_DIR / RULES[family], tmp_path, model.config)
    got = logits(ours, ids)
    # values computed in another order now and then land one bf16 step apart (2^-8), and where that
    # moves a router's choice the logits move ~1e-3 (half of the seeds tried: 1e-7 or 1e-3)
    assert rel_err(got, logits(reference, ids)) < 5e-3
    assert rel_err(got, unrounded) > 2e-4  # (the rounding is real: the unrounded model is further off)


def to_fp8_blocks(w: torch.Tensor, block: int = 128):
    """e4m3 weight and per-block scale_inv such that weight * scale_inv ~ w (what DeepSeek ships)."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    amax = padded.reshape(br, block, bc, block).abs().amax(dim=(1, 3)).clamp(min=1e-8)
    scale_inv = amax / 448.0
    scaled = padded.reshape(br, block, bc, block) / scale_inv[:, None, :, None]
    return scaled.reshape(br * block, bc * block)[:rows, :cols].to(torch.float8_e4m3fn), scale_inv


def reference_fp8_dequant(w8: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = w8.float().clone()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale_inv[i, j]
    return out


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (96, 513)])
def test_fp8_block_dequant(shape):
    w8, scale_inv = to_fp8_blocks(torch.randn(shape) * 0.05)
    assert torch.equal(dequant_fp8_blocks(w8, scale_inv), reference_fp8_dequant(w8, scale_inv))
    with pytest.raises(WeightError, match="does not fit"):
        dequant_fp8_blocks(w8, scale_inv[:-1])


def write_fp8_checkpoint(model, path) -> dict[str, torch.Tensor]:
    """`model` saved in `path` as a DeepSeek-style FP8 checkpoint (per-expert names, 2-D projections
    in e4m3 with 128x128 block scale_inv); returns the state dict its weights dequantize to."""
    from safetensors import safe_open
    model.save_pretrained(path)
    with safe_open(path / "model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    fp8, dequantized = {}, {}
    for name, t in stored.items():
        if t.dim() == 2 and ("proj" in name) and "layernorm" not in name:
            w8, s = to_fp8_blocks(t.float())
            fp8[name], fp8[name + "_scale_inv"] = w8, s
            dequantized[name] = reference_fp8_dequant(w8, s)
        else:
            fp8[name] = dequantized[name] = t
    (path / "model.safetensors").unlink()
    save_file(fp8, path / "model.safetensors", metadata={"format": "pt"})
    return dequantized


def test_deepseek_fp8_checkpoint(tmp_path):
    model = tiny_model("deepseek_v3")
    dequantized = write_fp8_checkpoint(model, tmp_path)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    save_file(dequantized, ref_dir / "model.safetensors", metadata={"format": "pt"})
    (ref_dir / "config.json").write_text((tmp_path / "config.json").read_text())
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ours = build_skeleton(model.config, torch.float32)
    optimize_and_load_gguf(ours, RULES_DIR / RULES["deepseek_v3"], tmp_path, model.config)
    ids = torch.randint(0, 320, (1, 11))
    assert rel_err(logits(ours, ids), logits(reference, ids)) < 1e-4
    assert rel_err(logits(ours, ids), logits(model, ids)) > 1e-4  # FP8 really changed the weights


def test_index_naming_an_absent_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(WeightError, match="model-1.safetensors"):
        SafetensorsSource(tmp_path)


def test_fp8_without_scale(tmp_path):
    save_file({"w.weight": torch.randn(4, 4).to(torch.float8_e4m3fn)}, tmp_path / "m.safetensors")
    with pytest.raises(WeightError, match="scale_inv"):
        SafetensorsSource(tmp_path).load("w.weight")


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightError, match="m.safetensors"):
        SafetensorsSource(tmp_path)


def to_openai_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenAI's MXFP4 checkpoint tensors for a float [E, out, in]: blocks [E, out, in/32, 16] (two
    values a byte, the earlier low) and scales [E, out, in/32], through our ggml quantizer."""
    from ktransformers.weights.ggml_quants import quantize
    b = quantize(w, "MXFP4").reshape(*w.shape[:-1], -1, 17)
    codes = torch.stack([b[..., 1:] & 15, b[..., 1:] >> 4], dim=-2).flatten(-2)  # ggml: j, j + 16 -> value order
    return codes[..., 0::2] | (codes[..., 1::2] << 4), b[..., 0].contiguous()


def test_gpt_oss_mxfp4_checkpoint(tmp_path):
    """gpt-oss as OpenAI ships it: MXFP4 experts (`*_blocks`, `*_scales`), the rest BF16. The
    reference dequantizes with transformers' own MXFP4 code."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    model = tiny_model("gpt_oss")
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    reference_state = {k: v.float() for k, v in state.items()}  # (the checkpoint's bf16 values)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_openai_mxfp4(state.pop(name).float().transpose(1, 2))  # [E, out, in]
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        reference_state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(state, tmp_path / "model.safetensors")
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    reference.load_state_dict({k: v.float() for k, v in reference_state.items()})
    ids = torch.randint(0, 320, (2, 11))
    types = {g: GGMLType.MXFP4 if g.endswith("_exps.weight") else GGMLType.BF16
             for g in converter_tensors(model.state_dict(), model.config)}
    round_like_cpu_kernels(reference, types)
    ours = build_skeleton(model.config, torch.float32)
    optimize_and_load_gguf(ours, RULES_DIR / RULES["gpt_oss"], tmp_path, model.config)
    source = SafetensorsSource(tmp_path, "gpt_oss")
    assert source.info("model.layers.1.mlp.experts.up_proj").ggml_type == GGMLType.MXFP4  # computed on as stored
    assert rel_err(logits(ours, ids), logits(reference, ids)) < 5e-3
