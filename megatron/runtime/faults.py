"""Fault points: the few places where a test makes a run wait or die at a moment of its choosing, so tests
of signals and interrupted saves hit the moment they mean on a machine of any speed.

Off unless the environment names them: ``NEOX_FAULTS="name=value;name=value"`` (tests build it with
switched_on()). Every point and what its value means:
"""

from __future__ import annotations

import os
import signal

from megatron.errors import ExpectedError

FAULTS_ENV = "NEOX_FAULTS"
POINTS = {
    "sigkill_during_save": "<moment>@<iteration>: the saving process SIGKILLs itself at that moment of that save "
                           "(moments: SAVE_MOMENTS)",
    "hold_before_stop_save": "<seconds>: a rank waits this long between agreeing to stop and saving",
    "hold_before_first_step": "<seconds>: a rank that finished its set-up waits up to this long for a stop signal",
    "hold_after_iteration": "<iteration>: after this step a rank waits for a stop signal before the ranks agree",
    "fail_after_iteration": "<rank>@<iteration>: after this step that rank alone fails with an expected error, as "
                            "on a file only it reads",
}
SAVE_MOMENTS = ("files_written", "manifest_written", "renamed")
__doc__ += "\n".join(f"- {name}: {meaning}" for name, meaning in POINTS.items())


def switched_on(**points: object) -> dict[str, str]:
    """The environment that switches `points` on in the processes a test starts."""
    unknown = sorted(set(points) - set(POINTS))
    if unknown:
        raise ValueError(f"no fault point {unknown}; the points are {sorted(POINTS)}")
    return {FAULTS_ENV: ";".join(f"{name}={value}" for name, value in points.items())}


def value(name: str) -> str | None:
    """The value the environment gives fault point `name`; None when it is off."""
    assert name in POINTS, name
    for entry in os.environ.get(FAULTS_ENV, "").split(";"):
        key, _, given = entry.partition("=")
        if key == name:
            return given
    return None


def seconds(name: str) -> float:
    return float(value(name) or 0)


def kill_point(moment: str, iteration: int) -> None:
    """Where a save reaches `moment`: the process dies here when sigkill_during_save names this moment and save."""
    if value("sigkill_during_save") == f"{moment}@{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)


def fail_point(rank: int, iteration: int) -> None:
    """After step `iteration`: rank `rank` raises here when fail_after_iteration names it and this step."""
    if value("fail_after_iteration") == f"{rank}@{iteration}":
        raise ExpectedError(f"fault point fail_after_iteration: rank {rank} failed after iteration {iteration}")
