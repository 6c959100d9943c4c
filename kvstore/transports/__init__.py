"""Data paths of kvstore: one module per transport behind the small interface in ``kvstore.transports.base``.

This package never imports ``kvstore``; it raises its own :class:`kvstore.transports.base.TransportFailure` family.
"""

from kvstore.transports.base import Channel, Transport, TransportFailure, TransportUnavailable, get, names, register

__all__ = ["Channel", "Transport", "TransportFailure", "TransportUnavailable", "get", "names", "register"]
