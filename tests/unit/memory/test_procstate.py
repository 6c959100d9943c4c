"""ProcessGate on real processes: a same-host reader's view of whether a daemon runs."""

import os
import signal
import subprocess
import sys
import time

from kvstore.memory import procstate


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def status_text(state="S (sleeping)", sigpnd="0000000000000000", shdpnd="0000000000000000"):
    return (f"Name:\tx\nUmask:\t0022\nState:\t{state}\nTgid:\t1\nSigQ:\t0/1\nSigPnd:\t{sigpnd}\n"
            f"ShdPnd:\t{shdpnd}\nSigBlk:\t0000000000000000\n").encode()


def test_running_reads_the_state_and_a_pending_sigcont():
    assert procstate.running(status_text())
    assert procstate.running(status_text("R (running)"))
    for state in ("T (stopped)", "t (tracing stop)", "Z (zombie)", "X (dead)"):
        assert not procstate.running(status_text(state)), state
    cont = f"{1 << (signal.SIGCONT - 1):016x}"
    assert not procstate.running(status_text(shdpnd=cont))  # continued, its handler not run yet
    assert not procstate.running(status_text(sigpnd=cont))
    assert procstate.running(status_text(shdpnd=f"{1 << (signal.SIGTERM - 1):016x}"))
    assert not procstate.running(b"Name:\tx\n")  # unreadable: not trusted
    with open("/proc/self/status", "rb") as f:
        assert procstate.running(f.read())


def test_gate_follows_a_real_process_through_stop_continue_and_exit():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gate = procstate.ProcessGate.open({"pid": child.pid, "pid_ns": list(procstate.pid_namespace()),
                                           "start": procstate.start_time(child.pid)})
        assert gate is not None and gate()
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: not gate())
        os.kill(child.pid, signal.SIGCONT)
        wait_for(gate)
        child.kill()
        child.wait()
        assert not gate()  # exited: the descriptor reads ESRCH, whatever process gets the pid next
        gate.close()
        assert not gate()
    finally:
        child.kill()
        child.wait()


def test_gate_is_not_opened_for_another_namespace_or_another_process():
    me = {"pid": os.getpid(), "pid_ns": list(procstate.pid_namespace()), "start": procstate.start_time()}
    gate = procstate.ProcessGate.open(me)
    assert gate is not None and gate()
    gate.close()
    assert procstate.ProcessGate.open({**me, "pid_ns": [0, 1]}) is None  # another pid namespace: pids differ
    assert procstate.ProcessGate.open({**me, "start": me["start"] + 1}) is None  # the pid is someone else now
    assert procstate.ProcessGate.open({"pid": "x"}) is None
