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
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
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
    # DeepSeek-V2 / V2.5 (DeepSeek LLM's vocabulary): letter runs of the listed scripts with one
    # leading space, ASCII and full-width punctuation runs, CJK runs, whole digit runs
    "deepseek-llm": (
        r"[\r\n]",
        "\\s?["  # (escapes: NFC would fold some of these code points, e.g. U+1F7D, U+2126)
        "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
        "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
        "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
        "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
        "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
        "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
        "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943"
        "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}+",
    ),
    # MiniMax-M2 / M2.1: GPT-4o's split
    "minimax-m2": (_GPT4O,),
}

# Splits transformers applies itself for these; the fallback builder needs them spelled out.
_FALLBACK_SPLITS: dict[str, tuple[str, ...]] = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",),
    "llama-bpe": (_LLAMA3,),
    "gpt-4o": (_GPT4O,),
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
