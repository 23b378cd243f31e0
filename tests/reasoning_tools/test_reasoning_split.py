"""The detokenizer's split of a request's output into thinking (`reasoning_text`) and answer (`text`).

Units of `ReasoningSplitter` on text (Qwen3's closed `<think>` plan with and without thinking, DeepSeek-R1's open
plan, gpt-oss's harmony markers, markers split across feeds, a request cut off while thinking, the whitespace
rules), the property that for any split of the text or of its tokens into feeds the concatenated parts equal a
one-shot split of the whole text (`one_shot`, written here apart from the splitter, composed with stop strings
through the real SmolLM2 tokenizer), and the real detokenizer actor process splitting rows sent over a real NATS
server.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import nats
import pytest

from ringserve.actors.detokenizer.incremental import IncrementalDecoder
from ringserve.actors.detokenizer.reasoning_split import ReasoningSplitter
from ringserve.bus.codec import decode, encode
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.messages import (ActorReady, BatchTokenOutput, DecodeParams, FinishReason, RequestOutput,
                                    TokenRow)
from ringserve.bus.reasoning import ReasoningPlan
from tests.server_helpers import REPO

QWEN3 = ReasoningPlan(parser="qwen3", start="<think>", end="</think>")
R1_OPEN = ReasoningPlan(parser="deepseek_r1", start="<think>", end="</think>", open=True)
GPT_OSS = ReasoningPlan(parser="gpt_oss", start="<|channel|>analysis<|message|>", end="<|end|>",
                        answer_prefix="<|start|>assistant<|channel|>final<|message|>")
PLANS = [QWEN3, R1_OPEN, GPT_OSS]


def one_shot(text: str, plan: ReasoningPlan) -> tuple[str, str]:
    """The split of a whole output, by the rules of bus/reasoning.py: (reasoning, answer)."""
    if not plan.open:
        head = text.lstrip()
        if not head.startswith(plan.start):
            return "", text  # no thinking: the answer as written
        text = head[len(plan.start):]
    thinking, found, answer = text.partition(plan.end)
    if not found:  # cut off while thinking
        return thinking.lstrip(), ""
    answer = answer.lstrip()
    return thinking.strip(), answer.removeprefix(plan.answer_prefix) if plan.answer_prefix else answer


def texts(plan: ReasoningPlan) -> list[str]:
    """Outputs in the plan's format: thinking then answer, empty thinking, no thinking, cut off, odd spacing."""
    s, e = plan.start, plan.end
    opening = "" if plan.open else s
    return [
        f"{opening}\nThe user greets me. 你好 🎉 I should reply.\n{e}\n\nHello! How can I help?",
        f"{opening}\n\n{e}\n\nJust the answer.",
        f"  \n{opening}  a < b, and </thin is not the end; <|en neither \n\n {e}Answer {s} again {e} done.",
        f"{opening}Thinking that never ends, cut off mid-",
        f"{opening}Thinking cut off right before the end marker \n {e[:-1]}",
        f"{opening}Thinking cut off with trailing space  \n",
        f"{opening}Framed answer{e}{plan.answer_prefix}The answer after its framing",
        f"{opening}Framing cut short{e}{plan.answer_prefix[:-3]}",
        f"{opening}Not the framing{e}<|start|>user: an answer",
        "No thinking at all: " + s + " is only text here " + e,
        "   \n  spaced answer without thinking",
        s[:-1] + "x: almost the start marker",
        "",
        " \n ",
    ]


