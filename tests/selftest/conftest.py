import pytest

from tests.selftest import ahead


@pytest.fixture(scope="session", autouse=True)
def inner_sessions_ahead(request, tmp_path_factory):
    """The self-tests' slow inner sessions, started when the first self-test runs (tests/selftest/ahead.py)."""
    ahead.start_ahead(request.session.items, tmp_path_factory)
    yield
    ahead.kill_uncollected()
