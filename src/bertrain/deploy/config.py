"""`ServeConfig`: how `bertrain serve` listens, batches and protects itself (no web framework imported: `--help`
reads it), and `read_api_key` (where the API key comes from: never the command line, which `ps` shows)."""
from __future__ import annotations

import ipaddress
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from bertrain.utils.errors import UserError

API_KEY_ENV = "BERTRAIN_API_KEY"
"""The environment variable `bertrain serve` reads its API key from (or `--api-key-file FILE`)."""
MIN_API_KEY_CHARS = 16
NEW_KEY_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
# RFC 6750's b64token: what a bearer token may hold, so that every HTTP client can send it unchanged.
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=")


@dataclass
class ServeConfig:
    """How `bertrain serve` listens, batches and refuses work; every field but `api_key` and `api_key_source` is a
    flag of the same name."""

    host: str = "127.0.0.1"
    """Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface, which needs an API key)."""
    port: int = 8000
    """TCP port; 0 picks a free one (printed on start)."""
    max_batch_size: int = 32
    """Most items in one micro-batch of concurrent requests (also the forward batch size)."""
    max_wait_ms: float = 5.0
    """How long the first waiting request waits for others to join its micro-batch."""
    max_request_bytes: int = 1 << 20
    """Largest request body accepted; a larger one is answered 413."""
    max_queue: int = 256
    """Most items waiting for the model; a request that would go beyond is answered 503 with Retry-After at once,
    and a request of more items than this 413."""
    max_connections: int = 256
    """Most open connections (uvicorn's limit_concurrency): a request on any beyond gets 503."""
    header_timeout_s: float = 10.0
    """Time a connection has to send a complete request head (from connecting, or from the previous answer);
    then 408 and the connection is closed."""
    body_timeout_s: float = 30.0
    """Time a request has to send its whole body once its head has arrived; then 408 and the connection is
    closed."""
    allow_unauthenticated: bool = False
    """Serve on an address other than loopback without an API key (a network you trust)."""
    api_key: str | None = field(default=None, repr=False)
    """The bearer token every request but GET /health must carry; `read_api_key` gives it (never a flag)."""
    api_key_source: str = ""
    """Where the key came from, for the start line (the environment variable or the file)."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_batch_size < 1:
            problems.append(f"--max-batch-size {self.max_batch_size}: must be >= 1")
        if self.max_wait_ms < 0:
            problems.append(f"--max-wait-ms {self.max_wait_ms}: must be >= 0")
        if self.max_request_bytes < 64:
            problems.append(f"--max-request-bytes {self.max_request_bytes}: must be >= 64")
        if not 0 <= self.port <= 65535:
            problems.append(f"--port {self.port}: must be in 0..65535")
        if self.max_queue < self.max_batch_size:
            problems.append(f"--max-queue {self.max_queue}: must be >= --max-batch-size ({self.max_batch_size}), "
                            "so that a full batch can wait")
        if self.max_connections < 2:
            problems.append(f"--max-connections {self.max_connections}: must be >= 2")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"--{name.replace('_', '-')} {getattr(self, name)}: must be > 0")
        if problems:
            raise UserError("; ".join(problems))
        if self.api_key is not None:
            check_api_key(self.api_key, self.api_key_source or "the API key")
        elif not self.allow_unauthenticated and not is_loopback(self.host):
            raise UserError(
                f"--host {self.host} lets anyone who can reach this port use the model, and no API key is set: "
                f"put one in the environment variable {API_KEY_ENV} or in a file given by --api-key-file (clients "
                f"send 'Authorization: Bearer KEY'; make one with {NEW_KEY_HINT}), or, on a network you trust, "
                "pass --allow-unauthenticated")

    @property
    def drain_bytes(self) -> int:
        """How much of a refused body is read and dropped so that a client that sends its whole body before
        reading the answer (urllib, requests) gets the 413 instead of a connection reset: 16 MiB, or 4 times the
        limit if more. A larger declared body is answered at once and its connection closed."""
        return max(16 << 20, 4 * self.max_request_bytes)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) means this machine only: every address it resolves to is loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # bind() reports the bad name; here it only matters that it is not known to be loopback
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_api_key(key: str, source: str) -> None:
    if len(key) < MIN_API_KEY_CHARS:
        raise UserError(f"{source} holds a key of {len(key)} characters: use at least {MIN_API_KEY_CHARS} (make "
                        f"one with {NEW_KEY_HINT})")
    bad = sorted(set(key) - _TOKEN_CHARS)
    if bad:
        raise UserError(f"{source}: the key holds {''.join(bad)!r}, which a bearer token cannot carry: use letters, "
                        f"digits and -._~+/= (make one with {NEW_KEY_HINT})")


def read_api_key(key_file: str | os.PathLike | None, environ: dict[str, str] | None = None
                 ) -> tuple[str | None, str, str | None]:
    """The API key from `--api-key-file` or the environment variable `API_KEY_ENV` (one of them, not both), where
    it came from, and a warning when the file can be read by others. (None, "", None) when neither is set."""
    env = os.environ if environ is None else environ
    from_env = env.get(API_KEY_ENV)
    if key_file is not None and from_env is not None:
        raise UserError(f"an API key is given twice, in {API_KEY_ENV} and in --api-key-file {key_file}: keep one")
    if from_env is not None:
        key = from_env.strip()
        if not key:
            raise UserError(f"{API_KEY_ENV} is set but empty: set it to the key, or unset it")
        return key, f"the environment variable {API_KEY_ENV}", None
    if key_file is None:
        return None, "", None
    path = Path(key_file)
    try:
        key = path.read_text(encoding="utf-8").strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--api-key-file {key_file}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    if not key:
        raise UserError(f"--api-key-file {key_file} is empty: write the key in it (one line)")
    warning = None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warning = (f"--api-key-file {key_file} can be read by other users (mode {stat.filemode(mode)}): "
                   f"chmod 600 {key_file}")
    return key, f"--api-key-file {key_file}", warning
