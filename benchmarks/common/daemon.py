"""The ``kvstore serve`` launcher the benchmarks use: :mod:`kvstore.testing.daemon`, re-exported."""

from kvstore.testing.daemon import (
    Daemon,
    DaemonStartError,
    can_connect,
    free_port,
    process_token_file,
    project_env,
    short_tmpdir,
)

__all__ = ["Daemon", "DaemonStartError", "can_connect", "free_port", "process_token_file", "project_env",
           "short_tmpdir"]
