"""The agent's HTTP server in tests: its reading of a request head, called alone."""

from __future__ import annotations

from http import HTTPStatus

from mpsagent.web.server import MALFORMED, BadRequest, Exchange, Request


def parse_head(head: bytes) -> Request:
    """A request head (without the blank line that ends it) as the agent's HTTP server reads it, or BadRequest:
    its own exchange, fed the head at once."""
    whole = head + b"\r\n\r\n"
    exchange = Exchange(len(whole))
    exchange.receive(whole)
    request = exchange.request()
    if request is None:
        raise BadRequest(HTTPStatus.BAD_REQUEST, MALFORMED)
    return request
