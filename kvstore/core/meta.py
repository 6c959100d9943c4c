"""Object metadata and its wire schema, plus key validation.

``ObjectMeta`` travels with every object: size, how to rebuild the value (kind, dtype, shape), the xxh3
checksum recorded at commit, producer, creation time, TTL and the caller's own small metadata dict.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgumentError, InvalidKeyError

SCHEMA_VERSION = 1
MAX_KEY_BYTES = 1024
MAX_USER_META_ITEMS = 64
MAX_USER_META_STR = 16 << 10  # bytes of one str or bytes value (the daemon's decoder allows no more)
VALUE_KINDS = ("bytes", "numpy", "torch")
#: torch dtypes a value may have, by name, with their item sizes (no torch import in the core)
TORCH_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8,
                  "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4,
                  "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
                  "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1}


def validate_key(key: object) -> str:
    """Return ``key`` as str; raise InvalidKeyError for empty, non-UTF-8 or over-1-KiB keys."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidKeyError(f"key is not valid UTF-8: {raw[:64]!r}") from None
    if not isinstance(key, str):
        raise InvalidKeyError(f"key must be str or UTF-8 bytes, got {type(key).__name__}")
    if not key:
        raise InvalidKeyError("key is empty")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKeyError(f"key is not valid UTF-8 (lone surrogate in {key[:64]!r})") from None
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"key is {len(encoded)} bytes, the maximum is {MAX_KEY_BYTES}")
    return key


def numpy_dtype(text: str) -> np.dtype:
    """The plain numpy dtype ``text`` names; InvalidArgumentError for one that cannot travel as bytes
    (Python objects: their bytes are pointers) or that ``dtype.str`` cannot describe faithfully (structured
    dtypes lose their field names, subarray dtypes their shape)."""
    try:
        dtype = np.dtype(text)
    except Exception:  # numpy raises TypeError, ValueError, SyntaxError... for odd strings
        raise InvalidArgumentError(f"field 'dtype' {text!r:.80} is not a numpy dtype") from None
    return check_plain_dtype(dtype)


def check_plain_dtype(dtype: np.dtype) -> np.dtype:
    if dtype.hasobject:
        raise InvalidArgumentError(f"numpy dtype {dtype} holds Python objects, which cannot be stored")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise InvalidArgumentError(f"structured numpy dtype {dtype} is not supported (field names would be "
                                   "lost): store each field as its own array, or put arr.view(np.uint8)")
    return dtype


@functools.lru_cache(maxsize=256)  # a store sees a handful of dtypes; parsing one costs microseconds
def _itemsize(kind: str, dtype: str) -> int:
    if kind == "numpy":
        return numpy_dtype(dtype).itemsize
    if dtype in TORCH_ITEMSIZE:
        return TORCH_ITEMSIZE[dtype]
    raise InvalidArgumentError(f"field 'dtype' {dtype!r:.80} is not a torch dtype this store knows")


def _check_value(kind: str, dtype: str | None, shape: tuple[int, ...] | None, size: int) -> None:
    """The dtype and shape rebuild exactly ``size`` bytes (a producer's metadata is not trusted)."""
    if kind == "bytes":
        return
    if dtype is None or shape is None:
        raise InvalidArgumentError(f"a {kind} value needs a dtype and a shape, got {dtype!r} and {shape!r}")
    itemsize = _itemsize(kind, dtype)
    if itemsize * math.prod(shape) != size:
        raise InvalidArgumentError(f"shape {shape} of {dtype} is {itemsize * math.prod(shape)} bytes, but the "
                                   f"object has {size}")


def validate_ttl(ttl: object) -> float | None:
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0 or ttl != ttl:
        raise InvalidArgumentError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
    return float(ttl)


