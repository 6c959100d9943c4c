"""Data paths of kvstore: one module per transport behind the small interface in ``transports.base``.

This package never imports ``kvstore``; it raises its own :class:`transports.base.TransportFailure` family.
"""

from transports.base import Channel, Transport, TransportFailure, TransportUnavailable, get, names, register

__all__ = ["Channel", "Transport", "TransportFailure", "TransportUnavailable", "get", "names", "register"]
