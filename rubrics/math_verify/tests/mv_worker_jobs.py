"""Jobs for math-verify's worker processes in tests: importable by name in a spawned worker
(the test puts this folder on sys.path before the workers start)."""

import os
import signal
import time

from agentrl_rubric_math_verify import is_equivalent


def check_or_hang(prediction: str, reference: str, timeout: int) -> bool:
    """``HANG:<path>`` writes the worker's pid to ``path`` and hangs deaf to SIGALRM, as a
    computation inside C does; anything else is checked as usual."""
    if prediction.startswith("HANG:"):
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        with open(prediction[5:], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    return is_equivalent(prediction, reference, timeout=timeout)