def validate_user_meta(meta: object) -> dict[str, Any]:
    """The caller's metadata: a small dict of str keys to msgpack-safe scalars, lists or dicts."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidArgumentError(f"meta must be a dict or None, got {type(meta).__name__}")
    if len(meta) > MAX_USER_META_ITEMS:
        raise InvalidArgumentError(f"meta has {len(meta)} items, the maximum is {MAX_USER_META_ITEMS}")
    for k, v in meta.items():
        if not isinstance(k, str):
            raise InvalidArgumentError(f"meta keys must be str, got {k!r}")
        _check_plain(v, f"meta[{k!r}]")
    return dict(meta)


def _check_plain(value: object, where: str, depth: int = 0) -> None:
    if depth > 8:
        raise InvalidArgumentError(f"{where} is nested too deeply")
    if isinstance(value, (str, bytes)):
        n = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else len(value)
        if n > MAX_USER_META_STR:
            raise InvalidArgumentError(f"{where} is {n} bytes, the maximum is {MAX_USER_META_STR}")
        return
    if value is None or isinstance(value, (bool, int, float)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise InvalidArgumentError(f"{where} has a non-str key {k!r}")
            _check_plain(item, f"{where}[{k!r}]", depth + 1)
        return
    raise InvalidArgumentError(f"{where} has a {type(value).__name__}, which is not msgpack-safe")


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What is known about one committed object. ``version`` grows with every commit of any key."""

    key: str
    size: int
    kind: str = "bytes"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    checksum: int | None = None
    producer: str = ""
    created: float = field(default_factory=time.time)
    ttl: float | None = None
    version: int = 0
    compression: str = "none"
    user: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    def with_commit(self, checksum: int | None, version: int, created: float | None = None) -> ObjectMeta:
        """This meta as committed (``dataclasses.replace`` is several times slower on this hot path)."""
        return ObjectMeta(self.key, self.size, self.kind, self.dtype, self.shape, checksum, self.producer,
                          time.time() if created is None else created, self.ttl, version, self.compression,
                          self.user, self.schema)

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key, "size": self.size, "kind": self.kind, "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None, "checksum": self.checksum,
            "producer": self.producer, "created": self.created, "ttl": self.ttl, "version": self.version,
            "compression": self.compression, "user": self.user, "schema": self.schema,
        }

    @classmethod
    def from_wire(cls, d: object) -> ObjectMeta:
        """Validate and rebuild; raise InvalidArgumentError naming the bad field."""
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"object meta must be a map, got {type(d).__name__}")
        try:
            meta = cls(
                key=validate_key(d["key"]),
                size=_int(d, "size"),
                kind=_choice(d.get("kind", "bytes"), VALUE_KINDS, "kind"),
                dtype=_opt_str(d.get("dtype"), "dtype"),
                shape=_shape(d.get("shape")),
                checksum=_opt_int(d.get("checksum"), "checksum"),
                producer=str(d.get("producer", "")),
                created=float(d.get("created", time.time())),
                ttl=validate_ttl(d.get("ttl")),
                version=_int(d, "version", default=0),
                compression=str(d.get("compression", "none")),
                user=validate_user_meta(d.get("user")),
                schema=_int(d, "schema", default=SCHEMA_VERSION),
            )
            if meta.compression == "none":
                _check_value(meta.kind, meta.dtype, meta.shape, meta.size)
        except KeyError as exc:
            raise InvalidArgumentError(f"object meta lacks field {exc.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, InvalidArgumentError):
                raise
            raise InvalidArgumentError(f"bad object meta: {exc}") from None
        return meta


def _int(d: dict[str, Any], name: str, default: int | None = None) -> int:
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"field {name!r} must be a non-negative int, got {value!r}")
    return value


def _opt_int(value: object, name: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidArgumentError(f"field {name!r} must be an int or None, got {value!r}")
    return value


def _opt_str(value: object, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentError(f"field {name!r} must be a str or None, got {value!r}")
    return value


def _choice(value: object, allowed: tuple[str, ...], name: str) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidArgumentError(f"field {name!r} must be one of {allowed}, got {value!r}")
    return value


def _shape(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        raise InvalidArgumentError(f"field 'shape' must be a list of non-negative ints, got {value!r}")
    return tuple(value)


REQUEST_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """What a prefill worker publishes with a request's KV: enough for the decode side to check, before it
    writes a byte into its cache, that the bytes are the ones it expects."""

    request_id: str
    layout: dict[str, Any]  # KVLayout.to_dict()
    fingerprint: str
    num_tokens: int
    num_blocks: int
    chunk_keys: tuple[str, ...]
    chunk_blocks: tuple[int, ...]
    checksums: tuple[int, ...]
    producer: str
    created: float
    ttl: float
    token_hash: str = ""
    nbytes: int = 0
    schema: int = REQUEST_SCHEMA_VERSION

    def to_wire(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "layout": self.layout, "fingerprint": self.fingerprint,
                "num_tokens": self.num_tokens, "num_blocks": self.num_blocks, "chunk_keys": list(self.chunk_keys),
                "chunk_blocks": list(self.chunk_blocks), "checksums": list(self.checksums),
                "producer": self.producer, "created": self.created, "ttl": self.ttl,
                "token_hash": self.token_hash, "nbytes": self.nbytes, "schema": self.schema}

    @classmethod
    def from_wire(cls, d: object) -> RequestMeta:
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"request meta must be a map, got {type(d).__name__}")
        if d.get("schema") != REQUEST_SCHEMA_VERSION:
            raise InvalidArgumentError(f"request meta schema {d.get('schema')!r} is not supported "
                                       f"(this side reads {REQUEST_SCHEMA_VERSION})")
        try:
            meta = cls(request_id=str(d["request_id"]), layout=dict(d["layout"]), fingerprint=str(d["fingerprint"]),
                       num_tokens=int(d["num_tokens"]), num_blocks=int(d["num_blocks"]),
                       chunk_keys=tuple(map(str, d["chunk_keys"])), chunk_blocks=tuple(map(int, d["chunk_blocks"])),
                       checksums=tuple(map(int, d["checksums"])), producer=str(d["producer"]),
                       created=float(d["created"]), ttl=float(d["ttl"]), token_hash=str(d.get("token_hash", "")),
                       nbytes=int(d.get("nbytes", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"bad request meta: {type(exc).__name__}: {exc}") from None
        if not (len(meta.chunk_keys) == len(meta.chunk_blocks) == len(meta.checksums)) \
                or sum(meta.chunk_blocks) != meta.num_blocks:
            raise InvalidArgumentError("request meta chunk lists disagree with each other or with num_blocks")
        return meta
