"""One run per save directory: a lock file that names the run holding it.

Two runs saving into one directory would interleave their tags and `latest`. The first run's
global rank 0 creates ``<save>/save.lock`` before the first step and removes it when the process
ends. The file is created complete and atomically (written under a private name, then hard-linked
to its final name, which fails when the name exists, also on NFS), so a second run either creates
it or finds a whole record of the holder: host, pid and the process's start time (a pid the OS
gave to another process since is not the holder).

A run killed with SIGKILL leaves its lock behind: on the same host a holder that is gone, or whose
pid is now another process, is stale and taken over with a notice line. A lock of another host
cannot be judged from here and is refused, naming that host and pid and how to remove it.
Taking over is serialised among the processes of this host by flock on the directory, so two runs
that both find the same stale lock cannot both take it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout
from megatron.processes import process_start_time


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


@dataclass(frozen=True)
class LockHolder:
    """The run a lock file names."""

    host: str
    pid: int
    start_time: int | None
    since: str  # UTC, when the lock was taken
    configs: list[str]
    command: str

    @classmethod
    def this_process(cls, configs: list[str]) -> LockHolder:
        pid = os.getpid()
        return cls(host=socket.gethostname(), pid=pid, start_time=process_start_time(pid),
                   since=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), configs=list(configs),
                   command=shlex.join(sys.argv))

    def same_process(self, other: LockHolder) -> bool:
        return (self.host, self.pid, self.start_time) == (other.host, other.pid, other.start_time)

    def stale_reason(self) -> str | None:
        """Why this holder is certainly gone (it must be on this host to tell); None when it may still run."""
        if self.host != socket.gethostname():
            return None
        if not _is_running(self.pid):
            return f"pid {self.pid} is no longer running"
        now = process_start_time(self.pid)
        if self.start_time is not None and now is not None and now != self.start_time:
            return f"pid {self.pid} is another process now"
        return None

    def describe(self) -> str:
        configs = f", configs {', '.join(self.configs)}" if self.configs else ""
        return f"pid {self.pid} on host {self.host} (since {self.since}{configs})"


def _read_holder(path: Path) -> LockHolder | None:
    """The holder `path` names; None when the file is gone."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"cannot read the lock file {path}: {err.strerror or err}. Fix its permissions, "
                              "or delete it if no run saves into that directory.") from err
    try:
        stored = json.loads(text)
        return LockHolder(**{**stored, "pid": int(stored["pid"])})
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"the lock file {path} is damaged ({type(err).__name__}: {err}), so the run holding "
                              "it cannot be told; delete it if no run saves into that directory.") from err


def _publish(path: Path, holder: LockHolder) -> bool:
    """Create `path` holding `holder`'s record, wholly or not at all; False when `path` exists."""
    private = path.with_name(f".{path.name}.{holder.host}.{holder.pid}.tmp")
    private.write_text(json.dumps(asdict(holder), indent=1) + "\n")
    try:
        os.link(private, path)
        return True
    except FileExistsError:
        return False
    finally:
        private.unlink(missing_ok=True)


@contextlib.contextmanager
def _host_mutex(directory: Path):
    """Exclusive among this host's processes while held (flock); a filesystem without flock goes without."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # releases the flock


_held: dict[Path, LockHolder] = {}


def acquire(save_dir: str | Path, configs: list[str], notice) -> Path:
    """Take the lock of `save_dir` (an existing directory) for this process until it ends; CheckpointError naming
    the run that holds it. `notice(line)` is told when a stale lock is taken over. Returns the lock file."""
    save_dir = Path(save_dir).expanduser().resolve()
    path = save_dir / layout.LOCK_FILE
    if path in _held:
        return path
    holder = LockHolder.this_process(configs)
    try:
        with _host_mutex(save_dir):
            while not _publish(path, holder):
                found = _read_holder(path)
                if found is None:
                    continue  # its run ended meanwhile
                if found.same_process(holder):
                    break
                reason = found.stale_reason()
                if reason is None:
                    raise CheckpointError(_refusal(save_dir, path, found))
                notice(f"took over {path} from {found.describe()}: {reason}, so that run is gone "
                       "(killed before it could remove its lock)")
                path.unlink(missing_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create the lock file {path}: {err.strerror or err}. Fix the permissions of "
                              f"{save_dir}, free space there, or point `save` at another directory.") from err
    _held[path] = holder
    if len(_held) == 1:
        atexit.register(release_all)
    return path


def _refusal(save_dir: Path, path: Path, holder: LockHolder) -> str:
    where = f"`save: {save_dir}` is in use by another run, {holder.describe()}; two runs saving into one directory " \
            "would mix their checkpoints."
    if holder.host != socket.gethostname():
        return (f"{where} That run is on another host, so it cannot be checked from here: if it is really gone, "
                f"delete {path} and start again; otherwise point `save` elsewhere.")
    return f"{where} Wait until it ends, or point `save` at another directory."


def release_all() -> None:
    """Remove the lock files this process holds (those still naming it)."""
    for path, holder in list(_held.items()):
        with contextlib.suppress(CheckpointError):
            found = _read_holder(path)
            if found is not None and found.same_process(holder):
                path.unlink(missing_ok=True)
        del _held[path]