def feed_chars(plan: ReasoningPlan, text: str, cuts: list[int]) -> list[tuple[str, str]]:
    """Feed `text` cut at the sorted positions `cuts`, the last piece as final; return every (reasoning, answer)."""
    splitter, bounds = ReasoningSplitter(plan), [0, *cuts, len(text)]
    return [splitter.feed(text[a:b], final=k == len(bounds) - 2) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def joined(parts: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in parts), "".join(a for _, a in parts)


# --- units ----------------------------------------------------------------------------------------------------


def test_qwen3_thinking_then_answer_markers_and_whitespace_left_out() -> None:
    text = "<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nThe answer is 4."
    assert ReasoningSplitter(QWEN3).feed(text, final=True) == ("Let me add: 2 + 2 = 4.", "The answer is 4.")
    assert one_shot(text, QWEN3) == ("Let me add: 2 + 2 = 4.", "The answer is 4.")


def test_qwen3_without_thinking_is_all_answer() -> None:
    for text in ("The answer is 4.", "\n\nThe answer is 4.", "Answer first <think>then this</think> stays."):
        splitter = ReasoningSplitter(QWEN3)
        assert splitter.feed(text) == ("", text)  # known at once: nothing held
        assert splitter.state == "answer"
        assert splitter.feed(" more <think>", final=True) == ("", " more <think>")
    assert ReasoningSplitter(QWEN3).feed("<think>\n\n</think>\n\nHi", final=True) == ("", "Hi")


def test_a_possible_start_marker_is_held_until_known() -> None:
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("\n") == ("", "")
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("ink") == ("", "")
    assert splitter.feed(">") == ("", "")
    assert splitter.state == "thinking"
    diverged = ReasoningSplitter(QWEN3)
    assert diverged.feed(" <th") == ("", "")
    assert diverged.feed("ere") == ("", " <there")  # not the marker: everything held is the answer, as written
    cut = ReasoningSplitter(QWEN3)
    assert cut.feed("<thi") == ("", "")
    assert cut.feed("", final=True) == ("", "<thi")  # ended before the marker was whole: no thinking


def test_open_plan_starts_inside_the_thinking() -> None:
    text = "Okay, the user wants a sum.\n</think>\n\n4"
    assert ReasoningSplitter(R1_OPEN).feed(text, final=True) == ("Okay, the user wants a sum.", "4")
    splitter = ReasoningSplitter(R1_OPEN)
    assert splitter.feed("\nOkay") == ("Okay", "")  # thinking from the first character, leading whitespace dropped
    assert splitter.feed(", so</think>Hi <think>x</think>") == (", so", "Hi <think>x</think>")


def test_gpt_oss_harmony_markers() -> None:
    text = ("<|channel|>analysis<|message|>User says hi. Reply briefly.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello!")
    reasoning, answer = ReasoningSplitter(GPT_OSS).feed(text, final=True)
    assert reasoning == "User says hi. Reply briefly."
    assert answer == "Hello!"  # the final channel's header after the end marker is framing, dropped
    call = "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
    assert ReasoningSplitter(GPT_OSS).feed(text.split("<|end|>")[0] + "<|end|>" + call, final=True)[1] == call
    # a multi-token end marker may span the answer's header too: the plan decides
    plan = ReasoningPlan(parser="gpt_oss", start=GPT_OSS.start,
                         end="<|end|><|start|>assistant<|channel|>final<|message|>")
    parts = feed_chars(plan, text, list(range(1, len(text))))
    assert joined(parts) == ("User says hi. Reply briefly.", "Hello!")


def test_end_marker_split_across_feeds_is_held_then_dropped() -> None:
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<think>\nstep one") == ("step one", "")
    assert splitter.feed(" and two </th") == (" and two", "")  # the space too: it may precede the end marker
    assert splitter.feed("ink") == ("", "")
    assert splitter.feed(">\n") == ("", "")
    assert splitter.state == "answer"
    assert splitter.feed("\nDone.") == ("", "Done.")
    false_end = ReasoningSplitter(QWEN3)
    assert false_end.feed("<think>a </thin") == ("a", "")
    assert false_end.feed("g> b") == (" </thing> b", "")  # not the end marker: released as thinking


def test_trailing_whitespace_is_held_while_thinking() -> None:
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<think>a \n") == ("a", "")
    assert splitter.feed(" \n") == ("", "")
    assert splitter.feed("b") == (" \n \nb", "")  # more thinking followed: the whitespace was part of it


def test_cut_off_while_thinking_sends_everything_held_as_reasoning() -> None:
    for plan, text, reasoning in [
        (QWEN3, "<think>\nstill thinking \n </thi", "still thinking \n </thi"),
        (QWEN3, "<think>\nstill thinking  ", "still thinking  "),
        (R1_OPEN, "\n\n", ""),
        (GPT_OSS, "<|channel|>analysis<|message|>cut <|en", "cut <|en"),
    ]:
        for cuts in ([], list(range(1, len(text)))):
            assert joined(feed_chars(plan, text, cuts)) == (reasoning, ""), (plan.parser, text, cuts)
            assert one_shot(text, plan) == (reasoning, "")


def test_each_case_equals_the_one_shot_split_when_fed_whole() -> None:
    for plan in PLANS:
        for text in texts(plan):
            assert ReasoningSplitter(plan).feed(text, final=True) == one_shot(text, plan), (plan.parser, text)


def test_markers_never_appear_in_streamed_parts_of_a_thinking_output() -> None:
    for plan in PLANS:
        text = texts(plan)[0]
        for part in feed_chars(plan, text, list(range(1, len(text)))):
            for piece in part:
                assert plan.start not in piece and plan.end not in piece


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.parser + ("-open" if p.open else ""))
def test_random_splits_of_the_text_equal_the_one_shot_split(plan: ReasoningPlan) -> None:
    rng = random.Random(plan.parser)
    for text in texts(plan):
        expected = one_shot(text, plan)
        for _ in range(60):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, min(len(text) - 1, 25)))))
            assert joined(feed_chars(plan, text, cuts)) == expected, (text, cuts)
        assert joined(feed_chars(plan, text, list(range(1, len(text))))) == expected  # one character a feed


