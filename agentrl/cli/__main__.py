"""``python -m agentrl.cli ...``: the same as the ``agentrl`` console script."""

from agentrl.cli import main

main()
