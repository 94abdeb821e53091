"""How ``python -m cgx_jax.launch`` starts each process, so that it dies with the launcher:
``python .../cgx_jax/launch_child.py LAUNCHER_PID COMMAND...`` (by path: it imports neither
cgx_jax nor jax, so it starts in milliseconds) asks Linux to SIGKILL it when its
parent exits (``prctl(PR_SET_PDEATHSIG)``, which survives ``exec``), then becomes COMMAND.
The launcher stops its processes itself whenever it can; this covers the launcher being
killed with SIGKILL (or crashing), which used to leave every rank running in a session of its
own. SIGKILL, not SIGTERM: JAX takes SIGTERM as a preemption notice and keeps going. Where
``prctl`` does not exist (not Linux) the command runs without it. Only COMMAND's own process
gets the signal, not processes it starts: a shell script should ``exec`` the trainer.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Arranges SIGKILL for this process when its parent exits; exits at once if the parent
    (``parent_pid``) is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl here: nothing to arrange
        return
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(128 + signal.SIGKILL)


def main(argv: list[str]) -> None:
    parent_pid, command = int(argv[0]), argv[1:]
    die_with_parent(parent_pid)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
