"""The n choices of one OpenAI response: n requests on the ring, started, collected or merged as one.

Choice i of response rid `R` runs as rid `R-i` (n = 1 keeps `R`), with the same sampling except a given
seed, which becomes seed + i so choices differ yet stay reproducible. Whatever ends the response early (an
error in one choice, a client disconnect, a consumer that stops reading) aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request

from bus.errors import ApiError
from actors.entry.request_flow import DisconnectWatch, EntryService
from bus.messages import GenerateRequest, RequestOutput
from bus.ring_client import RequestStream


def fan_out(gen_req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The n requests behind one response: rids `{rid}-{i}`, an integer seed becomes seed + i."""
    if n == 1:
        return [gen_req]
    requests = []
    for i in range(n):
        sampling = dict(gen_req.sampling)
        seed = sampling.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            sampling["seed"] = seed + i
        requests.append(dataclasses.replace(gen_req, rid=f"{gen_req.rid}-{i}", sampling=sampling))
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
    async def start(cls, service: EntryService, request: Request, gen_req: GenerateRequest,
                    n: int) -> "ChoiceGroup":
        """Submit the n choices and wait for each one's first output.

        Raises ApiError (the first failing choice's error, every choice aborted) or ClientDisconnected.
        """
        requests = fan_out(gen_req, n)
        if n > 1:
            if gen_req.rid in service.groups:
                raise ApiError(f"request id {gen_req.rid!r} is already in use", param="rid")
            service.groups[gen_req.rid] = [r.rid for r in requests]  # so /abort_request with the rid finds them
        try:
            started = await service.start_many(request, requests)
        except BaseException:
            if n > 1:
                service.groups.pop(gen_req.rid, None)
            raise
        return cls(service, gen_req.rid, [Choice(i, stream, first) for i, (stream, first) in enumerate(started)])

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
