"""tests/background.py: a fixture's job that fails fails the test that needs it, with the job's own output; the
session's end removes every job's directory."""

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
