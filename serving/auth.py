"""The API key in front of serve.py's /v1 and tokenizer routes, as OpenAI's and vLLM's servers check it: a
request must carry `Authorization: Bearer KEY`, or it gets a 401 in OpenAI's error shape. The
chat page and /health stay open (the page asks for the key and sends it itself).
"""

import hmac

from starlette.responses import JSONResponse

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
KEYED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")  # paths that need the key

REFUSED = {
    "error": {
        "message": "missing or wrong API key: this server needs the header 'Authorization: Bearer KEY' with the "
        "key it was started with (--api_key or NANOMAX_API_KEY)",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


class RequireKey:
    """ASGI middleware: a request to /v1 (or the tokenizer's routes) without the key gets a 401."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(KEYED) and not self.allowed(scope):
            refused = JSONResponse(REFUSED, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await refused(scope, receive, send)
        await self.app(scope, receive, send)

    def allowed(self, scope) -> bool:
        scheme, _, sent = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # compare_digest takes as long whatever the key's first wrong byte: no guessing it byte by byte
        return scheme.lower() == b"bearer" and hmac.compare_digest(sent.strip(), self.key)


def exposure_warning(host: str, port: int, key: str) -> str | None:
    """One line when the server listens beyond this machine with no key; None otherwise."""
    if key or host in LOCAL_HOSTS:
        return None
    return (
        f"warning: serving on {host} without an API key: anyone who can reach port {port} can use the "
        f"model (set --api_key=KEY or NANOMAX_API_KEY)"
    )


def socket_warning(path: str, mode: int, key: str) -> str | None:
    """One line when users other than this one may connect to the unix socket (it is writable by its
    group or by others) and there is no key; None otherwise."""
    who = " and ".join(name for name, bit in (("its group", 0o020), ("every user here", 0o002)) if mode & bit)
    if key or not who:
        return None
    return (
        f"warning: the unix socket {path} (mode {mode:03o}) lets {who} use the model without an API key "
        f"(set --api_key=KEY or NANOMAX_API_KEY, or a --uds_mode such as 600)"
    )
