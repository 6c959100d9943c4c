"""What every benchmark here shares: timing and percentiles (timing.py, on kvstore.workloads.stats), the
``kvstore serve`` launcher the tests use too (daemon.py), the machine description (machine.py) and the
table printer (table.py)."""