# --- through the incremental decoder, with real tokens and stop strings ----------------------------------------


@pytest.fixture(scope="module")
def tok() -> Any:
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.common.text_tokenizer import load_text_model

    return load_text_model(resolve_model("SmolLM2-135M-Instruct")).tokenizer  # the detokenizer's


def decode_text(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream_split(tok: Any, ids: list[int], sizes: list[int], params: DecodeParams,
                 finish: FinishReason) -> list[tuple[str, str]]:
    """Feed `ids` in chunks of `sizes` (cycled) through `feed_split`, the last with `finish`."""
    dec, parts, i, k = IncrementalDecoder(tok, params), [], 0, 0
    while True:
        chunk = ids[i: i + sizes[k % len(sizes)]]
        i, k = i + len(chunk), k + 1
        last = i >= len(ids)
        parts.append(dec.feed_split(chunk, finish if last else None))
        if last:
            return parts


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.parser + ("-open" if p.open else ""))
def test_random_token_splits_through_the_decoder_equal_the_one_shot_split(tok: Any, plan: ReasoningPlan) -> None:
    rng = random.Random(plan.parser + "tokens")
    for text in texts(plan):
        ids = tok.encode(text)
        expected = one_shot(decode_text(tok, ids), plan)
        for sizes in [[1], [len(ids) or 1], *([rng.randint(1, 6) for _ in range(40)] for _ in range(6))]:
            parts = stream_split(tok, ids, sizes, DecodeParams(reasoning=plan), FinishReason("length"))
            assert joined(parts) == expected, (text, sizes)
            assert not any("\ufffd" in piece for part in parts for piece in part)


def test_stop_strings_are_trimmed_before_the_split(tok: Any) -> None:
    rng = random.Random(7)
    text = "<think>\nIs it 4? Yes ###.\n</think>\n\nIt is 4. ### and more"
    ids = tok.encode(text)
    cut = next(k for k in range(len(ids)) if "###" in decode_text(tok, ids[: k + 1]))
    ids, finish = ids[: cut + 1], FinishReason("stop", "###")  # the scheduler stops inside the thinking
    for sizes in ([1], [len(ids)], *([rng.randint(1, 5) for _ in range(20)] for _ in range(5))):
        parts = stream_split(tok, ids, sizes, DecodeParams(stop=["###"], reasoning=QWEN3), finish)
        assert joined(parts) == ("Is it 4? Yes ", ""), sizes  # cut off while thinking: all held is sent
    whole = tok.encode(text)
    answer_stop = "It is 4. ###"
    ids = whole[: next(k for k in range(len(whole)) if answer_stop in decode_text(tok, whole[: k + 1])) + 1]
    for sizes in ([1], [3], [len(ids)]):
        parts = stream_split(tok, ids, sizes, DecodeParams(stop=["4. ###"], reasoning=QWEN3),
                             FinishReason("stop", "4. ###"))
        assert joined(parts) == ("Is it 4? Yes ###.", "It is "), sizes


def test_without_a_plan_feed_split_is_feed(tok: Any) -> None:
    text = "<think>\nnot split\n</think>\n\nanswer"
    ids = tok.encode(text)
    parts = stream_split(tok, ids, [2], DecodeParams(), FinishReason("length"))
    assert joined(parts) == ("", text)


