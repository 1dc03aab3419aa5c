"""The daemon fixture of tests/daemon, for the test that attaches trainer ranks to a real daemon."""

from ...daemon.conftest import make_daemon  # noqa: F401  (a fixture)
