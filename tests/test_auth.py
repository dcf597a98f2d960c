"""serving/auth.py: the bearer key in front of /v1, called as uvicorn calls it (one ASGI request), and the
warning for a server open to the network without one."""

import asyncio
import json

from serving import auth


def get(path, authorization=None) -> tuple[int, dict | None]:
    """(status, JSON body) of a GET through RequireKey; the app behind it answers 200 with no body."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    sent = []

    async def send(message):
        sent.append(message)

    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers, "query_string": b""}
    asyncio.run(auth.RequireKey(app, "s3cret")(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(body) if body else None


def test_v1_needs_the_bearer_key_and_refuses_in_openais_shape():
    for refused in (None, "", "Bearer", "Bearer wrong", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret"):
        status, body = get("/v1/completions", refused)
        assert status == 401, refused
        assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
        assert "Authorization: Bearer" in body["error"]["message"]
    assert get("/v1/models", "Bearer s3cret") == (200, None)
    assert get("/v1/models", "bearer s3cret") == (200, None)  # the scheme's case does not matter (RFC 6750)
    assert get("/tokenize", None)[0] == get("/tokenizer_info", None)[0] == 401  # the tokenizer's routes too
    assert get("/", None) == get("/health", None) == get("/app.js", None) == (200, None)  # the page is open


def test_a_warning_only_for_a_server_open_to_the_network_without_a_key():
    warning = auth.exposure_warning("0.0.0.0", 8000, "")
    assert warning.startswith("warning: serving on 0.0.0.0 without an API key") and "--api_key" in warning
    assert "\n" not in warning
    assert auth.exposure_warning("0.0.0.0", 8000, "s3cret") is None
    assert all(auth.exposure_warning(host, 8000, "") is None for host in ("127.0.0.1", "localhost", "::1"))


def test_a_warning_only_for_a_unix_socket_others_may_connect_to_without_a_key():
    assert auth.socket_warning("/run/s.sock", 0o600, "") is None
    assert auth.socket_warning("/run/s.sock", 0o755, "") is None  # connecting takes write permission
    assert auth.socket_warning("/run/s.sock", 0o666, "s3cret") is None
    group = auth.socket_warning("/run/s.sock", 0o660, "")
    assert group.startswith("warning: the unix socket /run/s.sock (mode 660) lets its group use the model")
    assert "every user here" in auth.socket_warning("/run/s.sock", 0o606, "") and "\n" not in group
