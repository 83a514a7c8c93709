"""The HTTP transport under the model SDKs (Anthropic's and OpenAI's, both generated from
one template on ``httpx2``): aiohttp, with the response at hand; and the round's POST,
built by the SDK once per client and sent on the same aiohttp session.

The SDK sends its requests through an ``httpx2`` client; this transport makes them on
aiohttp (as the SDK's own ``DefaultAioHttpClient`` does: httpx's pool checks every
connection on each request, which costs a worker more with every stream it holds) and
puts the aiohttp response in the httpx response's ``extensions``
(:data:`AIOHTTP_RESPONSE`), so :func:`body_chunks` reads a streamed body straight from
aiohttp, without httpx's layers per chunk, and :func:`response_headers` looks headers up
in aiohttp's hashed ones (httpx's lookup scans every header, ~25 on an API answer).

:class:`DirectPost` is the round's request without the SDK's per-request work (its
options object, header layers, URL merge and httpx ``Request``: ~60 % of a
``client.post``): the SDK builds the request once, and each round sends that URL and
those headers with its own body on the transport's aiohttp session. An error status
still becomes the SDK's exception, through the SDK's own helper; a client whose request
cannot be built once (per-request auth or signing, middleware, tracing, another
transport) keeps the SDK's ``client.post`` (:class:`SdkPost`).
"""

from __future__ import annotations

import asyncio
import importlib
import urllib.request
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import aiohttp
import httpx2

if TYPE_CHECKING:
    import anthropic
    import openai

    SdkClient: TypeAlias = anthropic.AsyncAnthropic | openai.AsyncOpenAI

__all__ = [
    "AIOHTTP_RESPONSE",
    "AiohttpTransport",
    "DirectPost",
    "Opened",
    "Post",
    "SdkPost",
    "SseSplitter",
    "body_chunks",
    "post_for",
    "response_headers",
    "sdk_module",
]

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

    def session(self) -> aiohttp.ClientSession:
        """The transport's aiohttp session, made at its first use."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ssl=httpx2.create_ssl_context())
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

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
        timeout = request.extensions.get("timeout", {})
        try:
            response = await self.session().request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=await request.aread() or None,
                allow_redirects=False,
                auto_decompress=False,
                compress=False,
                proxy=self._proxy(request.url),
                timeout=_client_timeout(timeout),
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


def _client_timeout(timeout: Mapping[str, float | None]) -> aiohttp.ClientTimeout:
    """httpx's timeouts (a request's ``timeout`` extension) as aiohttp's."""
    return aiohttp.ClientTimeout(
        sock_connect=timeout.get("connect"),
        sock_read=timeout.get("read"),
        connect=timeout.get("pool"),
    )


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


# --- the round's POST ---------------------------------------------------------------------


def sdk_module(client: SdkClient) -> Any:
    """The SDK package the client comes from (``anthropic`` or ``openai``): its
    exceptions and its ``_base_client`` (imported only by those who use that SDK)."""
    return importlib.import_module(type(client).__module__.partition(".")[0])


def _static_auth(client: SdkClient) -> bool:
    """Whether the client's auth headers are the same for every request: no custom auth
    and no hook that changes each request. OpenAI's client overrides the hook, for its
    provider runtimes (cloud credentials) and key providers (a callable ``api_key``)
    only: with neither, its requests are the same too."""
    if client.custom_auth is not None:
        return False
    base = importlib.import_module(sdk_module(client).__name__ + "._base_client")
    if type(client)._prepare_request is base.AsyncAPIClient._prepare_request:
        return True
    return (
        hasattr(client, "_provider_runtime")
        and getattr(client, "_provider_runtime", None) is None
        and getattr(client, "_api_key_provider", None) is None
    )


