"""A slow, lossy or broken link in front of a TCP service, for tests and `bench soak`'s faults.

This kernel has no ``sch_netem`` (``tc qdisc add ... netem`` answers "Specified qdisc kind is
unknown"), so delay and loss are a relay's: it delivers every chunk the link's delay after it
arrived and, for the loss rate's share of the chunks, a TCP retransmission timeout later still —
what a lost segment costs a TCP stream. ``down()`` is an outage: connections reset and refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

RTO_S = 0.2  # Linux's minimum TCP retransmission timeout: what one lost segment stalls a stream


class SlowLink:
    """A TCP relay with a link's delay and loss (see the module doc), run on a thread of its own.

    It listens on ``listen`` (host, port; port 0: a free one, then ``port``) and forwards to
    ``target``; set ``delay_s``/``loss`` at any time (0/0: a plain relay). ``down()`` is an outage:
    open connections are reset and new ones closed at once, until ``up()``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *, seed: int = 0) -> None:
        self.listen, self.target = listen, target
        self.delay_s, self.loss = 0.0, 0.0
        self.stalls = 0  # chunks held for a retransmission timeout
        self.refused = 0  # connections closed while down
        self._down = False
        self._open: set[asyncio.StreamWriter] = set()
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the relay did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, *self.listen))
        self.port = int(self._server.sockets[0].getsockname()[1])  # the one bound (``listen`` may say 0)
        self._started.set()
        try:
            self._loop.run_forever()
        finally:  # stopped by close(): every connection, the listener and the loop go
            self._reset_all()
            self._server.close()
            self._loop.run_until_complete(self._server.wait_closed())
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(asyncio.sleep(0))  # the closed ends let go of their sockets
            self._loop.close()

    @property
    def is_down(self) -> bool:
        return self._down

    def down(self) -> None:
        self._down = True
        self._loop.call_soon_threadsafe(self._reset_all)

    def up(self) -> None:
        self._down = False

    def _reset_all(self) -> None:
        for writer in list(self._open):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._down:
            self.refused += 1
            writer.transport.abort()
            return
        ends: list[asyncio.StreamWriter] = [writer]
        self._open.add(writer)
        try:  # each end is closed however this ends (a relay closed meanwhile cancels it anywhere)
            up_r, up_w = await asyncio.open_connection(*self.target)
            ends.append(up_w)
            self._open.add(up_w)
            await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)
        except OSError:
            pass  # the target is unreachable: the client's connection is closed
        finally:
            for end in ends:
                self._open.discard(end)
                end.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Each chunk is delivered ``delay_s`` after it arrived (a stalled one ``RTO_S`` later), in
        order: latency, not a cap on throughput."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                due = loop.time() + self.delay_s
                if self.loss and self._random.random() < self.loss:
                    due += RTO_S
                    self.stalls += 1
                queue.put_nowait((due, data))
            queue.put_nowait((0.0, b""))
            await sender
        finally:
            sender.cancel()
            with contextlib.suppress(Exception):
                writer.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
