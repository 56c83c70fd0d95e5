"""The plumbing Islo and Boat share: the retry loop, Retry-After, and which URLs may receive an API key."""

from __future__ import annotations

import email.utils
import time

import pytest

from sandbox_provider.hooks.hosted.service import call, check_service_url, retry_after_seconds


class Clock:
    """A monotonic clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Flaky(Exception):
    def __init__(self, retry_after=None):
        super().__init__("flaky")
        self.headers = {"Retry-After": retry_after} if retry_after is not None else {}


def failing(times, *, error=Flaky, result="ok"):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= times:
            raise error()
        return result

    return fn, calls


def run(fn, clock, *, until=1000.0, retry=lambda err: isinstance(err, Flaky), attempts=None):
    return call(
        fn,
        until=until,
        retry=retry,
        retry_after=lambda err: retry_after_seconds(getattr(err, "headers", None)),
        clock=clock,
        sleep=clock.sleep,
        attempts=attempts,
    )


def test_retries_with_growing_pauses_until_it_succeeds():
    clock = Clock()
    fn, calls = failing(6)
    assert run(fn, clock) == "ok"
    assert len(calls) == 7
    assert clock.slept == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_a_failure_it_may_not_retry_is_raised_at_once():
    clock = Clock()
    fn, calls = failing(1, error=KeyError)
    with pytest.raises(KeyError):
        run(fn, clock)
    assert len(calls) == 1 and clock.slept == []


def test_never_sleeps_past_the_deadline():
    clock = Clock()
    fn, calls = failing(100)
    with pytest.raises(Flaky):
        run(fn, clock, until=clock.now + 4)
    assert clock.slept == [0.5, 1.0, 2.0] and clock.now < 104


def test_obeys_retry_after_unless_it_ends_past_the_deadline():
    clock = Clock()
    fn, calls = failing(1, error=lambda: Flaky("3"))
    assert run(fn, clock) == "ok" and clock.slept == [3.0]
    clock = Clock()
    fn, calls = failing(1, error=lambda: Flaky("30"))
    with pytest.raises(Flaky):
        run(fn, clock, until=clock.now + 10)
    assert len(calls) == 1 and clock.slept == []


def test_stops_after_the_attempts_allowed():
    clock = Clock()
    fn, calls = failing(10)
    with pytest.raises(Flaky):
        run(fn, clock, attempts=3)
    assert len(calls) == 3


def test_retry_after_reads_seconds_and_dates():
    assert retry_after_seconds({"retry-after": "7"}) == 7.0
    assert retry_after_seconds({"Retry-After": " 0 "}) == 0.0
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 50 < retry_after_seconds({"Retry-After": later}) <= 60
    assert retry_after_seconds({"Retry-After": "soon"}) is None
    assert retry_after_seconds({}) is None and retry_after_seconds(None) is None


@pytest.mark.parametrize(
    "url",
    [
        "https://api.example.com",
        "https://api.example.com/v1/",
        "http://127.0.0.1:8080/api",
        "http://[::1]:9",
        "http://localhost",
    ],
)
def test_urls_that_may_receive_a_key(url):
    assert check_service_url(url, "base_url") == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://api.example.com", "api.example.com", "ftp://x", "https://", "http://10.0.0.1"])
def test_urls_that_may_not_receive_a_key(url):
    with pytest.raises(ValueError, match="base_url must be an https:// URL"):
        check_service_url(url, "base_url")