class Opened(Protocol):
    """A streamed response with a 2xx status, its body not read yet."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Post(Protocol):
    """One endpoint's streamed POST. ``send`` raises the SDK's exceptions:
    ``APIStatusError`` (and its subclasses) for an error status, ``APITimeoutError`` and
    ``APIConnectionError`` when no response came."""

    async def send(self, body: bytes) -> Opened: ...


class _SdkOpened:
    __slots__ = ("_response",)

    def __init__(self, response: httpx2.Response) -> None:
        self._response = response

    @property
    def headers(self) -> Mapping[str, str]:
        return response_headers(self._response)

    def chunks(self) -> AsyncIterator[bytes]:
        return body_chunks(self._response)

    async def aclose(self) -> None:
        await self._response.aclose()


class SdkPost:
    """The POST through the SDK's generic ``client.post``: its whole request path on
    every send (options, headers, auth flow, middleware, tracing)."""

    __slots__ = ("_client", "_path")

    def __init__(self, client: SdkClient, path: str) -> None:
        self._client = client
        self._path = path

    async def send(self, body: bytes) -> Opened:
        response = await self._client.post(
            self._path, cast_to=httpx2.Response, content=body, stream=True
        )
        return _SdkOpened(response)


class _DirectOpened:
    __slots__ = ("_request", "_response")

    def __init__(self, response: aiohttp.ClientResponse, request: httpx2.Request) -> None:
        self._response = response
        self._request = request

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    def chunks(self) -> AsyncIterator[bytes]:
        response = self._response
        if response.headers.get("content-encoding", "identity") == "identity":
            return response.content.iter_any()
        # A compressed body (the API sends none): decoded by httpx, as the SDK would.
        wrapped = httpx2.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_Body(response),
            request=self._request,
        )
        return wrapped.aiter_bytes()

    async def aclose(self) -> None:
        self._response.release()


class DirectPost:
    """The POST as the SDK builds it (URL, auth and default headers, timeouts), built
    once by :meth:`build` and sent on the transport's aiohttp session with each body."""

    __slots__ = (
        "_client",
        "_errors",
        "_headers",
        "_proxy",
        "_request",
        "_session",
        "_timeout",
        "_url",
    )

    def __init__(
        self,
        client: SdkClient,
        transport: AiohttpTransport,
        request: httpx2.Request,
    ) -> None:
        self._client = client
        self._errors = sdk_module(client)
        self._request = request  # the SDK's request, body-less: for its exceptions
        self._url = str(request.url)
        # The body's length is aiohttp's to set, per body.
        self._headers = [
            (name, value)
            for name, value in request.headers.multi_items()
            if name.lower() != "content-length"
        ]
        self._timeout = _client_timeout(request.extensions.get("timeout", {}))
        self._proxy = transport._proxy(request.url)
        self._session = transport.session

    @staticmethod
    def supports(client: SdkClient) -> AiohttpTransport | None:
        """The client's transport when a request built once serves every send: an
        :class:`AiohttpTransport`, headers that do not change per request (no auth flow,
        no signing hook, no middleware, no idempotency key to make per request). The
        SDK's tracing makes no span for a request of its generic ``post`` (no SDK method
        names it), so it has none to lose."""
        http = client._client
        transport = getattr(http, "_transport", None)
        static = (
            isinstance(transport, AiohttpTransport)
            and _static_auth(client)
            and not getattr(client, "_middleware", None)
            and not client._idempotency_header
            and not any(http.event_hooks.values())
            and not http.auth
        )
        return transport if static else None

    @classmethod
    async def build(cls, client: SdkClient, path: str, **fields: Any) -> DirectPost | None:
        """The POST to ``path`` as the SDK would send it; None if it cannot be built once.
        ``fields`` are more of the SDK's request options (e.g. OpenAI's ``security``)."""
        transport = cls.supports(client)
        if transport is None:
            return None
        package = sdk_module(client).__name__
        base = importlib.import_module(package + "._base_client")
        models = importlib.import_module(package + "._models")
        if client._platform is None:
            # The SDK resolves it off the loop too (it may block).
            client._platform = await asyncio.to_thread(base.get_platform)
        options = models.FinalRequestOptions.construct(
            method="post", url=path, content=b"", **fields
        )
        sdk: Any = client  # either SDK's: their options types are twins, not one
        options = await sdk._prepare_options(options)
        request = sdk._build_request(options)
        return cls(client, transport, request)

    async def send(self, body: bytes) -> Opened:
        try:
            response = await self._session().request(
                "POST",
                self._url,
                headers=self._headers,
                data=body,
                # As the SDK's client: redirects followed (aiohttp drops the
                # Authorization header on one to another origin, as httpx does).
                allow_redirects=True,
                auto_decompress=False,
                compress=False,
                proxy=self._proxy,
                timeout=self._timeout,
            )
        except TimeoutError as exc:
            raise self._errors.APITimeoutError(request=self._request) from exc
        except aiohttp.ClientError as exc:
            raise self._errors.APIConnectionError(request=self._request) from exc
        if 200 <= response.status < 300:
            return _DirectOpened(response, self._request)
        try:
            content = await response.read()
        finally:
            response.release()
        failed = httpx2.Response(
            status_code=response.status,
            headers=response.raw_headers,
            content=content,
            request=self._request,
        )
        raise self._client._make_status_error_from_response(failed)


async def post_for(client: SdkClient, path: str, **fields: Any) -> Post:
    """The cheapest POST the client allows: :class:`DirectPost`, else :class:`SdkPost`."""
    return await DirectPost.build(client, path, **fields) or SdkPost(client, path)


class SseSplitter:
    """The ``data`` of each server-sent event in a byte stream cut anywhere.

    Narrower than a browser's parser (the worker needs only the data: the API repeats
    the event's name as the JSON's ``type``): lines end in LF, CRLF or CR, a blank line
    ends an event, ``data`` lines join with LF, other fields and comments are ignored."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            # A CR at the very end may be the first half of a CRLF: kept as it is.
            keep = b"\r" if buffer.endswith(b"\r") else b""
            body = buffer[: len(buffer) - len(keep)]
            buffer = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + keep
        *events, self._buffer = buffer.split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            start = event.find(b"data:")
            if start < 0:
                continue  # a comment, or an event without data: nothing to dispatch
            if (start == 0 or event[start - 1] == 10) and event.find(b"\n", start) < 0:
                # The API's shape: one data line, the event's last: sliced, not split.
                out.append(
                    event[start + 6 :]
                    if event[start + 5 : start + 6] == b" "
                    else event[start + 5 :]
                )
                continue
            data = [
                line[6:] if line[5:6] == b" " else line[5:]
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if data:
                out.append(data[0] if len(data) == 1 else b"\n".join(data))
        return out
