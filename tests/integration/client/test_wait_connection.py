"""The connection ``wait()`` opens for itself is kept alive between waits, like the client's own."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_wait_works_after_idling_past_the_daemons_heartbeat_timeout(daemon_factory, transport):
    d = daemon_factory(args=("--heartbeat-timeout", "1.5"))
    with d.connect(transport) as store:
        assert store.wait(["idle/missing"], 0.05) is None  # opens the wait connection
        time.sleep(4)  # over twice the heartbeat timeout with no wait on that connection
        store.put("idle/there", b"x")
        assert store.wait(["idle/there"], 5) == "idle/there"
