"""Reaching the Hugging Face hub: probe once, fail fast with one sentence when offline."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse


@functools.cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """True if the hub's host accepts a TCP connection (False at once when HF_HUB_OFFLINE is set)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False
