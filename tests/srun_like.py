"""A srun-like job wrapper (a test helper): runs a command in a process group of its own and passes a
SIGTERM or SIGINT it gets on to that whole group, as a job runner signals every process of its job.

    python tests/srun_like.py COMMAND [ARG ...]

Exits with the command's status (128 + N when a signal N ended it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(command: list[str]) -> int:
    job = subprocess.Popen(command, start_new_session=True)

    def signal_the_job(signum: int, frame) -> None:
        os.killpg(job.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal_the_job)
    returncode = job.wait()
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
