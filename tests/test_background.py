"""tests/background.py: only the jobs of tests that will run start; a job that fails fails the test that needs it,
with the job's own output; the session's end removes every job's directory."""

import pytest

from tests import background


def test_a_failing_job_fails_its_test_with_the_jobs_output(monkeypatch):
    monkeypatch.setattr(background, "JOBS", {"broken": "tests.no_such_job_module"})
    monkeypatch.setattr(background, "_running", {})
    with pytest.raises(pytest.fail.Exception, match=r"(?s)background job broken exited 1:.*No module named"):
        background.result("broken")
    directory = background._running["broken"].directory
    assert directory.exists()
    background.stop_all()
    assert not directory.exists() and background._running == {}


class _Item:
    def __init__(self, fixturenames, skipped=False):
        self.fixturenames = fixturenames
        self.skip = pytest.mark.skip(reason="here").mark if skipped else None

    def get_closest_marker(self, name):
        return self.skip if name == "skip" else None


def test_only_the_jobs_of_tests_that_will_run_start(monkeypatch):
    monkeypatch.setattr(background, "JOBS", {"used": "tests.no_such_job_module", "skipped": "tests.no_such_job_module",
                                             "unused": "tests.no_such_job_module"})
    monkeypatch.setattr(background, "_running", {})
    background.start_for([_Item(["tmp_path", "used"]), _Item(["skipped"], skipped=True)])
    assert set(background._running) == {"used"}
    background.stop_all()
