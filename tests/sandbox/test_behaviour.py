"""One behavioural contract, run against every backend (bwrap, docker, local)."""

from __future__ import annotations

import asyncio
import errno

import pytest

from agentrl.sandbox import ExecResult, SandboxError, make_sandbox


async def test_exec_reports_exit_code_and_separate_streams(backend, limits):
    async with make_sandbox(backend, limits) as sb:
        r = await sb.exec("echo out; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
        assert not (r.timed_out or r.oom or r.cpu_exceeded or r.stdout_truncated)
        r = await sb.exec(["python3", "-c", "import os,sys; print(os.environ['GREETING'], sys.stdin.read())"],
                          stdin="from stdin", env={"GREETING": "hi"})  # fmt: skip
        assert r.ok and r.stdout == "hi from stdin\n"
        r = await sb.exec(["definitely-not-a-command"])
        assert r.exit_code == 127


async def test_files_round_trip_and_persist_across_execs(backend, limits):
    async with make_sandbox(backend, limits) as sb:
        blob = bytes(range(256)) * 100
        await sb.write_file("pkg/data.bin", blob)
        await sb.write_file("main.py", "import pathlib; print(len(pathlib.Path('pkg/data.bin').read_bytes()))")
        assert (await sb.exec(["python3", "main.py"])).stdout == "25600\n"
        assert await sb.read_file("pkg/data.bin") == blob
        await sb.exec("echo made-by-exec > made.txt")
        assert await sb.read_file(f"{sb.workdir}/made.txt") == b"made-by-exec\n"
        with pytest.raises(FileNotFoundError):
            await sb.read_file("missing.txt")


async def test_read_file_max_bytes_bounds_what_is_read(backend, limits):
    # a caller reading model-written output caps it; the 64 MiB ceiling still holds above
    async with make_sandbox(backend, limits) as sb:
        await sb.write_file("out.txt", b"z" * 1000)
        assert await sb.read_file("out.txt", max_bytes=1000) == b"z" * 1000
        assert await sb.read_file("out.txt", max_bytes=1 << 40) == b"z" * 1000
        with pytest.raises(OSError) as e:
            await sb.read_file("out.txt", max_bytes=999)
        assert e.value.errno == errno.EFBIG and not isinstance(e.value, SandboxError)
        assert (await sb.exec("echo still usable")).ok


async def test_large_stdin_and_output_cap(backend, limits):
    async with make_sandbox(backend, limits) as sb:
        r = await sb.exec(["wc", "-c"], stdin=b"x" * 300_000)  # larger than one request env var
        assert r.stdout.strip() == "300000"
        r = await sb.exec(["python3", "-c", "print('y' * 200_000)"])
        assert r.exit_code == 0 and r.stdout_truncated and len(r.stdout) == limits.output_bytes


async def test_timeout_kills_command_and_sandbox_stays_usable(backend, limits):
    async with make_sandbox(backend, limits) as sb:
        r = await sb.exec("echo started; sleep 30", timeout=0.5)
        assert r.timed_out and r.stdout == "started\n" and r.exit_code != 0
        assert (await sb.exec("echo again")).stdout == "again\n"


async def test_background_processes_do_not_outlive_their_exec(backend, limits):
    async with make_sandbox(backend, limits) as sb:
        r = await sb.exec("(sleep 0.5; echo late > late.txt) & echo spawned")
        assert r.ok and r.stdout == "spawned\n"
        r = await sb.exec("sleep 1.2; ls")
        assert r.ok and "late.txt" not in r.stdout


async def test_reset_empties_workdir(backend, limits):
    async with make_sandbox(backend, limits) as sb:
        await sb.write_file("a.txt", "a")
        await sb.exec("mkdir -p d/e && touch d/e/f $TMPDIR/t")
        await sb.reset()
        r = await sb.exec('ls -A . "$TMPDIR" | grep -v : | grep . ; true')
        assert r.stdout == ""


async def test_close_is_idempotent_and_final(backend, limits):
    sb = make_sandbox(backend, limits)
    await sb.start()
    await sb.close()
    await sb.close()
    with pytest.raises(SandboxError):
        await sb.exec("true")


async def test_sandboxes_are_independent_and_run_concurrently(backend, limits):
    async def one(i: int) -> ExecResult:
        async with make_sandbox(backend, limits) as sb:
            await sb.write_file("id.txt", str(i))
            return await sb.exec("cat id.txt; ls")

    results = await asyncio.gather(*(one(i) for i in range(4)))
    assert [r.stdout for r in results] == [f"{i}id.txt\n" for i in range(4)]


async def test_cancelled_exec_leaves_nothing_running(backend, limits):
    sb = make_sandbox(backend, limits)
    await sb.start()
    task = asyncio.ensure_future(sb.exec("sleep 30"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # a request cut off mid-flight leaves the agent in an unknown state: the sandbox is gone
    with pytest.raises(SandboxError):
        await sb.exec("true")
    await sb.close()


async def test_a_nul_byte_in_an_argument_or_variable_is_refused_naming_it(backend, limits):
    """exec() cannot pass one: the agent's child died before the command and the caller read a
    bare exit code 125."""
    async with make_sandbox(backend, limits) as sb:
        for call in (lambda: sb.exec(["echo", "a\x00b"]), lambda: sb.exec("echo a\x00b"),
                     lambda: sb.exec(["true"], env={"X": "a\x00b"})):
            with pytest.raises(ValueError, match=r"contains a NUL byte \(\\x00\), which no process can take"):
                await call()
        assert (await sb.exec(["echo", "still usable"])).stdout == "still usable\n"
