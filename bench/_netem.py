"""Emulated network links for benchmarks: a TCP proxy whose downstream bandwidth is capped.

On one machine every store is on loopback, so a cloud bucket is as fast as a peer in the
next rack. Benchmarks that are about where bytes come from put the bucket behind this proxy
with a realistic rate (tc-netem style, in user space): one token bucket shared by all
connections, refilled at ``rate_mb_s`` megabytes per second.
"""

from __future__ import annotations

import asyncio
import threading
import time


class ThrottledProxy:
    def __init__(self, upstream_host: str, upstream_port: int, rate_mb_s: float, host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rate_bytes_s = rate_mb_s * 1e6
        self.host = host
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._tokens = 0.0
        self._last = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ThrottledProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _take(self, n: int) -> None:
        """Wait until ``n`` bytes may pass (burst at most 64 KB)."""
        while True:
            now = time.monotonic()
            self._tokens = min(65536.0, self._tokens + (now - self._last) * self.rate_bytes_s)
            self._last = now
            if self._tokens >= n:
                self._tokens -= n
                return
            await asyncio.sleep((n - self._tokens) / self.rate_bytes_s)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, throttle: bool) -> None:
        try:
            while data := await reader.read(16384):
                if throttle:
                    await self._take(len(data))
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self._pipe(client_r, up_w, False), self._pipe(up_r, client_w, True))

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, self.host, 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()


if __name__ == "__main__":  # python bench/_netem.py UPSTREAM_HOST UPSTREAM_PORT RATE_MB_S: prints the proxy's URL
    import sys

    proxy = ThrottledProxy(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])).start()
    print(proxy.url, flush=True)
    threading.Event().wait()
