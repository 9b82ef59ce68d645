"""`param_sync.master_address`: the address engines use to reach trainer rank 0 for the weight-update group of the
distributed transport (runtime/sync/distributed.py). Checked when the config loads; resolved by the trainer
actor once it knows where rank 0 runs (Ray's node IPs).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = ["LOOPBACK", "check_master_address", "is_loopback", "resolve_master_address"]

LOOPBACK = "127.0.0.1"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")


def check_master_address(value: str) -> str:
    """`param_sync.master_address` is `auto`, an IP address or a host name; ValueError (one line) otherwise."""
    text = str(value).strip()
    if text == "auto":
        return text
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(text)
        return text
    if len(text) <= 253 and _HOSTNAME.match(text) and not text.replace(".", "").isdigit():
        return text
    raise ValueError(
        f"'param_sync.master_address' must be auto, an IP address or a host name the engines can reach; got {value!r}"
    )


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_master_address(setting: str, rank0_node: str, engine_urls: Iterable[str], local_node: str) -> str:
    """The address engines use to reach trainer rank 0 (`param_sync.master_address`).

    An explicit address is used as given. `auto`: 127.0.0.1 when every engine runs on rank 0's node, else rank 0's
    node IP (Ray's). `rank0_node` is that IP, `local_node` the IP of the node this process runs on, which reaches the
    engines at `engine_urls`: an engine whose URL names a loopback host runs on `local_node`.
    """
    setting = check_master_address(setting)
    if setting != "auto":
        return setting
    hosts = [urlsplit(url).hostname or "" for url in engine_urls]
    nodes = {local_node if is_loopback(h) else h for h in hosts}
    return LOOPBACK if nodes <= {rank0_node} else rank0_node
