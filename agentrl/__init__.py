"""agentrl: agentic, multi-turn, asynchronous RL for language models.

Public API
==========

Writing an environment (import only from these three):

- ``agentrl.envs`` — ``Environment`` (the hooks: ``dataset``, ``setup``, ``step``, ``done``,
  ``cleanup``, ``rubric``), ``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv`` (Python functions as
  tools), ``SandboxEnv`` (``bash``/``python`` tools in a per-episode sandbox), ``GymEnv`` (a
  gymnasium environment in text), ``as_gymnasium`` (any environment as a ``gymnasium.Env``),
  ``State``, ``EpisodeError``, ``check_environment``.
- ``agentrl.rubrics`` — ``Rubric`` (weighted reward functions asking for arguments by name),
  ``RubricGroup``, ``JudgeRubric``.
- ``agentrl.types`` — ``Task``, ``Message``, ``ToolCall``, ``SamplingParams``, ``Completion``,
  ``TokenSequence``, ``Trajectory``, ``Group``.

Training and evaluating (the recipes, configured by one typed config):

- ``agentrl.config`` — ``Config`` and its sections, ``load_config(files, overrides)``.
- ``agentrl.recipes.rl.train(cfg)`` — async RL (``agentrl run``).
- ``agentrl.recipes.sft.warm_start(cfg)`` — supervised warm start (``agentrl sft``).
- ``agentrl.recipes.eval.evaluate(env, client, ...)`` — evaluation (``agentrl eval``).

The data flow, one module or folder per arrow (README "Architecture"):
``envs → episode → rollout → buffer → trainer → weights → inference (engine)``.
"""

__version__ = "0.1.0"
