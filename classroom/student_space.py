"""A student's private view of the machine: their own /tmp, /var/tmp and /dev/shm, their own System V
IPC, a /proc that shows their own processes only, and the temporary and compile-cache directories
of their server, kernels and Labs in their own (0700) home.

Why: on a shared /tmp a student can make the directories another student's programs will use before
they do. torch's compile cache is one, `/tmp/torchinductor_<user>` (tempfile.gettempdir() and the
user's name, its owner never checked): student B made A's, 0777, with a precompiled header of B's in
it, and A's next torch.compile built B's code into every kernel it loaded, in A's kernel and in each
of A's engines. The precompiled headers stay there even when TORCHINDUCTOR_CACHE_DIR is set elsewhere
(torch._inductor.codecache._HEADER_DIR is read from the user's temporary directory), hence TMPDIR.
And /proc, as mounted by default, shows every user's command lines (a Lab's tag, a kernel's connection
file) and, under /proc/<pid>/net, the sockets of every network namespace.

Made in the spawner's child as root (the mount and IPC namespaces are new in it: nothing else on the
machine sees them) and gone when the student's last process ends, which a stop ensures (the cgroup's
kill): the tmpfs mounts and the IPC objects go with the namespaces, and the spawner empties TMPDIR.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000  # <sched.h>
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_SLAVE = 2, 4, 8, 1 << 14, 1 << 19  # <sys/mount.h>
TEMPORARY = ("/tmp", "/var/tmp", "/dev/shm")
"""Each gets a tmpfs of the student's own (mode 1777, as the shared ones)."""

_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child after fork calls through it
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def directories(home: str) -> dict[str, str]:
    """The environment that points a student's programs at their home for temporary files and
    compile caches: TMPDIR (tempfile, torch's precompiled headers), torch inductor's and Triton's
    caches. In ~/.cache, which the home's 0700 keeps the student's alone."""
    cache = os.path.join(home, ".cache")
    return {
        "TMPDIR": os.path.join(cache, "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "torchinductor"),
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
    }


def _call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args}: {os.strerror(err)}")


def enter_private_space(tmp_size: str) -> None:
    """In the spawner's child, as root: new mount and IPC namespaces, each of TEMPORARY a new tmpfs
    of at most `tmp_size` (tmpfs's size= syntax: 2g, 50%), and /proc shown with hidepid=invisible
    (another user's processes are not there at all: not their command lines, not /proc/<pid>/net)."""
    _call("unshare", CLONE_NEWNS | CLONE_NEWIPC)
    # slave: the host's later mounts still reach the student; none of theirs reaches the host
    _call("mount", None, b"/", None, MS_REC | MS_SLAVE, None)
    for where in TEMPORARY:
        if os.path.isdir(where):
            opts = f"mode=1777,size={tmp_size}".encode()
            _call("mount", b"labkit-tmp", where.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts)
    _call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=invisible")


def make_directories(env: dict[str, str]) -> None:
    """As the student (after the setuid): the directories `directories` names, 0700. One that cannot
    be made is left to the program that needs it (tempfile then falls back to the private /tmp)."""
    for path in env.values():
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError:
            pass


def empty_tmpdir(path: str, uid: int, gid: int) -> None:
    """Remove the server's TMPDIR after a stop, as the student: the student owns that part of their
    home, and removing it with their rights cannot follow a link of theirs to anything they could
    not remove themselves."""
    if os.path.lexists(path):
        subprocess.run(["rm", "-rf", "--", path], user=uid, group=gid, extra_groups=[], cwd="/", timeout=120)
