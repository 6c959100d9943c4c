"""The embedded store's disk policy: given by name or as a DiskPolicy, it is the tier's policy; anything else is
refused before a tier opens."""

from __future__ import annotations

import pytest

from kvstore.client.store import KVStore
from kvstore.memory.disk import DiskConfig, DiskPolicy


@pytest.mark.parametrize("given", ["demote", "write-through", DiskPolicy.DEMOTE, DiskPolicy.WRITE_THROUGH])
def test_a_policy_by_name_or_member_parses_to_the_member(given):
    assert DiskPolicy.parse(given) is DiskPolicy(given)


@pytest.mark.parametrize("bad", ["bogus", "WRITE_THROUGH", "", None, 1])
def test_an_unknown_policy_is_refused_naming_the_choices(bad, tmp_path):
    with pytest.raises(ValueError, match=r"disk policy must be one of \['demote', 'write-through'\]"):
        DiskPolicy.parse(bad)
    with pytest.raises(ValueError, match="disk policy must be one of"):
        DiskConfig(str(tmp_path), 1 << 20, bad)
    with pytest.raises(ValueError, match="disk policy must be one of"):
        KVStore.embedded("2MiB", disk_path=str(tmp_path), disk_capacity="64MiB", disk_policy=bad)
    assert list(tmp_path.iterdir()) == []  # refused before the tier took the directory


@pytest.mark.parametrize("policy", ["write-through", DiskPolicy.WRITE_THROUGH])
def test_write_through_by_name_or_member_writes_at_commit(policy, tmp_path):
    with KVStore.embedded("2MiB", disk_path=str(tmp_path), disk_capacity="64MiB", disk_policy=policy) as store:
        store.put("k", b"x" * 1000)
        assert store.stats()["disk_policy"] == "write-through"
    with KVStore.embedded("2MiB", disk_path=str(tmp_path), disk_capacity="64MiB") as again:
        assert bytes(again.get("k")) == b"x" * 1000  # it was on disk before the first store closed


def test_demote_keeps_an_unevicted_object_in_memory_only(tmp_path):
    with KVStore.embedded("2MiB", disk_path=str(tmp_path), disk_capacity="64MiB", disk_policy="demote") as store:
        store.put("k", b"x" * 1000)
        assert store.stats()["disk_policy"] == "demote"
    with KVStore.embedded("2MiB", disk_path=str(tmp_path), disk_capacity="64MiB") as again:
        assert not again.exists("k")
