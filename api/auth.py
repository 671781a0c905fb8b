"""Optional bearer-key authentication (`AppConfig.api_key`).

Every route but the public ones (/health, so load balancers and Serve's
probes need no key) requires `Authorization: Bearer <key>` (or Anthropic's
`x-api-key: <key>`, as its clients send it to `/v1/messages`); anything else
is a 401 with OpenAI's error body, answered before the request body is
read.  The key is compared as SHA-256 digests with `hmac.compare_digest`,
so the time taken reveals neither the key nor its length, and it is never
logged: it lives in a `SecretStr` and as a digest here.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import APIError

PUBLIC_PATHS = frozenset({"/health"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first Authorization header, if it uses the Bearer
    scheme; else the first `x-api-key` header's value."""
    key = None
    for name, value in headers:
        lower = name.lower()
        if lower == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            return token.strip()
        if lower == b"x-api-key" and key is None:
            key = value.strip()
    return key


def _route_path(scope: Scope) -> str:
    # The path below the app's mount point (Serve's route prefix).
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


class BearerKeyAuth:
    def __init__(self, app: ASGIApp, api_key: SecretStr | None,
                 public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self._digest = None if api_key is None else _digest(
            api_key.get_secret_value().encode("utf-8"))
        self.public_paths = public_paths

    def authorized(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        if self._digest is None:
            return True
        token = bearer_token(headers)
        # Compared even when absent, so a missing key costs what a wrong one does.
        return hmac.compare_digest(_digest(token or b""), self._digest) and bool(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or self._digest is None
                or _route_path(scope) in self.public_paths
                or self.authorized(scope["headers"])):
            await self.app(scope, receive, send)
            return
        missing = bearer_token(scope["headers"]) is None
        message = ("no API key provided; send it as `Authorization: Bearer <key>`" if missing
                   else "incorrect API key provided")
        error = APIError(401, message, type_="invalid_request_error",
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)
