"""Fixtures whose work runs in a process of its own, started as soon as the run is collected, so that it goes on
beside the tests that come before the one needing it: the suite leaves 46% of a 2-core CPU idle on average
(subprocesses starting, servers coming up), and the two jobs below took 200 s of its 1125 when they ran in line.
A job is a module with `build(directory)`; tests/conftest.py starts the jobs whose fixture a collected test uses,
and stops and removes them all when the session ends. A pytest-xdist worker (the README's two keep the CPU busy by
themselves) collects every test and runs some: its jobs start where a test of its own first needs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

# fixture name -> the module whose build(directory) makes what it returns (run as `python -m MODULE DIRECTORY`)
JOBS = {"sd15_unet": "tests.sd15_unet", "built_library": "tests.plugin_build"}
TIMEOUT_S = 1800


@dataclass
class Job:
    directory: Path
    process: subprocess.Popen

    @property
    def log(self) -> Path:
        return self.directory / "job.log"


_running: dict[str, Job] = {}


def start(name: str) -> Job:
    """Starts the job behind fixture `name` (once per session), its output and log in a fresh directory."""
    if name not in _running:
        directory = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        env = dict(os.environ, DEMO_DIFFUSION_CACHE=str(directory / "cache"), PYTHONPATH=str(ROOT))
        with open(directory / "job.log", "wb") as log:
            # niced: it takes the CPU the tests leave idle, and slows them as little as it can
            process = subprocess.Popen([sys.executable, "-m", JOBS[name], str(directory / "out")], cwd=ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10))
        _running[name] = Job(directory, process)
    return _running[name]


def start_for(items) -> None:
    """Starts the jobs whose fixtures the collected test items that will run use."""
    running = [item for item in items if item.get_closest_marker("skip") is None]
    for name in JOBS:
        if any(name in getattr(item, "fixturenames", ()) for item in running):
            start(name)


def result(name: str) -> Path:
    """The directory job `name` made, waiting for it (started now if collection did not); fails the test with the
    job's log where it failed."""
    import pytest

    job = start(name)
    try:
        code = job.process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.process.kill()
        pytest.fail(f"background job {name} took over {TIMEOUT_S} s")
    if code != 0:
        pytest.fail(f"background job {name} exited {code}:\n{job.log.read_text(errors='replace')[-4000:]}")
    return job.directory / "out"


def stop_all() -> None:
    """Stops what still runs (an interrupted or deselected session) and removes every job's directory."""
    for job in _running.values():
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()
        shutil.rmtree(job.directory, ignore_errors=True)
    _running.clear()
