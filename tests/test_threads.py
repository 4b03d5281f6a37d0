"""The CPU thread governor (runtime/threads.py): its rule, and the real thing beside a real busy
process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from unweight.runtime import threads
from unweight.runtime.threads import CoreGovernor, threads_for


@pytest.mark.parametrize(
    "others,max_threads,current,want",
    [
        (0.0, 2, 2, 2),
        (0.5, 2, 2, 2),
        (0.6, 2, 2, 1),
        (1.0, 2, 2, 1),
        (3.0, 2, 2, 1),
        (0.5, 2, 1, 1),
        (0.31, 2, 1, 1),
        (0.29, 2, 1, 2),
        (0.0, 2, 1, 2),  # back up only once they let go
        (1.7, 4, 4, 2),
        (1.2, 4, 2, 3),
        (0.2, 4, 2, 4),
        (0.0, 1, 1, 1),
    ],
)
def test_threads_give_way_one_per_core_taken(others, max_threads, current, want):
    assert threads_for(others, max_threads, current) == want


@pytest.mark.skipif(
    not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux /proc and two cores"
)
def test_a_busy_process_takes_a_thread_and_gives_it_back():
    saved = torch.get_num_threads()
    gov = CoreGovernor(max_threads=2, enabled=True)

    def settle(want: int, limit_s: float = 15.0) -> int:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            time.sleep(threads.INTERVAL_S)
            if gov.step() == want:
                return want
        return gov.threads

    try:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            assert settle(1) == 1 and torch.get_num_threads() == 1
        finally:
            spinner.kill()
            spinner.wait()
        if settle(2) != 2 and gov.others >= threads.RELEASE:
            pytest.skip(
                f"other processes still use {gov.others:.2f} cores: this machine is not quiet enough to give the "
                f"thread back"
            )
        assert gov.threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_it_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("UNWEIGHT_THREAD_GOVERNOR", "0")
    gov = CoreGovernor(max_threads=2)
    assert not gov.enabled and gov.step() == 2
