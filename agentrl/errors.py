"""Errors a user can fix. The CLI prints their message on one line and exits with code 2.

Errors are named by the boundary they crossed (STYLE.md #8); inside a run, failures of
one episode become data on that episode instead (``Trajectory.error``).
"""


class AgentrlError(Exception):
    """Base for errors caused by user input (config, CLI argument, missing plugin ...)."""


class EnvironmentNotFound(AgentrlError):
    """No installed environment or package directory by that name."""


class RubricNotFound(AgentrlError):
    """No installed rubric plugin by that name."""
