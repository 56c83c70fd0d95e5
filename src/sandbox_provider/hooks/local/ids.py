"""
Host user ids for the local backend's sandboxes on a root worker: one uid (and the gid of the same
number) per sandbox, leased from a range no host account uses.

A lease is a symbolic link named for the id in the lease directory, pointing at the path of the
sandbox that holds it (made atomically: of two workers, one gets the name). Every change runs under
one ``flock`` on the directory: leases share it (the link's creation is what decides between two
workers), a release and a sweep hold it alone, so a release never frees an id someone else has
leased since, and a sweep never frees the lease of a sandbox being made. A sweep runs at most once
per interval per host (the time of the last one is the modification time of ``.swept`` there), so
a create does not read every lease of the host. The lease directory is host-wide: every worker of
the host must use the same one (the default does), whatever its state root.

The default range, 1900000000-1900065535, lies above the ids that ``useradd`` hands out to users
(``UID_MAX``, 60000), to system accounts and to subordinate ranges (``SUB_UID_MAX``, 600100000 by
default), and below 2^31. To reserve it, give no account an id in it and keep it out of
``/etc/subuid`` and ``/etc/subgid``; an id that does belong to an account (``getpwuid``/``getgrgid``
find it) is never leased.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import grp
import os
import pwd
import random
import stat
import time
from collections.abc import Callable, Iterator

from sandbox_provider.hooks.forms.local import DEFAULT_UID_RANGE
from sandbox_provider.sandbox.errors import SandboxTerminalError

__all__ = ["DEFAULT_UID_RANGE", "IdLeases", "parse_uid_range", "shared_leases"]
_RANDOM_TRIES = 32
_LOCK = ".lock"
_SWEPT = ".swept"


def parse_uid_range(value: str) -> tuple[int, int]:
    """
    Parse ``"first-last"`` (both included) into ``(first, last)``.

    :raises ValueError: unless 1000 <= first <= last < 2**31 - 1.
    """
    try:
        first_text, last_text = str(value).split("-")
        first, last = int(first_text), int(last_text)
    except ValueError:
        raise ValueError(f"uid_range must look like '1900000000-1900065535' (first-last), got {value!r}.") from None
    if not 1000 <= first <= last < 2**31 - 1:
        raise ValueError(
            f"uid_range {value!r} must lie between 1000 and 2147483646 with first <= last; pick ids no host "
            "account uses."
        )
    return first, last


def _unused_by_accounts(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
        except KeyError:
            continue
        return False
    return True


@functools.lru_cache(maxsize=8)
def shared_leases(directory: str, first: int, last: int) -> IdLeases:
    """The :class:`IdLeases` of ``directory`` for this worker process (its directory checked once)."""
    return IdLeases(directory, first, last)


class IdLeases:
    """
    Lease host uids from ``first``..``last`` (both included), one per sandbox, recorded in ``directory``.

    :param directory: where the leases live; created (mode 0700) on first use; must belong to the worker.
    :param first: the lowest id of the range.
    :param last: the highest id of the range.
    """

    def __init__(self, directory: str, first: int, last: int) -> None:
        self.directory = directory
        self.first = first
        self.last = last
        self._checked = False
        self._next_sweep_check = 0.0  # time.monotonic() before which this process need not look at .swept

    def _open_lock(self) -> int:
        if not self._checked:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            info = os.lstat(self.directory)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                raise OSError(errno.EPERM, "not a directory owned by this user")
            self._checked = True
        return os.open(os.path.join(self.directory, _LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    @contextlib.contextmanager
    def _locked(self, *, shared: bool = False) -> Iterator[None]:
        try:
            try:
                fd = self._open_lock()
            except FileNotFoundError:
                self._checked = False  # removed since it was checked (a temp cleaner): made again
                fd = self._open_lock()
        except OSError as err:
            raise SandboxTerminalError(
                f"The sandbox id lease directory {self.directory!r} cannot be used ({err.strerror}); pass another "
                "uid_lease_dir to LocalSandboxHook (one directory for every worker of the host)."
            ) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _path(self, uid: int) -> str:
        return os.path.join(self.directory, str(uid))

    def _try(self, uid: int, owner: str) -> bool:
        if not _unused_by_accounts(uid):
            return False
        try:
            os.symlink(owner, self._path(uid))
        except FileExistsError:
            return False
        return True

    def lease(self, owner: str) -> int:
        """
        Lease a free id for the sandbox at path ``owner``; return it.

        :raises SandboxTerminalError: when every id of the range is leased or belongs to an account.
        """
        size = self.last - self.first + 1
        with self._locked(shared=True):
            for _ in range(min(_RANDOM_TRIES, size)):
                uid = self.first + random.randrange(size)
                if self._try(uid, owner):
                    return uid
            start = random.randrange(size)
            for step in range(size):
                uid = self.first + (start + step) % size
                if self._try(uid, owner):
                    return uid
        raise SandboxTerminalError(
            f"Every user id of uid_range {self.first}-{self.last} is leased to a sandbox or used by an account: "
            "destroy sandboxes, or give LocalSandboxHook a wider uid_range."
        )

    def _owner(self, uid: int) -> str | None:
        try:
            return os.readlink(self._path(uid))
        except (FileNotFoundError, OSError):
            return None

    def release(self, uid: int, owner: str) -> None:
        """Free ``uid`` if ``owner`` holds it (a lease someone else took since is left alone). Idempotent."""
        with self._locked():
            if self._owner(uid) == owner:
                os.unlink(self._path(uid))

    def leases(self) -> dict[int, str]:
        """Every current lease: id -> owner path."""
        with self._locked():
            return self._all()

    def _all(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for name in os.listdir(self.directory):
            if name.isdigit():
                owner = self._owner(int(name))
                if owner is not None:
                    found[int(name)] = owner
        return found

    def _swept_within(self, every: float) -> bool:
        """Whether any worker of the host swept less than ``every`` seconds ago (``.swept``'s time)."""
        try:
            return os.stat(os.path.join(self.directory, _SWEPT)).st_mtime + every > time.time()
        except FileNotFoundError:
            return False

    def _mark_swept(self) -> None:
        fd = os.open(os.path.join(self.directory, _SWEPT), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)

    def sweep(self, abandoned: Callable[[str], bool], *, every: float | None = None) -> list[int]:
        """
        Free every lease whose owner ``abandoned(owner)`` says is gone; return the ids freed.

        The predicate runs under the lock, held alone, so a sandbox cannot lease, be swept and be
        re-leased at once.

        :param every: seconds: sweep only if no worker of the host swept within that long (this
            process then looks again only after a tenth of it); None: sweep now.
        """
        if every is not None:
            now = time.monotonic()
            if now < self._next_sweep_check:
                return []
            self._next_sweep_check = now + every / 10
            if self._swept_within(every):
                return []
        freed = []
        with self._locked():
            if every is not None and self._swept_within(every):
                return []  # another worker swept while this one waited for the lock
            self._mark_swept()
            for uid, owner in self._all().items():
                if abandoned(owner):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path(uid))
                    freed.append(uid)
        return freed
