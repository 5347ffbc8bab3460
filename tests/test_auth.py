"""agentrl.auth's key file under attack (a key written into a directory others can write)."""

from __future__ import annotations

import os
import stat

from agentrl.auth import read_key, write_key


def test_a_planted_temp_file_does_not_receive_the_key(tmp_path):
    """Attack: write_key wrote through a predictable temp name (``.NAME.PID.tmp``) opened
    without O_EXCL, so a file another user planted there (mode 0666, in a shared dir like /tmp)
    received the key and became the key file, readable by that user.  The temp name is random
    and made afresh: the planted file stays empty and the key file is 0600."""
    target = tmp_path / "engine.key"
    planted = tmp_path / f".{target.name}.{os.getpid()}.tmp"
    planted.write_text("")
    planted.chmod(0o666)
    for key in ("arl-first", "arl-secret"):  # a second write (a restart) goes the same way
        write_key(target, key)
        assert read_key(target) == key
        assert stat.S_IMODE(target.stat().st_mode) == 0o600, oct(target.stat().st_mode)
    assert planted.exists() and planted.read_text() == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, planted.name])  # no temp left
