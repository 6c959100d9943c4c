"""``ls`` pages: every key once, in order, each page within the frame, whatever the names' sizes."""

from __future__ import annotations

import pytest

from kvstore.protocol import wire


def _pages(keys: list[str], limit: int = 100000) -> list[list[str]]:
    pages, after = [], ""
    while True:
        page, more = wire.page_of_keys(keys, after, limit)
        pages.append(page)
        if not more or not page:
            return pages
        after = page[-1]


@pytest.mark.parametrize("name_chars", [1, 68, 4096])
@pytest.mark.parametrize("char", ["a", "\u20ac", "\U0001f600"])
def test_pages_cover_every_key_once_and_fit_a_frame(name_chars, char):
    keys = sorted(f"{i:06d}" + char * name_chars for i in range(max(3, 3 * wire.LS_PAGE_BYTES // (4 * name_chars))))
    pages = _pages(keys)
    assert [k for page in pages for k in page] == keys
    for page in pages:
        reply = {"v": wire.VERSION, "id": 1, "ok": True, "value": page, "total": len(keys), "more": True}
        assert len(wire.encode(reply)) <= wire.MAX_FRAME


def test_limit_and_after():
    keys = [f"k{i:03d}" for i in range(10)]
    assert wire.page_of_keys(keys, "", 3) == (keys[:3], False)  # "more" is within the limit asked for
    assert wire.page_of_keys(keys, "k004", 100) == (keys[5:], False)
    assert wire.page_of_keys(keys, "k009", 100) == ([], False)
    assert wire.page_of_keys(keys, "k0035", 2) == (keys[4:6], False)
