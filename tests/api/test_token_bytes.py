"""Logprob `bytes`: a token's raw bytes, mapped from its vocabulary form, so split characters reassemble."""

from __future__ import annotations

import msgpack
import pytest

from ringserve.actors.detokenizer.token_bytes import TokenBytes, byte_level_bytes, bytes_to_unicode, unicode_to_bytes
from ringserve.actors.entry.openai.logprobs import LogprobFormatter
from ringserve.bus.codec import decode, encode
from ringserve.bus.messages import GenerateRequest, RequestOutput, TokenLogprob, TopLogprob


def test_gpt2_table_is_a_bijection_over_printable_characters() -> None:
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(table[b] == chr(b) for b in range(ord("!"), ord("~") + 1))
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    assert all(unicode_to_bytes()[c] == b for b, c in table.items())
    assert byte_level_bytes("ĠðŁĺĢ") == list(" 😀".encode()) and byte_level_bytes("☃") is None


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.common.text_tokenizer import load_text_model
    return load_text_model(resolve_model("SmolLM2-135M-Instruct")).tokenizer  # the detokenizer's


@pytest.mark.parametrize("text", ["😀", "Hi 😀!", "你好, world", "naïve ☃\n\tend"])
def test_byte_level_tokens_reassemble_split_characters(smollm_tokenizer, text: str) -> None:
    raw = TokenBytes(smollm_tokenizer)
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assert bytes(b for t in ids for b in raw(t)).decode("utf-8") == text
    for t in ids:
        token = smollm_tokenizer.decode([t])
        if "\ufffd" not in token:  # a whole-character token: its bytes are its text's
            assert raw(t) == list(token.encode())
    if text == "😀":
        assert len(ids) > 1 and all(smollm_tokenizer.decode([t]) == "\ufffd" for t in ids)
        assert all(raw(t) != list("\ufffd".encode()) for t in ids)


def test_special_tokens_are_their_text(smollm_tokenizer) -> None:
    raw = TokenBytes(smollm_tokenizer)
    eos = smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert raw(eos) == list(b"<|im_end|>")


class _SentencePieceLike:
    """A slow sentencepiece tokenizer's surface: byte-fallback pieces `<0xAB>`, `▁` for a space."""

    pieces = {0: "<0xF0>", 1: "<0x9F>", 2: "<0x98>", 3: "<0x80>", 4: "▁hi", 5: "</s>"}
    added_tokens_decoder = {5: "</s>"}

    def get_vocab(self) -> dict[str, int]:
        return {p: i for i, p in self.pieces.items()}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, ids: list[int]) -> str:
        piece = self.pieces[ids[0]]
        return "\ufffd" if piece.startswith("<0x") else piece.replace("▁", " ")


def test_sentencepiece_byte_fallback_pieces_give_their_byte() -> None:
    raw = TokenBytes(_SentencePieceLike())
    assert bytes(b for t in (0, 1, 2, 3) for b in raw(t)).decode() == "😀"
    assert raw(4) == list(b" hi") and raw(5) == list(b"</s>")


def test_chat_logprobs_report_raw_bytes_and_fall_back_to_the_text() -> None:
    entry = TokenLogprob(token_id=1, token="\ufffd", logprob=-0.5, bytes=[240, 159],
                         top=[TopLogprob(1, "\ufffd", -0.5, bytes=[240, 159]), TopLogprob(2, "a", -2.0)])
    content = LogprobFormatter("chat", True, True).format([entry])["content"]
    assert content[0]["bytes"] == [240, 159] and content[0]["token"] == "\ufffd"
    assert [t["bytes"] for t in content[0]["top_logprobs"]] == [[240, 159], [97]]


def test_new_fields_round_trip_and_older_messages_still_decode() -> None:
    out = RequestOutput(rid="r", logprobs=[TokenLogprob(1, "\ufffd", -1.0, [TopLogprob(1, "\ufffd", -1.0, [240])],
                                                        bytes=[240])])
    assert decode(encode(out), RequestOutput) == out
    req = GenerateRequest(rid="r", add_generation_prompt=False, continue_final_message=True)
    assert decode(encode(req), GenerateRequest) == req
    # a sender from before these fields: its messages lack them, the defaults fill in
    old = msgpack.unpackb(encode(GenerateRequest(rid="r", text="x")))
    body = old["body"]
    for name in ("add_generation_prompt", "continue_final_message"):
        body.pop(name)
    decoded = decode(msgpack.packb(old), GenerateRequest)
    assert (decoded.add_generation_prompt, decoded.continue_final_message) == (True, False)
    old_entry = msgpack.unpackb(encode(TokenLogprob(1, "a", -1.0)))
    old_entry["body"].pop("bytes")
    assert decode(msgpack.packb(old_entry), TokenLogprob).bytes is None
