"""See what the agent is doing: ``agentrl view RUN_DIR --serve`` (a local page) and the data it reads.

:mod:`agentrl.viewer.data` reads run and eval directories (the one place that knows file and
field names) and holds the chart layout that :mod:`agentrl.plot` draws too;
:mod:`agentrl.viewer.server` serves the page in ``static/`` (vanilla JS and SVG, no CDN).
"""

from agentrl.viewer.data import CHARTS, RunView
from agentrl.viewer.server import ViewerServer, create_app, serve

__all__ = ["CHARTS", "RunView", "ViewerServer", "create_app", "serve"]
