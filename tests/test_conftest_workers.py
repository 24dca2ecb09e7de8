"""The torch threads each pytest-xdist worker gets (tests/conftest.py): the cores shared among the workers,
at least one each, and nothing changed outside xdist or where the caller set OMP_NUM_THREADS.
Oracle: the division written out for the core and worker counts given."""

import os

import pytest

import conftest


@pytest.mark.parametrize(
    "workers, cores, expected",
    [(None, 2, None), ("1", 2, None), ("2", 2, 1), ("2", 16, 8), ("3", 16, 5), ("4", 2, 1)],
)
def test_workers_share_the_cores(monkeypatch, workers, cores, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if workers is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert conftest._threads_per_xdist_worker() == expected


def test_a_thread_count_set_by_the_caller_is_kept(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert conftest._threads_per_xdist_worker() is None
