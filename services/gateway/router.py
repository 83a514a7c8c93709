"""The route lookup: Starlette's router, asking only the routes that can match a path.

Starlette's router asks every route in turn whether it matches (a regex each) until
one does; the gateway's busiest paths come last in its table, so each of their
requests asked twenty. A plain route's path parameters match no ``/``, so it can only
match a path with as many ``/`` as its own: :class:`IndexedRouter` keeps, for each
count, the routes to ask, in table order, and asks only those. Every other route (a
mount, a ``{name:path}`` parameter) is asked for every path, in its place. The routes
skipped are those that answer "no match", so the answer is Starlette's: the first full
match wins, else the first partial one (a ``405``), else ``404``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.convertors import FloatConvertor, IntegerConvertor, StringConvertor, UUIDConvertor
from starlette.routing import BaseRoute, Match, Route, Router
from starlette.types import Receive, Scope, Send

__all__ = ["IndexedRouter"]

# Path parameter types whose values hold no ``/``.
_ONE_SEGMENT = (StringConvertor, IntegerConvertor, FloatConvertor, UUIDConvertor)


def _slashes(route: BaseRoute) -> int | None:
    """The ``/`` count of every path ``route`` can match; ``None`` when not one count."""
    if not isinstance(route, Route) or type(route).matches is not Route.matches:
        return None
    if not all(isinstance(c, _ONE_SEGMENT) for c in route.param_convertors.values()):
        return None
    return route.path.count("/")


class IndexedRouter(Router):
    """A :class:`~starlette.routing.Router` that asks, for an HTTP request, only the
    routes whose path has as many ``/`` as the request's (see the module docs)."""

    def __init__(self, routes: Sequence[BaseRoute], **kwargs: Any) -> None:
        super().__init__(routes, **kwargs)
        self._by_slashes: dict[int, list[BaseRoute]] = {}
        self._always: list[BaseRoute] = []
        self._indexed = -1
        self._index()

    def _index(self) -> None:
        """For each ``/`` count, the routes to ask, in table order; any other count asks
        only the routes asked for every path. Made again when the table grows."""
        counts = {_slashes(route) for route in self.routes}
        self._by_slashes = {
            count: [r for r in self.routes if _slashes(r) in (count, None)]
            for count in counts
            if count is not None
        }
        self._always = [r for r in self.routes if _slashes(r) is None]
        self._indexed = len(self.routes)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.redirect_slashes:
            await super().app(scope, receive, send)
            return
        if "router" not in scope:
            scope["router"] = self
        path: str = scope["path"]
        if scope.get("root_path"):
            # A path under a root path is matched without it: Starlette's own lookup.
            await super().app(scope, receive, send)
            return
        if len(self.routes) != self._indexed:
            self._index()
        partial = None
        partial_scope: Scope = {}
        for route in self._by_slashes.get(path.count("/"), self._always):
            match, child_scope = route.matches(scope)
            if match is Match.FULL:
                scope["route"] = route
                scope.update(child_scope)
                await route.handle(scope, receive, send)
                return
            if match is Match.PARTIAL and partial is None:
                partial, partial_scope = route, child_scope
        if partial is not None:
            scope["route"] = partial
            scope.update(partial_scope)
            await partial.handle(scope, receive, send)
            return
        await self.default(scope, receive, send)
