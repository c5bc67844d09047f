"""`ServeConfig`: how `bertrain serve` listens and batches (no web framework imported: `--help` reads it)."""
from __future__ import annotations

from dataclasses import dataclass

from bertrain.utils.errors import UserError


@dataclass
class ServeConfig:
    """How `bertrain serve` listens and batches; every field is a flag of the same name."""

    host: str = "127.0.0.1"
    """Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)."""
    port: int = 8000
    """TCP port; 0 picks a free one (printed on start)."""
    max_batch_size: int = 32
    """Most items in one micro-batch of concurrent requests (also the forward batch size)."""
    max_wait_ms: float = 5.0
    """How long the first waiting request waits for others to join its micro-batch."""
    max_request_bytes: int = 1 << 20
    """Largest request body accepted; a larger one is answered 413."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise UserError(f"--max-batch-size {self.max_batch_size}: must be >= 1")
        if self.max_wait_ms < 0:
            raise UserError(f"--max-wait-ms {self.max_wait_ms}: must be >= 0")
        if self.max_request_bytes < 64:
            raise UserError(f"--max-request-bytes {self.max_request_bytes}: must be >= 64")
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port}: must be in 0..65535")
