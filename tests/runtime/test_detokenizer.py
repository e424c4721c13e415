"""IncrementalDetokenizer: deltas concatenate to the full decode, never end in a partial character.

Uses a tiny byte-level BPE trained locally (no hub downloads).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.detokenizer import IncrementalDetokenizer

CORPUS = [
    "héllo 世界 🙂 hello world",
    "the quick brown fox jumps over the lazy dog. naïve café 😀",
    "日本語のテキスト and ελληνικά, emojis 🚀🙂🙂",
] * 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable-char map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


def _byte_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, so multi-byte characters are split across tokens."""
    b2u = _bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([b2u[b] for b in text.encode("utf-8")])


def _stream(tokenizer, prompt, out_ids, chunks, skip) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    for c in chunks:
        deltas.append(detok.push(out_ids[i : i + c]))
        i += c
    deltas.append(detok.push(out_ids[i:]))
    return deltas, detok.flush(), detok


def test_split_multibyte_is_held_back(tokenizer):
    ids = _byte_ids(tokenizer, "a世🙂b")
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push([t]) for t in ids]
    assert deltas == ["a", "", "", "世", "", "", "", "🙂", "b"]
    assert detok.flush() == "" and detok.text == "a世🙂b"


def test_incomplete_tail_is_flushed(tokenizer):
    ids = _byte_ids(tokenizer, "ok世")[:-1]
    detok = IncrementalDetokenizer(tokenizer, _byte_ids(tokenizer, "x"))
    assert detok.push(ids[:2]) == "ok"
    assert detok.push(ids[2:]) == ""  # two of the three bytes of 世
    assert detok.has_pending
    tail = detok.flush()
    assert "ok" + tail == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text.endswith("\ufffd")


def test_special_tokens(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [tokenizer.eos_token_id]
    for skip in (True, False):
        deltas, tail, detok = _stream(tokenizer, [], ids, [1] * len(ids), skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.text.endswith("</s>")


def test_prompt_context_does_not_leak(tokenizer):
    prompt = _byte_ids(tokenizer, "前")[:-1]  # prompt ending mid-character
    out = tokenizer.encode(" hi 世界", add_special_tokens=False)
    deltas, tail, _ = _stream(tokenizer, prompt, out, [1] * len(out), True)
    assert "".join(deltas) + tail == tokenizer.decode(out)


token_lists = st.lists(st.integers(0, 399), max_size=40)


@settings(max_examples=100, deadline=None)
@given(
    prompt=token_lists,
    out=token_lists,
    chunks=st.lists(st.integers(0, 4), max_size=20),
    skip=st.booleans(),
    text=st.text(max_size=12),
)
def test_deltas_concatenate_to_decode(tokenizer, prompt, out, chunks, skip, text):
    vocab = len(tokenizer)
    prompt = [t % vocab for t in prompt]
    # mix random ids with byte-split real text so that partial characters are common
    out = [t % vocab for t in out] + _byte_ids(tokenizer, text)
    deltas, tail, detok = _stream(tokenizer, prompt, out, chunks, skip)
    assert "".join(deltas) + tail == tokenizer.decode(out, skip_special_tokens=skip)
    assert detok.text == "".join(deltas) + tail
    for d in deltas:
        assert not d.endswith("\ufffd")
