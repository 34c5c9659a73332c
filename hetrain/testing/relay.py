"""A byte relay between a TCP port and a unix socket, to reach a server inside a network namespace.

Unix sockets live in the file system, which every namespace shares, so a pair of relays joins
a port inside a namespace to one on the host without giving the host an address on the
bed's network: ``python -m hetrain.testing.relay LISTEN CONNECT``, each ``tcp:HOST:PORT`` or
``unix:PATH``. It prints ``ready`` once it listens. Test beds use it for their control plane
(the Prefect API the test drives); the links under test carry no relayed bytes.
"""

from __future__ import annotations

import asyncio
import os
import sys

CHUNK = 1 << 16


async def _open(target: str):
    kind, _, where = target.partition(":")
    if kind == "unix":
        return await asyncio.open_unix_connection(where)
    host, _, port = where.rpartition(":")
    return await asyncio.open_connection(host, int(port))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(listen: str, connect: str) -> None:
    async def handle(reader, writer):
        try:
            up_reader, up_writer = await _open(connect)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    kind, _, where = listen.partition(":")
    if kind == "unix":
        if os.path.exists(where):
            os.unlink(where)
        server = await asyncio.start_unix_server(handle, where)
    else:
        host, _, port = where.rpartition(":")
        server = await asyncio.start_server(handle, host, int(port))
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 3 or not all(a.startswith(("tcp:", "unix:")) for a in sys.argv[1:]):
        sys.exit("usage: python -m hetrain.testing.relay tcp:HOST:PORT|unix:PATH tcp:HOST:PORT|unix:PATH")
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
