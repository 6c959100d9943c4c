"""A ucx client run as a separate process by the UCX fault tests; it reports progress on stdout.

Usage: ucx_child.py MODE URL KEY SIZE      (KVSTORE_UCX_CONNECT in the environment picks address/listener)

  stall   put SIZE bytes over ucx through the real client path, stopped mid-transfer: the daemon has the
          put's region and the message is on its way (rendezvous started), but the client stops progressing
          its worker, prints READY and hangs (the test SIGKILLs it)
  loop    put SIZE bytes under KEY over and over, printing PUT n after each (the test kills it at random)
  put     put SIZE bytes of the key-derived pattern over ucx, print DONE, exit
"""

from __future__ import annotations

import sys

from client_child import hang, pattern  # this directory is on sys.path: the script's own

import kvstore
from kvstore.transports.ucx import UcxTransport


def stall(url: str, key: str, size: int) -> None:
    wait = UcxTransport._wait

    def stalled(self, request, what):
        if what.startswith("send"):
            # The send is posted (its rendezvous request is on its way) but never progressed again: the
            # daemon holds the put's region and waits for bytes that will not come.
            print("READY", "completed" if request.completed else "in-flight", flush=True)
            hang()
        return wait(self, request, what)

    UcxTransport._wait = stalled
    store = kvstore.connect(url, transport="ucx")
    store.put(key, pattern(key, size))


def loop(url: str, key: str, size: int) -> None:
    """Replace ``key`` over and over, printing PUT n after each commit (the test kills it at random)."""
    value = pattern(key, size)
    with kvstore.connect(url, transport="ucx") as store:
        for n in range(1_000_000):
            store.put(key, value)
            print("PUT", n, flush=True)


def main() -> None:
    mode, url, key, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if mode == "stall":
        stall(url, key, size)
    elif mode == "loop":
        loop(url, key, size)
    elif mode == "put":
        with kvstore.connect(url, transport="ucx") as store:
            store.put(key, pattern(key, size))
        print("DONE", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
