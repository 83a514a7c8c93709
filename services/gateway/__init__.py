"""The turnbus HTTP gateway: the v1 API, auth and SSE."""
