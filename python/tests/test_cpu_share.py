"""An emulated GPU's CPU share, entered by the rank or profiler itself once loaded
(motley_torch/components/cpu_share.py, docs/emulation.md "Start-up outside the share")."""

import pytest

from motley_torch.components.cpu_share import ENTER_ENV, CpuShareError, enter_share


def test_without_a_share_nothing_is_entered(monkeypatch):
    monkeypatch.delenv(ENTER_ENV, raising=False)
    assert enter_share() is False


def test_the_process_writes_itself_into_the_named_cgroup_procs_and_says_so(monkeypatch, tmp_path, capsys):
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    monkeypatch.setenv(ENTER_ENV, str(procs))
    assert enter_share() is True
    assert procs.read_text() == "0"
    # The line the agent looks for in a layer profiler's log (agent/src/profiler.rs).
    assert f"motley-cpu-share: entered {procs}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["cgroup.procs", "/sys/fs/cgroup/cpu/x/tasks"])
def test_a_path_that_is_no_absolute_cgroup_procs_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ENTER_ENV, value)
    with pytest.raises(CpuShareError, match=ENTER_ENV):
        enter_share()


def test_a_share_that_cannot_be_entered_is_an_error_not_a_silent_run_outside_it(monkeypatch, tmp_path):
    monkeypatch.setenv(ENTER_ENV, str(tmp_path / "gone" / "cgroup.procs"))
    with pytest.raises(CpuShareError, match="cannot enter the CPU share"):
        enter_share()
