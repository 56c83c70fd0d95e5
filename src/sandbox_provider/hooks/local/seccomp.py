"""
The local backend's system-call filter, built with libseccomp and handed to ``bwrap --seccomp``.

The filter allows every system call except the kernel surface Docker's default profile keeps from
an unprivileged container. A refused call fails with ``EPERM`` (``clone3`` with ``ENOSYS``, so the C
library falls back to ``clone``, whose flags the filter can see). What is refused, and why:

==========================  ========================================================================
keyrings                    ``keyctl``, ``add_key``, ``request_key``: no key of the worker's, nor of
                            another sandbox's, can be read, and none can be added.
other processes             ``ptrace``, ``process_vm_readv``, ``process_vm_writev``, ``kcmp``,
                            ``pidfd_getfd``.
kernel programs and events  ``bpf``, ``perf_event_open``, ``userfaultfd``, ``lookup_dcookie``,
                            ``fanotify_init``.
asynchronous I/O rings      ``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``.
kernel code                 ``init_module``, ``finit_module``, ``delete_module``, ``create_module``,
                            ``query_module``, ``get_kernel_syms``, ``kexec_load``, ``kexec_file_load``.
mounts                      ``mount``, ``umount``, ``umount2``, ``pivot_root``, ``fsopen``,
                            ``fsconfig``, ``fsmount``, ``fspick``, ``move_mount``, ``open_tree``,
                            ``mount_setattr``.
namespaces                  ``setns``; ``unshare`` and ``clone`` with any ``CLONE_NEW*`` flag
                            (``CLONE_FILES``, ``CLONE_FS``, ``CLONE_SYSVSEM`` and threads stay
                            allowed); ``clone3`` (``ENOSYS``).
personality                 ``personality`` setting ``ADDR_NO_RANDOMIZE``, ``READ_IMPLIES_EXEC``,
                            ``MMAP_PAGE_ZERO``, ``ADDR_COMPAT_LAYOUT`` or ``ADDR_LIMIT_3GB`` (the
                            query ``0xffffffff`` and ``PER_LINUX32`` stay allowed).
the machine                 ``reboot``, ``swapon``, ``swapoff``, ``acct``, ``quotactl``,
                            ``quotactl_fd``, ``syslog``, ``vhangup``, ``sethostname``,
                            ``setdomainname``, ``settimeofday``, ``stime``, ``clock_settime``,
                            ``clock_adjtime``, ``nfsservctl``, ``ioperm``, ``iopl``, ``vm86``,
                            ``vm86old``, ``uselib``, ``ustat``, ``sysfs``, ``_sysctl``.
file handles                ``open_by_handle_at``, ``name_to_handle_at``.
==========================  ========================================================================

The native architecture's calls are filtered, and, on x86-64 and arm64, the 32-bit ones too (a
32-bit program runs under the same rules). Calls of any other ABI kill the process. A name the
installed libseccomp does not know is skipped (it cannot be called through a table libseccomp does
not know either); :func:`refused_names` lists what the built filter refuses.

Docker's profile is an allowlist; this one refuses by name, so a system call added to the kernel
after this list was written is allowed until it is added here.
"""

from __future__ import annotations

import errno
import functools
import tempfile

from sandbox_provider.hooks.local import seccomp_cache as _cache
from sandbox_provider.sandbox.errors import SandboxTerminalError

__all__ = ["REFUSED", "filter_program", "refused_names", "syscall_number"]

#: System calls whose numbers the worker itself needs (the spawner's keyring call), kept with the filter.
_NUMBERS = ("keyctl",)

#: The system calls refused outright, by group (see the module docstring).
REFUSED: dict[str, tuple[str, ...]] = {
    "keyrings": ("keyctl", "add_key", "request_key"),
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    "kernel programs and events": ("bpf", "perf_event_open", "userfaultfd", "lookup_dcookie", "fanotify_init"),
    "asynchronous I/O rings": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "kernel code": (
        "init_module",
        "finit_module",
        "delete_module",
        "create_module",
        "query_module",
        "get_kernel_syms",
        "kexec_load",
        "kexec_file_load",
    ),
    "mounts": (
        "mount",
        "umount",
        "umount2",
        "pivot_root",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "move_mount",
        "open_tree",
        "mount_setattr",
    ),
    "namespaces": ("setns",),
    "the machine": (
        "reboot",
        "swapon",
        "swapoff",
        "acct",
        "quotactl",
        "quotactl_fd",
        "syslog",
        "vhangup",
        "sethostname",
        "setdomainname",
        "settimeofday",
        "stime",
        "clock_settime",
        "clock_adjtime",
        "nfsservctl",
        "ioperm",
        "iopl",
        "vm86",
        "vm86old",
        "uselib",
        "ustat",
        "sysfs",
        "_sysctl",
    ),
    "file handles": ("open_by_handle_at", "name_to_handle_at"),
}

#: The namespace flags of clone(2)/unshare(2): CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC,
#: NEWUSER, NEWPID, NEWNET.
_NAMESPACE_FLAGS = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
#: personality(2) flags that weaken address-space protections: ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC,
#: MMAP_PAGE_ZERO, ADDR_COMPAT_LAYOUT, ADDR_LIMIT_3GB.
_PERSONALITY_FLAGS = (0x0040000, 0x0400000, 0x0100000, 0x0200000, 0x8000000)


