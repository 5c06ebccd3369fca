"""An OpenAI-compatible HTTP endpoint over a rollout rank's engine, for agent programs
(`rollout.agent.program`, `raygraph.agents.program`).

Routes, under `http://<host>:<port>/<episode key>/v1`:

    POST chat/completions   messages -> the policy's chat template -> token ids -> one model turn
    POST completions        a prompt string (tokenized as a raw prompt) or a list of token ids
    GET  models             the one model served

* The server binds one address (`host`: the node's own by default, `node_address`), never all
  interfaces, and answers only requests whose `Authorization: Bearer <key>` is the run's secret.
* The path's episode key names the episode a request belongs to, so all of an episode's requests
  reach the same rank and are recorded together; a key that is over (its episode ended) gets 410.
* A request is handed to `on_request(episode, kind, body)` (the program loop), which returns the
  response body or raises `RequestRefused` (a 400 with its message: what is not supported and why).

Each request runs in its own thread; the program loop answers them from its own thread.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from raygraph.errors import RaygraphError

__all__ = ["Endpoint", "RequestRefused", "node_address"]

log = logging.getLogger("raygraph")

MAX_BODY_BYTES = 16 * 1024 * 1024


class RequestRefused(RaygraphError, ValueError):
    """A request the endpoint will not serve (its message says why; the client gets a 400)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def node_address() -> str:
    """This node's address as Ray knows it (inside a Ray worker), else the loopback address."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


class Endpoint:
    """The HTTP server of one rollout rank; it runs until `close`.

    Args:
        on_request: `(episode, kind, body) -> response body`; kind is "chat" or "completion";
            episode is what `open_episode` was given.
        model_name: the name `GET /v1/models` reports (clients may send any `model`).
        host: the address to bind (None: `node_address()`).
    """

    def __init__(self, on_request: Callable[[Any, str, dict], dict], model_name: str = "policy",
                 host: str | None = None) -> None:
        self.on_request, self.model_name = on_request, model_name
        self.key = secrets.token_urlsafe(24)   # the run's secret: the clients' api_key
        self._episodes: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.server = _Server((host or node_address(), 0), _handler(self))
        self.host, self.port = self.server.server_address[:2]
        self._thread = threading.Thread(target=self.server.serve_forever, name="raygraph-endpoint", daemon=True)
        self._thread.start()

    def open_episode(self, episode: Any) -> str:
        """The base URL of a new episode's requests (`.../<episode key>/v1`)."""
        token = secrets.token_urlsafe(12)
        with self._lock:
            self._episodes[token] = episode
        return f"http://{self.host}:{self.port}/{token}/v1"

    def close_episodes(self) -> None:
        """End every episode: later requests on their URLs get 410."""
        with self._lock:
            self._episodes.clear()

    def episode_of(self, token: str) -> Any:
        with self._lock:
            return self._episodes.get(token)

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.key.encode())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096   # every episode of a step may connect at once (the default is 5)


_ROUTES = {"chat/completions": "chat", "completions": "completion"}


def _handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002 - the base class's name
            log.debug("endpoint: " + format, *args)

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
            self._reply(status, {"error": {"message": message, "type": kind, "code": status}})

        def _route(self) -> tuple[Any, str] | None:
            """The request's episode and route, or None after replying with the error."""
            if not endpoint.authorized(self.headers.get("Authorization")):
                self._error(401, "missing or wrong API key: use the api_key of the client raygraph gave the "
                                 "program", "authentication_error")
                return None
            token, _, rest = self.path.strip("/").partition("/")
            episode = endpoint.episode_of(token)
            if episode is None:
                self._error(410, "this episode is over (or the URL is not an episode's): requests are served "
                                 "only while their episode runs")
                return None
            return episode, rest.removeprefix("v1/").split("?")[0]

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if (route := self._route()) is None:
                return
            if route[1] != "models":
                self._error(404, f"no route GET /v1/{route[1]}")
                return
            self._reply(200, {"object": "list", "data": [{"id": endpoint.model_name, "object": "model",
                                                          "owned_by": "raygraph"}]})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True   # the body is not read: the connection cannot carry another request
                self._error(413 if length > 0 else 400, f"Content-Length must be 0..{MAX_BODY_BYTES} bytes")
                return
            raw = self.rfile.read(length)
            if (route := self._route()) is None:
                return
            episode, name = route
            if name not in _ROUTES:
                self._error(404, f"no route POST /v1/{name}: this endpoint serves chat/completions and completions")
                return
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise RequestRefused("the request body must be a JSON object")
                self._reply(200, endpoint.on_request(episode, _ROUTES[name], body))
            except json.JSONDecodeError as exc:
                self._error(400, f"the request body is not JSON: {exc}")
            except RequestRefused as exc:
                self._error(exc.status, str(exc))
            except Exception as exc:  # noqa: BLE001 - the program gets a 500 naming it; the loop has the details
                log.debug("endpoint: request failed", exc_info=True)
                self._error(500, f"{type(exc).__name__}: {exc}", "server_error")

    return Handler
