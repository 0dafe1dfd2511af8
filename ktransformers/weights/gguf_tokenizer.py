"""Tokenizers from GGUF metadata.

Pre-tokenizers (`tokenizer.ggml.pre`) that transformers' GGUF tokenizer builder does not know:
the text splits llama.cpp applies for them (each regex in turn, matches kept as pieces), as the
models' own tokenizer.json files do. Without them a rebuilt tokenizer falls back to GPT-2's split
and tokenizes such models' prompts otherwise than they were trained on (digits in runs of three,
CJK runs, punctuation).

`byte_level_bpe`: a byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2", the kind every MoE
family here ships) built with the `tokenizers` library straight from the tokens and merges, for the
files whose architecture the installed transformers has no GGUF tokenizer builder for."""
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

# Splits transformers applies itself for these; the fallback builder needs them spelled out.
_FALLBACK_SPLITS: dict[str, tuple[str, ...]] = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",),
    "llama-bpe": (_LLAMA3,),
    "gpt-4o": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types that are whole tokens, never split


def _split_pre_tokenizer(splits: tuple[str, ...]):
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def byte_level_bpe(metadata: dict, where: str = "the GGUF"):
    """A fast tokenizer for a "gpt2" (byte-level BPE) vocabulary in GGUF metadata: its tokens,
    merges, special tokens, llama.cpp's split for its pre-tokenizer and its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{where}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is rebuilt here")
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError(f"{where}: a byte-level BPE vocabulary needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
    pairs = []
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{where}: tokenizer.ggml.merges[{i}] is {merge!r}, not two tokens apart by one space")
        pairs.append((parts[0], parts[1]))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.tokens holds {len(tokens) - len(vocab)} repeated token(s)")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    pre = metadata.get("tokenizer.ggml.pre") or ""
    splits = PRE_TOKENIZER_SPLITS.get(pre) or _FALLBACK_SPLITS.get(pre)
    tok.pre_tokenizer = (_split_pre_tokenizer(splits) if splits
                         else pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind in (_CONTROL, _USER_DEFINED)])

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=token("bos"), eos_token=token("eos"),
                                   pad_token=token("padding"), unk_token=token("unknown"),
                                   chat_template=metadata.get("tokenizer.chat_template"),
                                   add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)))


def ids_past_the_vocabulary(tokenizer, metadata: dict) -> int:
    """How many ids a tokenizer built from GGUF metadata has beyond the GGUF's own tokens (some
    transformers versions add their default `<s>`/`</s>` as new ids and take them as BOS/EOS:
    ids no embedding row exists for, and an EOS the model never emits)."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    return max(0, len(tokenizer) - len(tokens)) if tokens else 0


def set_pre_tokenizer(tokenizer, pre: str | None):
    """The tokenizer with llama.cpp's split for `pre` where the table has it (else as it is)."""
    splits = PRE_TOKENIZER_SPLITS.get(pre or "")
    if splits is None or tokenizer is None:
        return tokenizer
    tokenizer.backend_tokenizer.pre_tokenizer = _split_pre_tokenizer(splits)
    return tokenizer