def _binding():
    """The libseccomp binding: the distribution's own (``seccomp``) where installed, else ``pyseccomp``."""
    try:
        import seccomp  # type: ignore[import-not-found]

        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp
    except ImportError as err:
        raise SandboxTerminalError(
            "The local backend filters system calls with libseccomp, and no Python binding for it is installed: "
            "pip install pyseccomp."
        ) from err
    except (OSError, RuntimeError) as err:  # the binding loads libseccomp when imported
        raise SandboxTerminalError(
            f"The local backend filters system calls with libseccomp, which this worker lacks ({err}): install "
            "libseccomp2 (apt-get install libseccomp2, dnf install libseccomp, apk add libseccomp)."
        ) from err
    return pyseccomp


def _companion_arches(sc) -> list[int]:
    """The 32-bit ABI that the native one also runs, whose calls must meet the same rules."""
    native = sc.system_arch()
    if native == sc.Arch.X86_64:
        return [sc.Arch.X86]
    if native == sc.Arch.AARCH64:
        return [sc.Arch.ARM]
    return []


def _known(sc, name: str) -> bool:
    try:
        sc.resolve_syscall(sc.Arch.NATIVE, name)
    except (OSError, ValueError):
        return False
    return True


def _add_flag_rules(sc, flt, action: int, name: str, arg: int, flags: tuple[int, ...]) -> None:
    """Refuse ``name`` whenever argument ``arg`` has any of ``flags`` set (one rule per flag)."""
    for flag in flags:
        flt.add_rule(action, name, sc.Arg(arg, sc.MASKED_EQ, flag, flag))


def _add_personality_rules(sc, flt, action: int) -> None:
    """
    Refuse a personality with a weakening flag, but not the query ``0xffffffff`` (all bits set).

    libseccomp compares an argument once per rule, so "flag set and not all ones" is written as
    "flag set and bit b clear", one rule for each other bit b of the 32-bit persona.
    """
    for flag in _PERSONALITY_FLAGS:
        for bit in range(32):
            other = 1 << bit
            if other != flag:
                flt.add_rule(action, "personality", sc.Arg(0, sc.MASKED_EQ, flag | other, flag))


def _as_tree(sc, flt) -> None:
    """
    Ask libseccomp (2.5 and later) to sort the system call numbers into a binary tree: the kernel
    then checks and caches the program in about half the time at each launch (bwrap loads it twice),
    and a call of the sandbox meets a few comparisons rather than one per listed call. The rules are
    the same; an older libseccomp keeps its linear order.
    """
    attr = getattr(getattr(sc, "Attr", None), "CTL_OPTIMIZE", None)
    if attr is None:
        return
    try:
        flt.set_attr(attr, 2)
    except (OSError, RuntimeError, ValueError):  # pyseccomp raises OSError, the distribution's binding RuntimeError
        pass


def _build() -> tuple[bytes, tuple[str, ...], dict[str, int]]:
    """Build the filter with libseccomp: (BPF program, what it refuses, system call numbers the worker uses)."""
    sc = _binding()
    flt = sc.SyscallFilter(sc.ALLOW)
    _as_tree(sc, flt)
    for arch in _companion_arches(sc):
        if not flt.exist_arch(arch):
            flt.add_arch(arch)
    refused = sc.ERRNO(errno.EPERM)
    names = []
    for group in REFUSED.values():
        for name in group:
            if _known(sc, name):
                flt.add_rule(refused, name)
                names.append(name)
    # clone's flags are its first argument, except on s390, where they are the second.
    clone_flags_arg = 1 if sc.system_arch() in (sc.Arch.S390, sc.Arch.S390X) else 0
    _add_flag_rules(sc, flt, refused, "unshare", 0, _NAMESPACE_FLAGS)
    _add_flag_rules(sc, flt, refused, "clone", clone_flags_arg, _NAMESPACE_FLAGS)
    names += ["unshare (namespace flags)", "clone (namespace flags)"]
    if _known(sc, "clone3"):
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        names.append("clone3 (ENOSYS)")
    _add_personality_rules(sc, flt, refused)
    names.append("personality (weakening flags)")
    numbers = {name: int(sc.resolve_syscall(sc.Arch.NATIVE, name)) for name in _NUMBERS}
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read(), tuple(names), numbers


@functools.lru_cache(maxsize=1)
def _built() -> tuple[bytes, tuple[str, ...], dict[str, int]]:
    cached = _cache.load()
    if cached is not None:
        return cached
    built = _build()
    _cache.store(*built)
    return built


def filter_program() -> bytes:
    """
    The filter as a classic BPF program (what ``bwrap --seccomp FD`` reads), built once per worker
    user and libseccomp (see ``_cache``), and read from there once per process.

    :raises SandboxTerminalError: when no libseccomp binding or library is installed.
    """
    return _built()[0]


def syscall_number(name: str) -> int:
    """The number of system call ``name`` on this machine's own architecture (libseccomp knows them all)."""
    if name in _NUMBERS:
        return _built()[2][name]
    sc = _binding()
    return int(sc.resolve_syscall(sc.Arch.NATIVE, name))


def refused_names() -> tuple[str, ...]:
    """The system calls the filter refuses on this worker (names, with the conditional ones described)."""
    return _built()[1]
