"""Imported by the multi-rank test harness's fork server (hyper_parallel.dtensor.testing):
imports the caller's modules once, so that every rank forked from it has them already."""

from hyper_parallel.dtensor.testing import _preload_in_fork_server

_preload_in_fork_server()
