"""Every error a user or a boundary can see, in one place.

Two families:

- :class:`AgentrlError`: something the user can fix (a config value, a CLI argument, a
  missing plugin, their own code raising).  The CLI prints its message on one line and
  exits with code 2.
- :class:`EpisodeFailure`: something went wrong inside one episode.  It never crashes a
  run: the episode loop (``agentrl.episode``) records it on the trajectory as ``error``
  with an ``error_kind`` (the boundary it crossed) and the ledger counts the
  episode as errored.  Exceptions of other types raised inside an episode are classified
  by where they were raised (an env hook → ``env``, the policy client → ``endpoint``).
"""

from __future__ import annotations

# The kinds an errored episode can have (README: "Fates, error kinds and exit codes").
ERROR_KINDS = ("endpoint", "parse", "context_length", "env", "tool", "sandbox", "rubric", "timeout", "program")

# What to do about each kind, in one place for every message that names one (a stall, an evaluation
# that errored, a wall budget spent waiting).
FIX_BY_KIND = {
    "rubric": "fix the rubric function", "env": "fix the environment", "tool": "fix the tool",
    "sandbox": "check `agentrl sandbox doctor`", "endpoint": "check the inference endpoint",
    "timeout": "raise rollout.episode_timeout_s or the env's timeout",
    "parse": "check the endpoint's response format",
    "context_length": "shorten the prompts or raise inference.max_model_len",
    "program": "fix the agent program (its stderr is in the message), or HarnessEnv(failed_exit='error') if it "
               "never fails on the model's output",
}


class AgentrlError(Exception):
    """Base for errors caused by user input (config, CLI argument, missing plugin ...)."""


class ConfigError(AgentrlError):
    """A bad config file, key or value."""


class EnvironmentNotFound(AgentrlError):
    """No installed environment or package directory by that name."""


class RubricNotFound(AgentrlError):
    """No installed rubric plugin by that name."""


class UserCodeError(AgentrlError):
    """User code (``load_environment``, a dataset, a rubric factory) raised outside an episode."""


class RunDirExists(AgentrlError):
    """The run directory already holds a run and --resume was not given."""


class CheckpointError(AgentrlError):
    """A checkpoint could not be written (disk full, quota, read-only) or is damaged."""


class TrainerDied(AgentrlError):
    """A rank of the sharded trainer died or a collective timed out; the message names the rank and the
    newest checkpoint to resume from (one line from the CLI, exit code 1: not a user error)."""

    exit_code = 1


class EngineStartError(AgentrlError):
    """An inference engine did not come up (bad model dir, port in use, crash at load)."""


class EndpointProbeError(AgentrlError):
    """An endpoint is unusable for the chosen path (wrong model name, missing routes)."""


class EndpointDown(EndpointProbeError):
    """An endpoint kept answering 5xx (or 429) to the probe: the server failed, not the
    command's settings, so the exit status is 1 (failed work), not 2."""

    exit_code = 1


# ----------------------------------------------------------------------------- episode failures


class EpisodeFailure(Exception):
    """A failure inside one episode; ``error_kind`` names the boundary it crossed."""

    error_kind = "env"


class EpisodeError(EpisodeFailure):
    """Raise from an env hook (or a tool) to end the episode as errored; not shown to the model."""

    error_kind = "env"


class ToolError(EpisodeError):
    """A tool failed in a way the model did not cause (raised as :class:`EpisodeError` inside it)."""

    error_kind = "tool"


class EpisodeTimeout(EpisodeFailure):
    """A wall limit passed while the policy was at work (an agent program's ``timeout_s`` after
    its first model call): the policy's failure, like the episode's own wall limit."""

    error_kind = "timeout"


class ProgramFailed(EpisodeError):
    """An agent program (``HarnessEnv``) exited non-zero, or its agent function raised, after the
    model had replied to it: the model's output may be why (most agent programs crash on a
    malformed tool call), so it is the policy's failure, kept in its group with
    ``buffer.failure_rewards["program"]`` (``HarnessEnv(failed_exit="error")``: kind ``env``)."""

    error_kind = "program"


class EndpointError(EpisodeFailure):
    """The inference endpoint failed (after the client's retries) or rejected the request."""

    error_kind = "endpoint"


class ContextLengthExceeded(EndpointError):
    """The prompt does not fit the model's context window."""

    error_kind = "context_length"


class MalformedResponse(EndpointError):
    """The endpoint answered, but not in the shape the request asked for."""

    error_kind = "parse"


class RequestError(ValueError):
    """A request an engine cannot serve (a weight update that does not fit, a bad prompt);
    the HTTP layer answers it with an OpenAI-style 4xx."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight update (names/shapes wrong, engine down)."""


def error_kind_of(e: BaseException, default: str = "env") -> str:
    """The ``error_kind`` an exception carries (sandbox and rubric errors set their own)."""
    kind = getattr(type(e), "error_kind", None)
    return kind if isinstance(kind, str) else default


__all__ = [
    "ERROR_KINDS",
    "AgentrlError",
    "CheckpointError",
    "ConfigError",
    "ContextLengthExceeded",
    "EndpointError",
    "EndpointProbeError",
    "EngineStartError",
    "EnvironmentNotFound",
    "EpisodeError",
    "EpisodeFailure",
    "EpisodeTimeout",
    "MalformedResponse",
    "ProgramFailed",
    "RequestError",
    "RubricNotFound",
    "RunDirExists",
    "ToolError",
    "UserCodeError",
    "WeightSyncError",
    "error_kind_of",
]
