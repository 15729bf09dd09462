"""The node host starts role processes from one warm zygote: by name, with their exit codes, killed on
demand, handed a file; a zygote that cannot load the role code says so. The Ray launcher's boot path
imports no torch (so Ray starts while the command still imports)."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tianji.runtime.process.host import HostError, NodeHost, Zygote
from tianji.runtime.process.life import pid_alive


def wait_exit(host: NodeHost, name: str, timeout_s: float = 20.0) -> int | None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        pid, code = host.exitcodes()[name]
        if code is not None:
            return code
        time.sleep(0.05)
    return None


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether `pid` has exited within `timeout_s` (a zombie its parent has not reaped yet counts as exited)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def host():
    h = NodeHost(["json"])
    yield h
    h.close()


def test_roles_start_by_name_and_report_how_they_ended(host):
    sleeper = host.start("actor0", "time:sleep", 30)
    quitter = host.start("actor1", "sys:exit", 3)
    assert sleeper != quitter
    assert wait_exit(host, "actor1") == 3
    assert host.exitcodes()["actor0"] == (sleeper, None)  # still running
    host.kill("actor0")
    assert "actor0" not in host.exitcodes()  # a killed role is no longer the host's
    assert gone(sleeper), "the killed role's process still runs"


def test_starting_a_role_again_replaces_its_process(host):
    first = host.start("learner0", "time:sleep", 30)
    second = host.start("learner0", "time:sleep", 30)
    assert first != second and host.exitcodes()["learner0"] == (second, None)
    assert gone(first), "the replaced process still runs"
    assert not gone(second)


def test_an_attachment_reaches_the_role_as_a_file(capfd):
    host = NodeHost(["json"])  # made here, so its zygote writes into capfd
    try:
        host.start("learner0", "builtins:print", {"x": 1}, attachment=b"checkpoint bytes")  # prints its spec
        assert wait_exit(host, "learner0") == 0
    finally:
        host.close()
    spec = ast.literal_eval(capfd.readouterr().out.strip().splitlines()[-1])
    assert spec["x"] == 1 and Path(spec["attachment"]).read_bytes() == b"checkpoint bytes"
    assert Path(spec["attachment"]).stat().st_mode & 0o777 == 0o600, "only the run's user reads it"
    Path(spec["attachment"]).unlink()


def test_a_zygote_started_by_one_process_is_driven_by_a_host_elsewhere():
    zygote = Zygote(["json"])  # as the command starts its machine's zygote before Ray is up
    host = NodeHost(["json"], zygote_path=zygote.path)  # as the warm host Ray creates adopts it
    try:
        host.start("actor1", "sys:exit", 5)
        assert wait_exit(host, "actor1") == 5
        host.close()  # the end of its connection: the zygote exits
        assert zygote.process.wait(10) == 0
    finally:
        zygote.close()


def test_a_zygote_that_cannot_load_the_role_code_says_which_module():
    host = NodeHost(["tianji_no_such_module"])
    try:
        with pytest.raises(HostError, match="tianji_no_such_module"):
            host.start("actor0", "time:sleep", 1)
    finally:
        host.close()


def test_the_ray_boot_path_imports_no_torch():
    code = (
        "import sys; import tianji.runtime.launchers.ray_boot, tianji.runtime.process.host; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
