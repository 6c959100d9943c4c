"""The address a UCX listener was asked to listen on. ucxx's listener takes a port only and listens on every
interface, so the daemon's UCX endpoint checks, for each connection, the local address it arrived on
(``ucp_ep_query``) against the addresses of ``--listen ucx://HOST:PORT``."""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import sys
from typing import Any

from kvstore.transports.base import TransportFailure


def bind_addresses(host: str) -> set | None:
    """The addresses ``host`` names (None for a wildcard: every interface)."""
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return None
    except ValueError:
        pass  # a name
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TransportFailure(f"cannot resolve UCX listen host {host!r}: {exc}") from None
    return {ipaddress.ip_address(info[4][0]) for info in infos}


_EP_ATTR_LOCAL_SOCKADDR = 1 << 1  # UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR
_EP_ATTR_LOCAL_OFFSET = 8 + 32  # ucp_ep_attr_t: uint64_t field_mask, char name[UCP_ENTITY_NAME_MAX]


def local_address(endpoint: Any) -> str | None:
    """The local IP address a listener endpoint was reached on (``ucp_ep_query``), or None if unknown."""
    try:
        ucp = ctypes.CDLL("libucp.so.0")  # the copy ucxx already loaded
        attr = (ctypes.c_uint8 * 1024)()  # ucp_ep_attr_t is under 400 bytes; UCX fills only what is asked
        ctypes.c_uint64.from_buffer(attr).value = _EP_ATTR_LOCAL_SOCKADDR
        if ucp.ucp_ep_query(ctypes.c_void_p(endpoint.handle), attr) != 0:
            return None
    except (OSError, AttributeError, TypeError):
        return None
    raw = bytes(attr[_EP_ATTR_LOCAL_OFFSET:_EP_ATTR_LOCAL_OFFSET + 128])
    family = int.from_bytes(raw[:2], sys.byteorder)
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return None
