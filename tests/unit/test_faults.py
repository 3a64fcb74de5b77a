"""The fault points tests switch on in the processes they start (megatron/runtime/faults.py)."""

import pytest

from megatron.runtime import faults


def test_a_point_is_off_unless_the_environment_names_it(monkeypatch):
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    assert faults.value("hold_before_first_step") is None and faults.seconds("hold_before_first_step") == 0
    faults.kill_point("renamed", 3)  # off: the test process lives on


def test_switched_on_points_reach_the_process_and_only_they(monkeypatch):
    for name, value in faults.switched_on(hold_before_stop_save=1.5, sigkill_during_save="renamed@12").items():
        monkeypatch.setenv(name, value)
    assert faults.seconds("hold_before_stop_save") == 1.5
    assert faults.value("sigkill_during_save") == "renamed@12"
    assert faults.value("hold_after_iteration") is None
    faults.kill_point("renamed", 11)  # another save's moment: no kill


def test_an_unknown_point_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"no fault point \['sigkill_at_save'\]; the points are \[.*'sigkill_during_save'"):
        faults.switched_on(sigkill_at_save="renamed@1")
