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


def test_a_run_dir_is_private_and_its_config_0600_under_an_open_umask(tmp_path):
    """Checkpoints (weights, optimizer state), episodes and the config (env.args may hold secrets)
    are the run's: another local user must not read them, whatever the umask."""
    from agentrl.config import load_config
    from agentrl.recipes.rl import prepare_run_dir

    cfg = load_config([], ["--env.args={\"token\": \"s3cret\"}"])
    old = os.umask(0o022)
    try:
        prepare_run_dir(tmp_path / "runs" / "r1", cfg, resume=False)
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)  # a dir the user made open on purpose keeps its mode; the config does not
        (shared / "config.toml").write_text("old")
        prepare_run_dir(shared, cfg, resume=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "runs" / "r1").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "runs" / "r1" / "config.toml").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(shared / "config.toml").st_mode) == 0o600
    assert "s3cret" in (shared / "config.toml").read_text()
