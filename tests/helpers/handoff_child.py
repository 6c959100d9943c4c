"""Child process for hand-off tests: publish a request, or look a prefix up, through a daemon.

    python handoff_child.py publish URL REQUEST_ID NUM_BLOCKS   (prints "publishing" before it starts, "claimed" once
    the pages are gathered into the store,
                                                                 then "published"; fills caches from seed 0)
    python handoff_child.py lookup URL TOKENS_CSV               (prints the number of cached tokens)
"""

import sys

import torch

import kvstore
from kvstore.handoff import KVHandoff

LAYOUT = dict(kind="vllm_flash_nhd", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
              dtype="float32", model_id="handoff-test")


def layout():
    return kvstore.KVLayout(**LAYOUT)


def caches(num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = layout()
    return [torch.randn(lay.cache_shape(num_blocks), generator=g) for _ in range(lay.num_layers)]


def main():
    cmd, url = sys.argv[1], sys.argv[2]
    store = kvstore.connect(url, transport="shm")
    h = KVHandoff(store, layout(), chunk_blocks=1)
    if cmd == "publish":
        rid, n = sys.argv[3], int(sys.argv[4])
        src = caches(n)
        print("publishing", flush=True)
        ticket = h.publish(rid, src, list(range(n)), num_tokens=n * 16, ttl=60)
        print("claimed", flush=True)
        ticket.wait()
        print("published", flush=True)
    elif cmd == "lookup":
        tokens = [int(t) for t in sys.argv[3].split(",")]
        print(h.lookup(tokens), flush=True)
    store.close()


if __name__ == "__main__":
    main()
