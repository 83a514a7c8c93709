"""The HTTP transport under the Anthropic SDK: aiohttp, with the response at hand.

The SDK sends its requests through an ``httpx2`` client; this transport makes them on
aiohttp (as the SDK's own ``DefaultAioHttpClient`` does: httpx's pool checks every
connection on each request, which costs a worker more with every stream it holds) and
puts the aiohttp response in the httpx response's ``extensions``
(:data:`AIOHTTP_RESPONSE`), so :func:`body_chunks` reads a streamed body straight from
aiohttp, without httpx's layers per chunk, and :func:`response_headers` looks headers up
in aiohttp's hashed ones (httpx's lookup scans every header, ~25 on an API answer).
"""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator, Mapping

import aiohttp
import httpx2

__all__ = ["AIOHTTP_RESPONSE", "AiohttpTransport", "body_chunks", "response_headers"]

AIOHTTP_RESPONSE = "turnbus.aiohttp_response"


class _Body(httpx2.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except aiohttp.ClientPayloadError as exc:
            raise httpx2.ReadError(str(exc)) from exc
        except TimeoutError as exc:
            raise httpx2.ReadTimeout(str(exc)) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx2.AsyncBaseTransport):
    """An ``httpx2`` transport on one aiohttp session, made at the first request."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._proxies: dict[tuple[str, str], str | None] = {}

    def _proxy(self, url: httpx2.URL) -> str | None:
        """The proxy the environment names for ``url`` (``HTTPS_PROXY``, ``NO_PROXY``…),
        looked up once per host: aiohttp's ``trust_env`` would do it in a thread, twice
        per request."""
        key = (url.scheme, url.host)
        if key not in self._proxies:
            proxy = urllib.request.getproxies().get(url.scheme)
            if proxy and urllib.request.proxy_bypass(url.host):
                proxy = None
            self._proxies[key] = proxy or None
        return self._proxies[key]

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ssl=httpx2.create_ssl_context())
            self._session = aiohttp.ClientSession(connector=connector)
        timeout = request.extensions.get("timeout", {})
        try:
            response = await self._session.request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=await request.aread() or None,
                allow_redirects=False,
                auto_decompress=False,
                compress=False,
                proxy=self._proxy(request.url),
                timeout=aiohttp.ClientTimeout(
                    sock_connect=timeout.get("connect"),
                    sock_read=timeout.get("read"),
                    connect=timeout.get("pool"),
                ),
            )
        except TimeoutError as exc:
            raise httpx2.ConnectTimeout(str(exc)) from exc
        except aiohttp.ClientError as exc:
            raise httpx2.ConnectError(str(exc)) from exc
        return httpx2.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_Body(response),
            request=request,
            extensions={"http_version": b"HTTP/1.1", AIOHTTP_RESPONSE: response},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def body_chunks(response: httpx2.Response) -> AsyncIterator[bytes]:
    """A streamed body's bytes as they arrive: from aiohttp when this transport made the
    request and the body is not compressed, else through httpx."""
    aio = response.extensions.get(AIOHTTP_RESPONSE)
    encoded = response.headers.get("content-encoding", "identity")
    if isinstance(aio, aiohttp.ClientResponse) and encoded == "identity":
        return aio.content.iter_any()
    return response.aiter_bytes()


def response_headers(response: httpx2.Response) -> Mapping[str, str]:
    """The response's headers, case-insensitive: aiohttp's when this transport made the
    request (a hashed lookup), else httpx's."""
    aio = response.extensions.get(AIOHTTP_RESPONSE)
    if isinstance(aio, aiohttp.ClientResponse):
        return aio.headers
    return response.headers
