"""``kvstore serve`` whose shared-memory names carry a pid that does not exist here: what a daemon in another
PID namespace (a container sharing /dev/shm) looks like to this one.

Usage: foreign_pid_daemon.py PID SERVE-ARGS...
"""

import os
import sys

import kvstore.memory.segment as segment
from kvstore.cli.main import main

FOREIGN_PID = int(sys.argv[1])
_init = segment.SegmentSet.__init__


def _named_for_the_foreign_pid(self, *args, **kwargs):
    real = os.getpid
    os.getpid = lambda: FOREIGN_PID  # only while the names are chosen
    try:
        _init(self, *args, **kwargs)
    finally:
        os.getpid = real


segment.SegmentSet.__init__ = _named_for_the_foreign_pid
sys.exit(main(["serve", *sys.argv[2:]]))
