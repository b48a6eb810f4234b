"""One request's link between the HTTP layer and the engine: :class:`RequestStream` makes the request's sequences
(one per prompt and choice), submits them, receives their Events from the engine's loop and hands them, tagged
with the choice index, to the coroutine building the response; ``abort()`` cancels whatever still runs.

Delivery is chosen once, when the stream is made: when the engine steps on this event loop's thread (``serve``
runs it so) an Event goes straight into the asyncio queue; an engine on a thread of its own must go through
``call_soon_threadsafe``, which costs a self-pipe write and read per token.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Protocol

from serve.sampling import SamplingParams
from serve.sequence import Event, Sequence


class EngineLike(Protocol):
    """What a stream needs of :class:`serve.engine.Engine`."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...

    def submit(self, seqs: list[Sequence]) -> None: ...

    def abort(self, seq: Sequence) -> None: ...


class RequestStream:
    """Events of one request's sequences, as ``(index, Event)`` in the order the engine produced them."""

    def __init__(self, engine: EngineLike, vocab_size: int):
        self.engine = engine
        self.vocab_size = vocab_size
        self.seqs: list[Sequence] = []
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self._same_thread = engine.loop is self._loop
        self.finished = 0  # sequences whose last Event has been taken

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """A sequence whose Events come out of this stream with index = the order it was added in."""
        sink = partial(self._put_local if self._same_thread else self._put_threadsafe, len(self.seqs))
        seq = Sequence(prompt_ids, params, sink, self.vocab_size)
        self.seqs.append(seq)
        return seq

    def submit(self) -> None:
        """Hand the sequences to the engine, all or none (QueueFull, EngineStopped)."""
        self.engine.submit(self.seqs)

    def _put_local(self, index: int, ev: Event) -> None:
        self._queue.put_nowait((index, ev))

    def _put_threadsafe(self, index: int, ev: Event) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, ev))

    @property
    def done(self) -> bool:
        """Every sequence's finishing Event has been taken."""
        return self.finished >= len(self.seqs)

    async def get(self) -> tuple[int, Event]:
        item = await self._queue.get()
        if item[1].finish_reason is not None:
            self.finished += 1
        return item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, Event]:
        if self.done:
            raise StopAsyncIteration
        return await self.get()

    def abort(self) -> None:
        """Cancel the sequences still running (the client went away, or the response is complete)."""
        for s in self.seqs:
            self.engine.abort(s)

    def completion_tokens(self) -> int:
        return sum(len(s.out_ids) for s in self.seqs)

    async def watch_disconnect(self, receive) -> None:
        """Abort when the ASGI ``receive`` says the client disconnected (run as a task beside the response)."""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.abort()
                return
