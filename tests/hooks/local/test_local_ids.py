"""Host uid leases for local sandboxes: unique across workers, never an account's, released only by their owner."""

from __future__ import annotations

import multiprocessing
import os
import pwd

import pytest

from sandbox_provider.hooks.local.ids import DEFAULT_UID_RANGE, IdLeases, parse_uid_range
from sandbox_provider.sandbox import SandboxTerminalError


def test_parse_uid_range():
    assert parse_uid_range(DEFAULT_UID_RANGE) == (1_900_000_000, 1_900_065_535)
    assert parse_uid_range("5000-5000") == (5000, 5000)
    for bad in ("5000", "a-b", "6000-5000", "0-100", "10-20", "1000-4294967295"):
        with pytest.raises(ValueError, match="uid_range"):
            parse_uid_range(bad)


def test_default_range_belongs_to_no_account():
    first, last = parse_uid_range(DEFAULT_UID_RANGE)
    assert not [p.pw_name for p in pwd.getpwall() if first <= p.pw_uid <= last]


def test_lease_release_and_owner_check(tmp_path):
    leases = IdLeases(str(tmp_path / "ids"), 1_900_000_000, 1_900_000_009)
    got = {leases.lease(f"/state/s{i}") for i in range(10)}
    assert got == set(range(1_900_000_000, 1_900_000_010))
    with pytest.raises(SandboxTerminalError, match="wider uid_range"):
        leases.lease("/state/one-too-many")
    uid = next(iter(got))
    owner = leases.leases()[uid]
    leases.release(uid, "/state/not-the-owner")  # not the holder: left alone
    assert uid in leases.leases()
    leases.release(uid, owner)
    leases.release(uid, owner)  # idempotent
    assert uid not in leases.leases()
    assert leases.lease("/state/again") == uid
    assert oct(os.stat(tmp_path / "ids").st_mode & 0o777) == "0o700"


def test_a_lease_directory_removed_after_first_use_is_made_again(tmp_path):
    import shutil

    from sandbox_provider.hooks.local.ids import shared_leases

    directory = str(tmp_path / "ids")
    leases = shared_leases(directory, 1_900_000_000, 1_900_000_009)
    assert shared_leases(directory, 1_900_000_000, 1_900_000_009) is leases  # one per worker process
    leases.lease("/state/a")
    shutil.rmtree(directory)  # a temp cleaner, say
    uid = leases.lease("/state/b")
    assert leases.leases() == {uid: "/state/b"}
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"


def test_ids_of_accounts_are_never_leased(tmp_path):
    taken = os.getuid() if os.getuid() >= 1000 else pwd.getpwnam("nobody").pw_uid
    leases = IdLeases(str(tmp_path / "ids"), taken, taken)
    with pytest.raises(SandboxTerminalError, match="used by an account"):
        leases.lease("/state/s")


def test_sweep_frees_only_abandoned(tmp_path):
    leases = IdLeases(str(tmp_path / "ids"), 1_900_000_000, 1_900_000_099)
    live = leases.lease("/state/live")
    dead = leases.lease("/state/dead")
    assert leases.sweep(lambda owner: owner == "/state/dead") == [dead]
    assert set(leases.leases()) == {live}


def test_a_timed_sweep_runs_once_per_interval_per_host(tmp_path):
    directory = str(tmp_path / "ids")
    one, other = IdLeases(directory, 1_900_000_000, 1_900_000_099), IdLeases(directory, 1_900_000_000, 1_900_000_099)
    first = one.lease("/state/first")
    assert one.sweep(lambda owner: True, every=60) == [first]
    second = one.lease("/state/second")
    # Another worker of the host (another IdLeases on the directory) within the interval: no sweep.
    assert other.sweep(lambda owner: True, every=60) == []
    assert set(one.leases()) == {second}
    os.utime(os.path.join(directory, ".swept"), (0, 0))  # the last sweep, long ago
    assert other.sweep(lambda owner: True, every=60) == []  # this worker looked just now: not again so soon
    third = IdLeases(directory, 1_900_000_000, 1_900_000_099)
    assert third.sweep(lambda owner: True, every=60) == [second]
    assert one.sweep(lambda owner: True) == []  # an untimed sweep (gc_expired) runs whatever the time


def test_leases_share_the_lock_and_a_sweep_holds_it_alone(tmp_path):
    import fcntl

    leases = IdLeases(str(tmp_path / "ids"), 1_900_000_000, 1_900_000_099)
    leases.lease("/state/a")
    fd = os.open(os.path.join(leases.directory, ".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # another worker leasing right now
        assert leases.lease("/state/b")  # does not wait for it
        fcntl.flock(fd, fcntl.LOCK_EX)  # another worker sweeping (or releasing) right now
        done = []
        import threading

        thread = threading.Thread(target=lambda: done.append(leases.lease("/state/c")))
        thread.start()
        thread.join(0.5)
        assert done == []  # the lease waits for the sweep
        fcntl.flock(fd, fcntl.LOCK_UN)
        thread.join(10)
        assert len(done) == 1
    finally:
        os.close(fd)


def _lease_many(directory: str, count: int, queue) -> None:
    leases = IdLeases(directory, 1_900_000_000, 1_900_000_199)
    queue.put([leases.lease(f"/state/{os.getpid()}-{i}") for i in range(count)])


def test_concurrent_workers_never_share_an_id(tmp_path):
    directory = str(tmp_path / "ids")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_lease_many, args=(directory, 50, queue)) for _ in range(4)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    every = [uid for result in results for uid in result]
    assert len(every) == 200 == len(set(every))


def test_unusable_directory_is_terminal(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SandboxTerminalError, match="uid_lease_dir"):
        IdLeases(str(blocker / "ids"), 1_900_000_000, 1_900_000_001).lease("/state/s")
