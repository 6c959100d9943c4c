"""Values keep their dtype and shape through the store, or are refused with a typed error; metadata a
producer wrote is checked before a consumer rebuilds a value from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from kvstore.core.meta import ObjectMeta
from kvstore.core.value import KVObject


@pytest.fixture
def store():
    s = kvstore.KVStore.embedded(capacity="8MiB")
    yield s
    s.close()


@pytest.mark.parametrize("value", [np.array(3.5), np.array(7, dtype=np.int16), np.array([[1, 2], [3, 4]])[:, 0],
                                   np.zeros((0, 3), np.float32), np.array(["ab", "c"]), torch.tensor(2.0)],
                         ids=["0d-float", "0d-int16", "strided", "empty-2d", "unicode", "0d-tensor"])
def test_shapes_and_dtypes_round_trip(store, value):
    store.put("v", value)
    got = store.get("v")
    if isinstance(value, torch.Tensor):
        assert got.tensor().shape == value.shape and torch.equal(got.tensor(), value)
    else:
        out = got.numpy()
        assert out.shape == value.shape and out.dtype == value.dtype
        np.testing.assert_array_equal(out, value)


@pytest.mark.parametrize("value", [np.zeros(3, dtype=[("x", "<i4"), ("y", "<f8")]), np.array([object()]),
                                   np.zeros(2, dtype=np.dtype((np.int32, (2,))).base).astype([("a", "<i4", (2,))])],
                         ids=["structured", "object", "subarray-field"])
def test_values_that_cannot_round_trip_are_refused(store, value):
    with pytest.raises(kvstore.InvalidArgumentError):
        store.put("v", value)
    assert not store.exists("v")


def wire(**fields):
    return {**ObjectMeta(key="k", size=12, kind="numpy", dtype="<f4", shape=(3,)).to_wire(), **fields}


@pytest.mark.parametrize("fields", [{"dtype": "|O"}, {"dtype": "O"}, {"dtype": "i4,f8"}, {"dtype": "not-a-dtype"},
                                    {"shape": [4]}, {"shape": [2, 2]}, {"shape": [1 << 40, 1 << 40]},
                                    {"dtype": None}, {"shape": None}, {"kind": "torch", "dtype": "cuda_thing"},
                                    {"kind": "torch", "dtype": "float32", "shape": [5]}],
                         ids=["object", "object-short", "structured", "garbage", "too-few", "too-many", "huge",
                              "no-dtype", "no-shape", "torch-unknown", "torch-size"])
def test_hostile_meta_is_a_typed_error(fields):
    with pytest.raises(kvstore.InvalidArgumentError):
        ObjectMeta.from_wire(wire(**fields))


def test_consistent_meta_rebuilds_the_value():
    meta = ObjectMeta.from_wire(wire())
    obj = KVObject.wrap(np.arange(3, dtype="<f4").tobytes(), meta)
    np.testing.assert_array_equal(obj.numpy(), np.arange(3, dtype="<f4"))
