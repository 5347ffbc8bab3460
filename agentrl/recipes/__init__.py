"""Recipes: each `agentrl` command's work, written top to bottom as numbered phases.

- :mod:`agentrl.recipes.rl` — ``train(cfg)``: async RL (``agentrl run``);
- :mod:`agentrl.recipes.sft` — ``warm_start(cfg)``: supervised warm start (``agentrl sft``);
- :mod:`agentrl.recipes.eval` — ``evaluate(...)`` / ``run(...)``: evaluation (``agentrl eval``);
- :mod:`agentrl.recipes.export` — ``export_checkpoint(run_dir, out)``: a kept checkpoint as a
  Hugging Face model dir (``agentrl export``).

They take typed sections of :class:`agentrl.config.Config`; the torch-only parts (Trainer,
losses, checkpoints) live in :mod:`agentrl.trainer`.
"""
