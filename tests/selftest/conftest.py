import pytest

from tests.conftest import selftests_run_together
from tests.selftest import ahead


@pytest.fixture(scope="session")
def _uncollected_sessions_killed():
    yield
    ahead.kill_uncollected()


@pytest.fixture(autouse=True)
def inner_sessions_ahead(request, tmp_path_factory, _uncollected_sessions_killed):
    """The self-tests' slow inner sessions, started when the first self-test
    runs (tests/selftest/ahead.py): all of them where this process runs every
    self-test, else those of that test's file."""
    items = request.session.items
    if not selftests_run_together(request.config):
        items = [item for item in items if item.path == request.node.path]
    ahead.start_ahead(items, tmp_path_factory)
