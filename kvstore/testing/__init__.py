"""Helpers for tests of code that uses kvstore: real daemons, hosts as network namespaces."""
