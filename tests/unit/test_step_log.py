"""The connector's step log (kvstore/integrations/vllm/steplog.py): the writer's bound, the scheduler recorder's
prefill/decode split and step pairing, per-request records, the reader, and bad settings as typed errors.
The recorder is fed the fields of vLLM's SchedulerOutput it reads; real engines write it in
tests/integration/benchmarks/test_pd_http.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.steplog import (
    SchedulerSteps,
    StepLogError,
    StepLogWriter,
    WorkerTransfers,
    read_step_log,
    worker_path,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _output(new=(), cached=(), scheduled=None):
    """A step's plan: ``new`` = [(id, prompt_len, computed)], ``cached`` = [(id, computed)]."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=i, prompt_token_ids=[1] * n, num_computed_tokens=c)
                            for i, n, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[i for i, _ in cached],
                                              num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=scheduled or {})


def test_the_writer_stops_at_its_bound_and_says_so(tmp_path: Path) -> None:
    w = StepLogWriter(str(tmp_path / "s.jsonl"), max_records=4)
    for i in range(10):
        w.write({"t": "step", "start": i, "end": i + 0.5, "prefill": 1, "decode": 0, "reqs": 1, "kv_usage": None})
    w.close()
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1]) == {"t": "truncated"}
    assert w.written == 4 and w.dropped == 7
    log = read_step_log(str(tmp_path / "s.jsonl"))
    assert log.truncated and [s["start"] for s in log.steps] == [0, 1, 2]


def test_steps_split_prefill_from_decode_and_end_when_vllm_asks_for_stats(tmp_path: Path) -> None:
    path = str(tmp_path / "s.jsonl")
    rec = SchedulerSteps(StepLogWriter(path), clock=Clock())
    # step 1: a (prompt 100) runs 64 prompt tokens; b (prompt 10, 9 loaded) computes its last prompt token
    rec.on_schedule(_output(new=[("a", 100, 0), ("b", 10, 9)], scheduled={"a": 64, "b": 1}))  # t=101
    rec.on_step_end()  # t=102
    # step 2: a's last 36 prompt tokens and its first output token; b decodes one token and finishes
    rec.on_schedule(_output(cached=[("a", 64), ("b", 10)], scheduled={"a": 36, "b": 1}))  # t=103
    rec.on_finished("b", 10, None)
    rec.on_step_end()  # t=104
    # an empty step (waiting for a load) is not logged; a decode of a with its hand-off promise at finish
    rec.on_schedule(_output())  # t=105
    rec.on_step_end()  # t=106
    rec.on_schedule(_output(cached=[("a", 100)], scheduled={"a": 1}))  # t=107
    rec.on_finished("a", 100, {"kvstore": {"saved_blocks": 1}})
    rec.on_step_end()  # t=108
    log = read_step_log(path)
    assert [(s["start"], s["end"], s["prefill"], s["decode"], s["reqs"]) for s in log.steps] == [
        (101, 102, 65, 0, 2), (103, 104, 36, 1, 2), (107, 108, 0, 1, 1)]
    b, a = log.requests["b"], log.requests["a"]
    assert (b["first_start"], b["prefill_end"], b["end"], b["prompt"]) == (101, 102, 104, 10)
    assert (a["first_start"], a["prefill_end"], a["end"]) == (101, 104, 108)
    # a token comes out of every step that reached the prompt's end: b's two, a's (not its first chunk's)
    assert b["token_ends"] == [102, 104] and a["token_ends"] == [104, 108]
    assert a["kv_transfer_params"] == {"kvstore": {"saved_blocks": 1}} and b["kv_transfer_params"] is None


def test_a_request_aborted_between_steps_is_written_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "s.jsonl")
    rec = SchedulerSteps(StepLogWriter(path), clock=Clock())
    rec.on_finished("gone", 7, None)
    assert read_step_log(path).requests["gone"]["first_start"] is None


def test_steps_whose_end_never_comes_end_at_the_next_start(tmp_path: Path) -> None:
    path = str(tmp_path / "s.jsonl")
    rec = SchedulerSteps(StepLogWriter(path), clock=Clock())
    for _ in range(SchedulerSteps.MAX_OPEN + 2):
        rec.on_schedule(_output(new=[("x", 4, 0)], scheduled={"x": 1}))
    steps = read_step_log(path).steps
    assert len(steps) == 2 and [s["end"] for s in steps] == [s["start"] + 8 for s in steps]


def test_worker_transfers_are_read_back_summed_over_ranks(tmp_path: Path) -> None:
    path = str(tmp_path / "s.jsonl")
    rec = {"load_bytes": 0, "load_seconds": 0.0, "loaded_blocks": 0, "save_bytes": 4096, "save_seconds": 0.25,
           "saved_blocks": 2, "save_pending_bytes": 0}
    for rank in (0, 1):
        w = WorkerTransfers(StepLogWriter(worker_path(path, rank)), rank, 2048, clock=Clock())
        w.done("r1", rec)
        w.done("r2", None)  # moved nothing: no line
    log = read_step_log(path)  # the scheduler file does not exist: read as empty
    assert log.transfers["r1"]["save_bytes"] == 8192 and log.transfers["r1"]["saved_blocks"] == 4
    assert "r2" not in log.transfers and log.block_bytes == 2048 and log.opens == 2


def test_a_line_that_is_not_a_record_is_a_typed_error_but_a_cut_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text('{"t":"open","side":"scheduler","pid":1,"rank":null,"block_bytes":null}\nnot json\n')
    with pytest.raises(StepLogError, match=r"s\.jsonl:2"):
        read_step_log(str(path))
    path.write_text('{"t":"step","start":1,"end":2,"prefill":3,"decode":0,"reqs":1,"kv_usage":0.1}\n{"t":"st')
    assert len(read_step_log(str(path)).steps) == 1
    path.write_text('{"t":"step","start":1}\n')
    with pytest.raises(StepLogError, match="without"):
        read_step_log(str(path))
    path.write_text('{"t":"nonsense"}\n')
    with pytest.raises(StepLogError, match="unknown"):
        read_step_log(str(path))


@pytest.mark.parametrize(("extra", "match"), [({"step_log": 5}, "step_log"), ({"step_log": ""}, "step_log"),
                                              ({"step_log": "/x", "step_log_max_records": 1}, "max_records"),
                                              ({"step_log_max_records": True}, "max_records")])
def test_bad_step_log_settings_are_typed_errors(extra: dict, match: str) -> None:
    with pytest.raises(StepLogError, match=match):
        ConnectorConfig.from_extra({"url": "unix:///x.sock", **extra})


def test_an_unwritable_step_log_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(StepLogError, match="cannot open"):
        StepLogWriter(str(tmp_path / "no" / "such" / "dir.jsonl"))


def test_a_connector_that_moves_nothing_needs_no_url(monkeypatch) -> None:
    monkeypatch.delenv("KVSTORE_URL", raising=False)
    cfg = ConnectorConfig.from_extra({"transfers": False, "step_log": "/tmp/x.jsonl"})
    assert cfg.transfers is False and cfg.url == "" and cfg.step_log == "/tmp/x.jsonl"
    with pytest.raises(ValueError, match="url"):
        ConnectorConfig.from_extra({"step_log": "/tmp/x.jsonl"})
