"""kvstore.ops.prepare_gather_pages / prepare_scatter_pages: validated once, then the same copy as the op."""

from __future__ import annotations

import pytest
import torch
from test_ops import KINDS, make_caches, make_layout

from kvstore import ops

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_prepared_gather_and_scatter_copy_what_the_ops_copy(kind):
    gen = torch.Generator().manual_seed(1)
    layout = make_layout(kind)
    caches = make_caches(layout, 8, gen)
    ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    want = ops.gather_pages(caches, ids, torch.empty(ops.packed_shape(layout, 3), dtype=layout.dtype),
                            layout=layout)
    out = torch.zeros(ops.packed_shape(layout, 3), dtype=layout.dtype)
    gather = ops.prepare_gather_pages(caches, ids, out, layout=layout)
    assert gather() is None and torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    fresh = make_caches(layout, 8, gen, fill=0)
    ops.prepare_scatter_pages(out, ids, fresh, layout=layout)()
    back = ops.gather_pages(fresh, ids, torch.empty_like(out), layout=layout)
    assert torch.equal(back.view(torch.uint8), want.view(torch.uint8))


def test_prepared_call_keeps_the_ids_it_was_checked_with():
    gen = torch.Generator().manual_seed(2)
    layout = make_layout(KINDS[0])
    caches = make_caches(layout, 4, gen)
    ids = torch.tensor([1, 2], dtype=torch.int64)
    out = torch.empty(ops.packed_shape(layout, 2), dtype=layout.dtype)
    gather = ops.prepare_gather_pages(caches, ids, out, layout=layout)
    ids[0] = 99  # out of range now; the prepared call copies blocks 1 and 2 regardless
    gather()
    want = ops.gather_pages(caches, torch.tensor([1, 2]), torch.empty_like(out), layout=layout)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_bad_arguments_raise_at_preparation_with_the_ops_messages():
    gen = torch.Generator().manual_seed(3)
    layout = make_layout(KINDS[0])
    caches = make_caches(layout, 4, gen)
    out = torch.empty(ops.packed_shape(layout, 2), dtype=layout.dtype)
    with pytest.raises(ValueError, match="distinct ids"):  # CPU: the extension checks ids on every call
        ops.prepare_scatter_pages(out, torch.tensor([1, 1]), caches, layout=layout)()
    with pytest.raises(ValueError, match="expected packed shape"):
        ops.prepare_gather_pages(caches, torch.tensor([1, 2, 3]), out, layout=layout)
    with pytest.raises(TypeError, match="layout must be a kvstore.KVLayout"):
        ops.prepare_gather_pages(caches, torch.tensor([1, 2]), out, layout="nhd")
    with pytest.raises(ValueError, match="overlaps kv_caches"):
        inside = caches[0].view(-1)[: out[:1].numel()].view(out[:1].shape)  # one block's worth, in layer 0
        ops.prepare_gather_pages(caches, torch.tensor([0]), inside, layout=layout)
