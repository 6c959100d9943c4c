"""Hosts as network namespaces: two or three "machines" on one box, joined by shaped links.

    with Hosts(("a", "b"), rate_gbit=10) as hosts:
        a, b = hosts["a"], hosts["b"]
        link = hosts.link("a", "b")                 # a veth pair, both ends shaped with tc tbf
        daemon = a.popen([sys.executable, "-m", "kvstore.cli", "serve", "--listen",
                          f"tcp://{link.address(a)}:7070", ...])
        print(measure_link(link))                   # the raw socket across it, measured

Each host is a network namespace (``ip netns``) plus, for the processes started in it, a mount and a UTS
namespace of its own: a private ``/dev/shm`` and ``/tmp`` (tmpfs) and its own hostname. So nothing but the link
joins two hosts: a client on one cannot map the other's segments, ``kvstore.protocol.url.host_id`` differs, and
``transport="auto"`` picks tcp, as between real machines. A long-lived keeper process holds each host's
namespaces; processes enter them with ``nsenter``. Links live in a private subnet (``10.213.N.0/24``, one /24
per link) that exists only inside the namespaces created here: nothing is routed off the machine.

Everything created is removed by :meth:`Hosts.close` (also when setting up fails half-way): the processes
started in the hosts, the keepers (and with them the mount namespaces), the network namespaces and, with them,
their veth ends. Needs root, ``ip``, ``tc`` (the ``tbf`` qdisc), ``nsenter`` and ``unshare``;
:func:`unavailable_reason` says why not where they are missing, so tests can skip with that reason.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the rates the tests and benchmarks shape links to, in Gbit/s
RATES_GBIT = (1, 10, 25)
_PREFIX = "kvsh"  # namespace names: kvsh-<owner pid>-<host>; an owner that died leaves stale ones
_SUBNET = "10.213"
_TOOLS = ("ip", "tc", "nsenter", "unshare")


def _sh(*argv: str, timeout: float = 20.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise HostSetupError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


class HostSetupError(RuntimeError):
    """A namespace, link or shaping step failed; whatever had been created was removed."""


@functools.cache
def unavailable_reason() -> str | None:
    """Why hosts cannot be made here (None when they can): tried for real once per process, with a throwaway
    namespace, a shaped veth pair and a private mount + UTS namespace, then removed."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the host tests as root, or in a privileged container)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (iproute2, util-linux)"
    try:
        with Hosts(("prb1", "prb2"), rate_gbit=1):  # under this process id: concurrent probes never collide
            pass
    except (HostSetupError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot create shaped network namespaces here: {exc}"
    return None


@dataclass(eq=False)
class Host:
    """One host: its network namespace and a keeper process that holds its mount and UTS namespaces."""

    name: str
    netns: str
    keeper: subprocess.Popen[Any] | None = None
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def enter(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` wrapped so that it runs in this host's namespaces (cwd: the caller's unless given)."""
        if self.keeper is None:
            raise HostSetupError(f"host {self.name} is not running")
        return ["nsenter", "-t", str(self.keeper.pid), "-n", "-m", "-u", f"--wd={cwd or os.getcwd()}", "--",
                *map(str, argv)]

    def popen(self, argv: Sequence[str], cwd: str | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in this host (``subprocess.Popen`` keywords pass through); it is killed at close."""
        proc = subprocess.Popen(self.enter(argv, cwd), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 60.0, check: bool = True,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in this host to completion (stdout and stderr captured as text)."""
        done = subprocess.run(self.enter(argv), capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
        return done

    def path(self, inside: str) -> str:
        """The path, seen from outside, of ``inside`` in this host's mount namespace (e.g. a file in its private
        /tmp): through the keeper's root directory."""
        if self.keeper is None:
            raise HostSetupError(f"host {self.name} is not running")
        return f"/proc/{self.keeper.pid}/root{os.path.abspath(inside)}"

    def listening(self, port: int) -> bool:
        """Whether a TCP socket listens on ``port`` in this host (asked of the kernel: no connection made)."""
        out = _sh("ip", "netns", "exec", self.netns, "ss", "-Hltn", f"sport = :{port}", check=False)
        return out.returncode == 0 and bool(out.stdout.strip())

    def wait_listening(self, port: int, timeout: float, proc: subprocess.Popen[Any] | None = None) -> bool:
        """Wait (bounded) until ``port`` listens here; False at the deadline or when ``proc`` exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.listening(port):
                return True
            if proc is not None and proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False


@dataclass(eq=False)
class Link:
    """A veth pair between two hosts, in subnet 10.213.``index``.0/24 (``a`` is .1, ``b`` is .2)."""

    a: Host
    b: Host
    index: int
    rate_gbit: float = 0.0

    @property
    def devices(self) -> tuple[str, str]:
        return f"v{self.index}{self.a.name}", f"v{self.index}{self.b.name}"

    def address(self, host: Host) -> str:
        """The address of ``host``'s end of this link."""
        if host is self.a:
            return f"{_SUBNET}.{self.index}.1"
        if host is self.b:
            return f"{_SUBNET}.{self.index}.2"
        raise ValueError(f"host {host.name} is not on the link {self.a.name}-{self.b.name}")

    def shape(self, rate_gbit: float) -> None:
        """Shape both directions to ``rate_gbit`` Gbit/s with a token bucket (tc tbf), replacing any earlier rate.
        The bucket holds 4 ms of traffic (at least 256 KiB): enough for the 64 KiB segments veth passes with
        segmentation offload, small against the transfers that are timed over it."""
        if not rate_gbit > 0:
            raise ValueError(f"rate_gbit must be positive, got {rate_gbit!r}")
        burst = max(256 << 10, int(rate_gbit * 1e9 / 8 * 0.004))
        for host, dev in zip((self.a, self.b), self.devices, strict=True):
            _sh("ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{rate_gbit}gbit", "burst", str(burst), "latency", "20ms")
        self.rate_gbit = rate_gbit

    def set_up(self, up: bool) -> None:
        """Take both ends of the link down (False) or bring them back (True): ``ip link set ... down``."""
        for host, dev in zip((self.a, self.b), self.devices, strict=True):
            _sh("ip", "-n", host.netns, "link", "set", dev, "up" if up else "down")


class Hosts:
    """The hosts and links of one test or benchmark run; a context manager that removes them all at exit.

    ``names``: host names (short: they go into interface names); ``links``: pairs of names to join (default:
    the first host to each other one); ``rate_gbit``: the shaping of every link (``Link.shape`` changes it);
    ``shm_size``: the size limit of each host's private /dev/shm."""

    def __init__(self, names: Sequence[str] = ("a", "b"), *, links: Iterable[tuple[str, str]] | None = None,
                 rate_gbit: float = 10, shm_size: str = "1g", owner: str | None = None):
        if len(set(names)) != len(names) or not names or any(not n.isalnum() or len(n) > 5 for n in names):
            raise ValueError(f"host names must be distinct, alphanumeric, at most 5 characters: {names!r}")
        self.owner = owner or str(os.getpid())
        self.hosts = {n: Host(n, f"{_PREFIX}-{self.owner}-{n}") for n in names}
        pairs = list(links) if links is not None else [(names[0], n) for n in names[1:]]
        self._pairs, self._rate, self._shm_size = pairs, rate_gbit, shm_size
        self.links: list[Link] = []
        self._made: list[str] = []  # namespaces created, removed at close

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def link(self, a: str, b: str) -> Link:
        for ln in self.links:
            if {ln.a.name, ln.b.name} == {a, b}:
                return ln
        raise KeyError(f"no link between {a} and {b}")

    def __enter__(self) -> Hosts:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        for host in self.hosts.values():
            _sh("ip", "netns", "add", host.netns)
            self._made.append(host.netns)
            _sh("ip", "-n", host.netns, "link", "set", "lo", "up")
            host.keeper = self._keeper(host)
        for index, (na, nb) in enumerate(self._pairs):
            link = Link(self.hosts[na], self.hosts[nb], index)
            self._connect(link)
            link.shape(self._rate)
            self.links.append(link)

    def _keeper(self, host: Host) -> subprocess.Popen[Any]:
        # unshare execs (no fork), so the Popen's pid is the process that holds the new namespaces
        script = (f"mount -t tmpfs -o size={self._shm_size},mode=1777 shm /dev/shm && "
                  f"{_private_tmp_script()} && "
                  f"hostname {host.netns} && echo ready && exec sleep 2147483647")
        keeper = subprocess.Popen(["ip", "netns", "exec", host.netns, "unshare", "--mount", "--uts",
                                   "--propagation", "private", "sh", "-c", script],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        host.keeper = keeper  # killed at close even if it never says ready
        if keeper.stdout is None or keeper.stderr is None:  # both are PIPEs: narrows the types
            raise HostSetupError(f"host {host.name}: the keeper has no output pipes")
        line = keeper.stdout.readline()  # bounded: the script ends (EOF) on any failure
        if line.strip() != "ready":
            keeper.wait(5)
            raise HostSetupError(f"host {host.name}: private /dev/shm, /tmp and hostname failed: "
                                 f"{keeper.stderr.read().strip()}")
        return keeper

    def _connect(self, link: Link) -> None:
        dev_a, dev_b = link.devices
        # created straight into the two namespaces: the root namespace never holds either end
        _sh("ip", "link", "add", dev_a, "netns", link.a.netns, "type", "veth", "peer", "name", dev_b,
            "netns", link.b.netns)
        for host, dev in ((link.a, dev_a), (link.b, dev_b)):
            _sh("ip", "-n", host.netns, "addr", "add", f"{link.address(host)}/24", "dev", dev)
            _sh("ip", "-n", host.netns, "link", "set", dev, "up")

    def close(self) -> None:
        """Kill every process started in the hosts and every keeper, delete the namespaces (and their veths)."""
        failures = []
        for host in self.hosts.values():
            for proc in [*host.procs, *([host.keeper] if host.keeper is not None else [])]:
                try:
                    _kill(proc)
                except Exception as exc:  # keep going: the namespaces must go whatever else failed
                    failures.append(exc)
            host.procs.clear()
            host.keeper = None
        for netns in self._made:
            _kill_pids_in(netns)  # anything a started process left behind in that namespace
            _sh("ip", "netns", "del", netns, check=False)
        self._made.clear()
        self.links.clear()
        if failures:
            raise HostSetupError(f"stopping the hosts' processes failed: {failures}")


def _outside_paths_in_tmp() -> list[str]:
    """Directories under /tmp that processes on a host must still see: the checkout kvstore runs from and the
    Python installation (a clone in /tmp/x would otherwise vanish under the host's private /tmp)."""
    import kvstore

    keep = set()
    for path in (Path(kvstore.__file__).resolve().parents[1], Path(sys.prefix).resolve(), Path.cwd().resolve()):
        if len(path.parts) > 2 and path.parts[1] == "tmp":
            keep.add(str(Path("/tmp", path.parts[2])))
    return sorted(keep)


def _private_tmp_script() -> str:
    """Shell: a private tmpfs on /tmp, with :func:`_outside_paths_in_tmp` bound back into it (through a bind
    of the outer /tmp that is unmounted again at once)."""
    keep = _outside_paths_in_tmp()
    if not keep:
        return "mount -t tmpfs -o mode=1777 tmp /tmp"
    outer = "/dev/shm/.kvstore-outer-tmp"
    steps = [f"mkdir {outer}", f"mount --bind /tmp {outer}", "mount -t tmpfs -o mode=1777 tmp /tmp"]
    for path in keep:
        inner = shlex.quote(f"{outer}/{Path(path).name}")
        steps += [f"mkdir -p {shlex.quote(path)}", f"mount --bind {inner} {shlex.quote(path)}"]
    steps += [f"umount -l {outer}", f"rmdir {outer}"]
    return " && ".join(steps)


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:  # unflushed input to a process that is gone: nothing to keep
                pass


def _kill_pids_in(netns: str) -> None:
    out = _sh("ip", "netns", "pids", netns, check=False)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def namespaces(owner: str | None = None) -> list[str]:
    """The network namespaces of this helper that exist now (those of ``owner``, default this process)."""
    prefix = f"{_PREFIX}-{owner or os.getpid()}-"
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def remove_stale() -> list[str]:
    """Remove the namespaces left by runs of this helper whose process is gone (killed before cleaning up)."""
    removed = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        parts = line.split()[0].split("-") if line.strip() else []
        if len(parts) == 3 and parts[0] == _PREFIX and parts[1].isdigit() and not os.path.exists(f"/proc/{parts[1]}"):
            _kill_pids_in(line.split()[0])
            _sh("ip", "netns", "del", line.split()[0], check=False)
            removed.append(line.split()[0])
    return removed


@dataclass(frozen=True)
class LinkRate:
    """The raw socket across a link: seconds per transfer of ``nbytes``, and the median rate."""

    nbytes: int
    seconds: tuple[float, ...]

    @property
    def gbit_s(self) -> float:
        return self.nbytes * 8 / statistics.median(self.seconds) / 1e9

    @property
    def gb_s(self) -> float:
        return self.gbit_s / 8


def measure_link(link: Link, nbytes: int = 64 << 20, repeats: int = 3, *, port: int = 7199,
                 sender: Host | None = None, timeout: float = 120.0) -> LinkRate:
    """Time ``repeats`` transfers of ``nbytes`` from ``sender`` (default ``link.a``) to the other end, over a
    raw TCP socket (``kvstore.testing.rawlink``); each includes the acknowledgement's round trip."""
    src = sender or link.a
    dst = link.b if src is link.a else link.a
    common = ["--port", str(port), "--bytes", str(nbytes), "--repeats", str(repeats), "--timeout", str(timeout)]
    recv = dst.popen([sys.executable, "-m", "kvstore.testing.rawlink", "recv", "--bind", link.address(dst), *common],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if recv.stdout is None or recv.stderr is None:  # both are PIPEs: narrows the types
            raise HostSetupError(f"raw link receiver on {dst.name}: no output pipes")
        if recv.stdout.readline().strip() != "ready":
            raise HostSetupError(f"raw link receiver on {dst.name} failed: {recv.stderr.read().strip()}")
        out = src.run([sys.executable, "-m", "kvstore.testing.rawlink", "send", "--to", link.address(dst), *common],
                      timeout=timeout)
        recv.wait(timeout)
    finally:
        _kill(recv)
        dst.procs.remove(recv)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return LinkRate(result["bytes"], tuple(result["seconds"]))
