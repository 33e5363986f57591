"""Requests end with their client: an ASGI middleware that cancels a request's handler the moment its
client closes the connection, wherever the request is (waiting in the engine queue, in the prefill, in
the decode, streaming or not).

Once the handler has read the request body, this middleware alone listens on the connection (the only
message that can still come is `http.disconnect`); the handler's own later reads (Starlette's streaming
response listens too) wait for that same message. On a disconnect before the response is complete, the
handler's cancel scope is cancelled: the API's generation then tells the engine to stop (`cancel`) and
waits for its confirmation, so the engine is free for the next request. The log (stderr) says so.
"""
from __future__ import annotations

import asyncio
import logging

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("moedesk.serve")


class CancelOnDisconnect:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body_read, gone = anyio.Event(), anyio.Event()
        state = {"responded": False}

        async def app_receive() -> Message:
            if body_read.is_set():                  # the watcher below owns the connection now
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def app_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state["responded"] = True
            await send(message)

        async def watch(handler: anyio.CancelScope) -> None:
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not state["responded"]:
                _say_gone(scope)
                handler.cancel()

        with anyio.CancelScope() as handler:
            watcher = asyncio.ensure_future(watch(handler))
            try:
                await self.app(scope, app_receive, app_send)
            except Exception:
                if body_read.is_set() or not gone.is_set():
                    raise                           # a failure of its own, not the client's leaving
                _say_gone(scope)                    # gone before its request was read: nothing ran
            finally:
                watcher.cancel()


def _say_gone(scope: Scope) -> None:
    client = scope.get("client") or ("?", 0)
    log.info("%s %s from %s:%s: the client closed the connection; its request is cancelled",
             scope["method"], scope.get("path", ""), client[0], client[1])
