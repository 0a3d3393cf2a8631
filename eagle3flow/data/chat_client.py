"""An OpenAI-compatible chat server over HTTP: the pooled client and its retry policy.

429, 5xx, timeouts and dropped connections are :class:`Transient` and retried by
:func:`call_with_retries` (exponential backoff with jitter, ``Retry-After``
honoured); any other 4xx is :class:`PromptFailed` at once.

``httpx`` is imported where the client is built: envs/ pins no version of it (it
comes with huggingface_hub and vLLM), so only a run that talks to a server needs it.
"""
from __future__ import annotations

import random
import threading

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class PromptFailed(Exception):
    """One conversation could not be answered; ``reason`` goes to the stats."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Transient(Exception):
    """A failure worth retrying (429/5xx, timeout, dropped connection)."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


class ChatClient:
    """An OpenAI-compatible server through one pooled ``httpx`` client (keep-alive
    connections, up to ``max_connections`` at once, the timeout on every request).
    Thread-safe. Status codes, timeouts and dropped connections are mapped to Transient
    (retried by :func:`call_with_retries`, whose policy and counts are this stage's) or
    PromptFailed (any other 4xx)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float, max_connections: int = 16):
        import httpx

        base = base_url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        self.timeout = timeout
        headers = {"Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout,
                                  limits=httpx.Limits(max_connections=max_connections,
                                                      max_keepalive_connections=max_connections))
        self._lock = threading.Lock()
        self.requests = 0

    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """The JSON answer; raises Transient or PromptFailed (other 4xx)."""
        import httpx

        with self._lock:
            self.requests += 1
        seconds = timeout or self.timeout
        try:
            response = (self._http.post(path, json=body, timeout=seconds) if body is not None
                        else self._http.get(path, timeout=seconds))
        except httpx.TimeoutException as error:
            raise Transient(f"timeout after {seconds:.0f}s on {path}") from error
        except httpx.TransportError as error:
            raise Transient(f"connection failed on {path}: {error}") from error
        if response.status_code >= 400:
            detail = response.text[:300].strip()
            reason = (f"HTTP {response.status_code} from {path}: {detail}" if detail
                      else f"HTTP {response.status_code} from {path}")
            if response.status_code in RETRYABLE_STATUS:
                raise Transient(reason, _retry_after(response.headers.get("Retry-After")))
            raise PromptFailed(reason)
        try:
            return response.json()
        except ValueError as error:  # a 200 whose body is not JSON
            raise Transient(f"invalid JSON from {path}: {error}") from error

    def models(self) -> dict[str, str | None]:
        """Served name -> what it serves: the ``root`` vLLM and SGLang list for a model (the
        path or Hub id it was loaded from), None where the server lists none."""
        return {m["id"]: m.get("root") for m in self._request("/v1/models", timeout=30).get("data", [])}

    def chat(self, body: dict) -> dict:
        return self._request("/v1/chat/completions", body)

    def close(self) -> None:
        self._http.close()


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


def call_with_retries(client: ChatClient, body: dict, cfg: dict, stop: threading.Event,
                      counters: dict, lock: threading.Lock) -> dict:
    """The server's answer; Transient errors retried with exponential backoff + jitter."""
    attempt = 0
    while True:
        try:
            return client.chat(body)
        except Transient as error:
            if attempt >= cfg["max_retries"] or stop.is_set():
                raise PromptFailed(f"{error.reason} (after {attempt + 1} attempts)") from None
            delay = min(cfg["max_backoff_s"], cfg["backoff_s"] * 2 ** attempt)
            delay = delay * (0.5 + random.random() / 2)
            if error.retry_after is not None:
                delay = max(delay, min(error.retry_after, cfg["max_backoff_s"]))
            with lock:
                counters["retries"] += 1
            attempt += 1
            stop.wait(delay)
