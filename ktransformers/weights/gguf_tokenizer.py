"""Pre-tokenizers (`tokenizer.ggml.pre`) that transformers' GGUF tokenizer builder does not know:
the text splits llama.cpp applies for them (each regex in turn, matches kept as pieces), as the
models' own tokenizer.json files do. Without them a rebuilt tokenizer falls back to GPT-2's split
and tokenizes such models' prompts otherwise than they were trained on (digits in runs of three,
CJK runs, punctuation)."""
from __future__ import annotations

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # DeepSeek-V3/R1
    "deepseek-v3": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # GLM-4.5/4.6: Llama 3's split
    "glm4": (_LLAMA3,),
    # Kimi-K2: its tiktoken pattern (Han runs apart from other letters, set intersections)
    "kimi-k2": (
        r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}


def set_pre_tokenizer(tokenizer, pre: str | None):
    """The tokenizer with llama.cpp's split for `pre` where the table has it (else as it is)."""
    splits = PRE_TOKENIZER_SPLITS.get(pre or "")
    if splits is None or tokenizer is None:
        return tokenizer
    from tokenizers import Regex, pre_tokenizers
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tokenizer