# --- the real detokenizer actor, over a real NATS server --------------------------------------------------------


@pytest.fixture(scope="module")
def detokenizer(nats_server: EmbeddedNatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real detokenizer process (shard 0) for SmolLM2 on its own namespace of the session's NATS server;
    yields the namespace once it is ready."""
    ns = "reasoning-split"
    log = tmp_path_factory.mktemp("detokenizer") / "detokenizer.log"

    async def wait_ready(proc: subprocess.Popen[bytes]) -> None:
        nc = await nats.connect(nats_server.url)
        sub = await nc.subscribe(f"{ns}.control.ready")
        await nc.flush()
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=5)
                except nats.errors.TimeoutError:
                    assert proc.poll() is None, Path(log).read_text()[-3000:]
                    continue
                if decode(msg.data, ActorReady).role == "detokenizer":
                    return
        finally:
            await nc.close()

    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ringserve.actors.detokenizer", "--nats-url", nats_server.url,
                                 "--namespace", ns, "--model", "SmolLM2-135M-Instruct", "--shard", "0"], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        asyncio.run(asyncio.wait_for(wait_ready(proc), timeout=120))
        yield ns
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def send_rows(nats_url: str, ns: str, rid: str, ids: list[int], sizes: list[int], plan: ReasoningPlan | None,
              finish: FinishReason) -> list[RequestOutput]:
    """Send `ids` as a request's rows (chunks of `sizes`, cycled; the first row with its DecodeParams) in
    unnumbered step messages to detokenizer 0, and collect its outputs up to the last."""

    async def scenario() -> list[RequestOutput]:
        nc = await nats.connect(nats_url)
        sub = await nc.subscribe(f"{ns}.out.{rid}")
        await nc.flush()
        i = k = 0
        while True:
            chunk = ids[i: i + sizes[k % len(sizes)]]
            i, k = i + len(chunk), k + 1
            last = i >= len(ids)
            row = TokenRow(rid=rid, token_ids=chunk, prompt_tokens=5, completion_tokens=i,
                           decode=DecodeParams(reasoning=plan) if k == 1 else None, finish=finish if last else None)
            await nc.publish(f"{ns}.tokens.0", encode(BatchTokenOutput(step=k, rows=[row])))
            if last:
                break
        await nc.flush()
        outputs: list[RequestOutput] = []
        try:
            while not outputs or not outputs[-1].is_last:
                outputs.append(decode((await sub.next_msg(timeout=20)).data, RequestOutput))
        finally:
            await nc.close()
        return outputs

    return asyncio.run(scenario())


def test_the_detokenizer_actor_publishes_thinking_and_answer_apart(tok: Any, detokenizer: str,
                                                                    nats_server: EmbeddedNatsServer) -> None:
    text = "<think>\nThe user says hi; 🎉 reply kindly.\n</think>\n\nHello! How can I help?"
    ids = tok.encode(text)
    outputs = send_rows(nats_server.url, detokenizer, "split-1", ids, [1, 3, 2], QWEN3, FinishReason("length"))
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    assert [o.seq for o in outputs] == list(range(len(outputs)))
    assert "".join(o.reasoning_text for o in outputs) == "The user says hi; 🎉 reply kindly."
    assert "".join(o.text for o in outputs) == "Hello! How can I help?"
    assert not any("<" in o.text or "<" in o.reasoning_text for o in outputs)
    assert [t for o in outputs for t in o.token_ids] == ids  # token ids stay per token, unsplit
    first_answer = next(k for k, o in enumerate(outputs) if o.text)
    assert all(not o.reasoning_text for o in outputs[first_answer:])  # the thinking comes before the answer

    cut = tok.encode("<think>\nStill thinking when the length ran out")
    outputs = send_rows(nats_server.url, detokenizer, "split-2", cut, [2], QWEN3, FinishReason("length"))
    assert "".join(o.reasoning_text for o in outputs) == "Still thinking when the length ran out"
    assert "".join(o.text for o in outputs) == ""
    assert outputs[-1].finish is not None and outputs[-1].finish.type == "length"

    outputs = send_rows(nats_server.url, detokenizer, "split-3", ids, [4], None, FinishReason("length"))
    assert "".join(o.text for o in outputs) == text and not any(o.reasoning_text for o in outputs)
