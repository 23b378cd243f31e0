"""The choices of one OpenAI response: n choices for each of its prompts, each a request on the ring, started,
collected or merged as one.

Choices are prompt-major, as OpenAI orders them: choice k = p * n + i is sample i of prompt p, and runs as rid
`R-k` of response rid `R` (a single choice keeps `R`), with the same sampling except a given seed, which
becomes seed + i (mod 2^63) so a prompt's choices differ yet stay reproducible. Whatever ends the response
early (an error in one choice, a client disconnect, a consumer that stops reading) aborts every choice still
running.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request

from ringserve.bus.errors import ApiError
from ringserve.actors.entry.request_flow import DisconnectWatch, EntryService
from ringserve.bus.messages import GenerateRequest, RequestOutput
from ringserve.bus.params import MAX_SEED
from ringserve.bus.ring_client import RequestStream

SEED_MODULUS = MAX_SEED + 1  # 2^63: choice seeds wrap around instead of leaving the seed range


def choice_seed(seed: object, i: int) -> object:
    """The seed of choice i: seed + i mod 2^63 for a valid seed; anything else is left for validation."""
    if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED:
        return (seed + i) % SEED_MODULUS
    return seed


def fan_out(prompts: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    """The requests behind one response, prompt-major: choice p * n + i as rid `{rid}-{p * n + i}`."""
    if len(prompts) * n == 1:
        return list(prompts)
    requests = []
    for p, gen_req in enumerate(prompts):
        for i in range(n):
            sampling = dict(gen_req.sampling)
            if "seed" in sampling:
                sampling["seed"] = choice_seed(sampling["seed"], i)
            requests.append(dataclasses.replace(gen_req, rid=f"{gen_req.rid}-{p * n + i}", sampling=sampling))
    return requests


@dataclass
class Choice:
    """One started choice: its index in the response, its stream and its first output."""

    index: int
    stream: RequestStream
    first: RequestOutput


class ChoiceGroup:
    """The started choices of one response; `collect` or `merged` consumes them and releases them all."""

    def __init__(self, service: EntryService, rid: str, choices: list[Choice]) -> None:
        self.service = service
        self.rid = rid
        self.choices = choices

    @classmethod
    async def start(cls, service: EntryService, request: Request, prompts: list[GenerateRequest],
                    n: int) -> "ChoiceGroup":
        """Submit the n choices of every prompt (all with the response's rid) and wait for each one's first
        output.

        Raises ApiError (the first failing choice's error, every choice aborted) or ClientDisconnected.
        """
        rid = prompts[0].rid
        for gen_req in prompts[1:]:  # start_many checks the first; the prompts differ in size
            service.check_payload(gen_req)
        requests = fan_out(prompts, n)
        grouped = len(requests) > 1
        if grouped:
            if rid in service.groups:
                raise ApiError(f"request id {rid!r} is already in use", param="rid")
            service.groups[rid] = [r.rid for r in requests]  # so /abort_request with the rid finds them
        try:
            started = await service.start_many(request, requests)
        except BaseException:
            if grouped:
                service.groups.pop(rid, None)
            raise
        return cls(service, rid, [Choice(i, stream, first) for i, (stream, first) in enumerate(started)])

    async def close(self) -> None:
        """Release every choice (aborting those still running) and forget the group."""
        if len(self.choices) > 1:
            self.service.groups.pop(self.rid, None)
        await self.service.release_all([choice.stream for choice in self.choices])

    async def collect(self, request: Request) -> list[list[RequestOutput]]:
        """Every choice's outputs, read concurrently, in choice order.

        Raises ApiError for an error output and ClientDisconnected if the client goes away; either way every
        choice is released.
        """
        watch = DisconnectWatch(request)

        async def read(choice: Choice) -> list[RequestOutput]:
            outputs = [choice.first]
            while not choice.stream.finished:
                outputs.append(await watch.next(choice.stream))
            if outputs[-1].error is not None:
                raise outputs[-1].error
            return outputs

        tasks = [asyncio.ensure_future(read(choice)) for choice in self.choices]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            watch.close()
            await self.close()

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) for every output of every choice as it arrives; each choice in order.

        The first outputs come first. Closing the iterator early (use `contextlib.aclosing`) or cancelling it
        aborts the choices still running.
        """
        pending: dict[asyncio.Future[RequestOutput], Choice] = {}

        def arm(choice: Choice) -> None:
            if not choice.stream.finished:
                pending[asyncio.ensure_future(choice.stream.next())] = choice

        try:
            for choice in self.choices:
                yield choice.index, choice.first
            for choice in self.choices:
                arm(choice)
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: pending[f].index):
                    choice = pending.pop(future)
                    yield choice.index, future.result()
                    arm(choice)
        finally:
            for future in pending:
                future.cancel()
            await self.close()
