"""Tests of IncrementalDecoder against the real SmolLM2 byte-level BPE tokenizer.

The core property: for any split of a token stream into feeds, the concatenated deltas equal a one-shot
`tokenizer.decode` of the same ids (with the same stop trimming), and no delta holds a partial character.
Stop strings are decided by the scheduler: `stop_run` plays its part, finishing at the token whose arrival
first makes a stop string appear, with that string as `matched`.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ringserve.actors.detokenizer.incremental import MAX_PENDING_TOKENS, IncrementalDecoder
from ringserve.bus.messages import DecodeParams, FinishReason

IM_END = "<|im_end|>"
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was 3:14 pm, and   spaces\tand\nnewlines stayed."
    " Isn 't it , really ?",
    "你好，世界！今天天气很好。我们去公园散步吧。日本語のテキストも混ぜます。한국어도 있어요.",
    "Party time 🎉🎉 thumbs 👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷 and faces 😀😃😄 done.",
    "Combining: e\u0301 a\u0308 o\u0302\u0323 n\u0303 — Zalgo: h\u0336\u0321e\u0337\u034el\u0338l\u0335o.",
    "Mixed: café 😀 中文 naïve ∑x² → ∞ 🧪 done",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.common.text_tokenizer import load_text_model

    return load_text_model(resolve_model("SmolLM2-135M-Instruct")).tokenizer  # the detokenizer's


def params(**kw: Any) -> DecodeParams:
    return DecodeParams(**kw)


def stop_run(tok: Any, ids: list[int], stops: list[str]) -> tuple[list[int], FinishReason, str]:
    """What the scheduler would send: the ids up to the first stop-string match, the finish reason, and the
    text a client must see (decoded text cut where the matched string starts)."""
    for k in range(len(ids)):
        text = tok.decode(ids[: k + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        matched = next((s for s in stops if s in text), None)
        if matched is not None:
            return ids[: k + 1], FinishReason("stop", matched), text[: text.find(matched)]
    text = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return ids, FinishReason("length"), text


def stream(tok: Any, ids: list[int], sizes: list[int], p: DecodeParams, finish: FinishReason) -> list[str]:
    """Feed `ids` in chunks of `sizes` (cycled), the last chunk with `finish`; return every delta."""
    dec, deltas, i, k = IncrementalDecoder(tok, p), [], 0, 0
    while True:
        chunk = ids[i : i + sizes[k % len(sizes)]]
        i, k = i + len(chunk), k + 1
        last = i >= len(ids)
        deltas.append(dec.feed(chunk, finish if last else None))
        if last:
            return deltas


def splits(n: int, seed: int) -> list[list[int]]:
    """One id per feed, everything at once, and random chunk sizes."""
    rng = random.Random(seed)
    return [[1], [n or 1], [2, 3], *([rng.randint(1, 7) for _ in range(50)] for _ in range(8))]


def test_some_emoji_split_into_several_tokens(tok: Any) -> None:
    for emoji in ["🎉", "😀", "👍🏽"]:
        ids = tok.encode(emoji)
        assert len(ids) >= 3 and all("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_one_shot_decode(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    expected = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert expected == text
    for sizes in splits(len(ids), seed=len(text)):
        deltas = stream(tok, ids, sizes, params(), FinishReason("length"))
        assert "".join(deltas) == expected
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_random_stop_strings_never_leak(tok: Any, text: str) -> None:
    rng = random.Random(text)
    for _ in range(6):
        a = rng.randrange(len(text) - 4)
        stops = [text[a : a + rng.randint(1, 4)], "zz~never~zz"]
        ids, finish, expected = stop_run(tok, tok.encode(text), stops)
        assert finish.type == "stop"
        for sizes in splits(len(ids), seed=a):
            deltas = stream(tok, ids, sizes, params(stop=stops), finish)
            assert "".join(deltas) == expected
            assert not any("\ufffd" in d for d in deltas)


def test_overlapping_stops_cut_where_generation_would_stop(tok: Any) -> None:
    stops = ["hello world", "lo"]  # "lo" completes first, though "hello world" starts earlier
    ids, finish, expected = stop_run(tok, tok.encode("say hello world and more"), stops)
    assert finish.matched == "lo" and expected == "say hel"
    for sizes in ([1], [len(ids)], [2]):
        assert "".join(stream(tok, ids, sizes, params(stop=stops), finish)) == "say hel"


def test_printable_prefix_is_sent_before_incomplete_character(tok: Any) -> None:
    head, emoji = tok.encode("hello "), tok.encode("😀")
    dec = IncrementalDecoder(tok, params())
    assert dec.feed(head + emoji[:1]) == "hello "
    assert dec.feed(emoji[1:2]) == ""
    assert dec.feed(emoji[2:]) == "😀"


def test_split_stop_string_is_held_then_cut(tok: Any) -> None:
    ids = tok.encode("a <END> b")
    assert len(ids) == 5  # "a", " <", "END", ">", " b": the stop string spans three tokens
    dec = IncrementalDecoder(tok, params(stop=["<END>"]))
    deltas = [dec.feed([i]) for i in ids[:3]]
    assert deltas == ["a", " ", ""]  # "<" and "<END" are held back
    assert dec.feed(ids[3:4], FinishReason("stop", "<END>")) == ""  # the scheduler's hit cuts at "<"


def test_held_prefix_is_released_when_text_diverges(tok: Any) -> None:
    ids = tok.encode("a <b> c")
    dec = IncrementalDecoder(tok, params(stop=["<END>"]))
    deltas = [dec.feed([i]) for i in ids]
    assert deltas[1] == " " and deltas[2].startswith("<")  # "<" held back, released once "b" diverges
    assert "".join(deltas) == "a <b> c"


def test_stop_trim_on_finish(tok: Any) -> None:
    ids = tok.encode("answer: 42### trailing text")
    for sizes in ([1], [len(ids)], [3]):
        deltas = stream(tok, ids, sizes, params(stop=["###"]), FinishReason("stop", "###"))
        assert "".join(deltas) == "answer: 42"
    # a matched string reported only at finish (not in params.stop) still trims what is unsent
    assert stream(tok, ids, [len(ids)], params(), FinishReason("stop", "###")) == ["answer: 42"]


def test_no_stop_trim_keeps_the_stop_string(tok: Any) -> None:
    ids = tok.encode("answer: 42### trailing text")
    for sizes in ([1], [len(ids)], [4]):
        p = params(stop=["###"], no_stop_trim=True)
        assert "".join(stream(tok, ids, sizes, p, FinishReason("stop", "###"))) == "answer: 42###"


def test_stop_token_id_is_not_decoded(tok: Any) -> None:
    ids = tok.encode("Hello world.")
    dot = ids[-1]
    assert tok.decode([dot]) == "." and dot not in tok.all_special_ids
    assert "".join(stream(tok, ids, [1], params(), FinishReason("stop", dot))) == "Hello world"
    im_end = tok.convert_tokens_to_ids(IM_END)
    p = params(skip_special_tokens=False)
    assert "".join(stream(tok, ids + [im_end], [2], p, FinishReason("stop", im_end))) == "Hello world."


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Any, skip: bool) -> None:
    ids = tok.encode("Hi") + [tok.convert_tokens_to_ids(IM_END)] + tok.encode(" there 🎉")
    expected = "Hi there 🎉" if skip else f"Hi{IM_END} there 🎉"
    assert tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) == expected
    for sizes in ([1], [2], [len(ids)]):
        p = params(skip_special_tokens=skip)
        assert "".join(stream(tok, ids, sizes, p, FinishReason("length"))) == expected


def test_invalid_bytes_eventually_commit(tok: Any) -> None:
    lone = tok.encode("😀")[1]  # a lone UTF-8 continuation byte: never completes a character
    dec = IncrementalDecoder(tok, params())
    deltas = [dec.feed([lone]) for _ in range(40)]
    # once more than 4 tokens are pending, all but the last 3 commit; then every 2 tokens
    assert deltas[:7] == ["", "", "", "", "\ufffd" * 2, "", "\ufffd" * 2]
    assert len(dec.ids) <= 2 * MAX_PENDING_TOKENS  # the window stays bounded
    text = "".join(deltas) + dec.feed([], FinishReason("length"))
    # committed invalid bytes stay visible; the still-pending tail at the end is dropped like a cut character
    assert tok.decode([lone] * 40).startswith(text) and len(text) >= 40 - MAX_PENDING_TOKENS


def test_character_cut_off_by_the_end_of_generation_is_dropped(tok: Any) -> None:
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # generation stopped (max_tokens) inside the emoji's bytes
    assert tok.decode(cut).endswith("\ufffd")
    for sizes in ([1], [len(cut)]):
        deltas = stream(tok, cut, sizes, params(), FinishReason("length"))
        assert "".join(deltas) == "ok " and all("\ufffd" not in d for d in deltas)


def test_forced_commit_never_splits_a_valid_character(tok: Any) -> None:
    lone, cjk = tok.encode("😀")[1], tok.encode("瓒")
    assert len(cjk) == 3  # one byte per token
    for n in range(3, 9):
        ids = [lone] * n + cjk + tok.encode(" ok")
        deltas = stream(tok, ids, [1], params(), FinishReason("length"))
        assert "".join(deltas) == tok.decode(ids) and "瓒" in "".join(deltas)


class CountingTokenizer:
    """Wraps a tokenizer, counts the ids passed to decode and checks its flags."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.ids = tok, 0

    def decode(self, ids: list[int], **kw: Any) -> str:
        assert kw == {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
        self.ids += len(ids)
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("stops", [[], ["<never>", "zzz"]])
def test_cost_per_token_is_constant(tok: Any, stops: list[str]) -> None:
    ids = (tok.encode(" ".join(TEXTS)) * 40)[:2000]
    assert len(ids) == 2000
    counting = CountingTokenizer(tok)
    dec = IncrementalDecoder(counting, params(stop=stops))
    out, window = [], 0
    for i in ids:
        out.append(dec.feed([i]))
        window = max(window, len(dec.ids))
    out.append(dec.feed([], FinishReason("length")))
    assert counting.ids / len(ids) < 10
    assert window <= 6  # no growing state: ids before surr_offset are dropped
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_feed_after_finish_raises(tok: Any) -> None:
    dec = IncrementalDecoder(tok, params(stop=["STOP"]))
    assert dec.feed(tok.encode("go ST")) == "go "
    assert dec.feed(tok.encode("OP"), FinishReason("stop", "STOP")) == ""
    with pytest.raises(RuntimeError):
        dec.feed([1])
