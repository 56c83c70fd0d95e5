"""The batch-transfer contract: the per-file defaults, and the checks on an archive out of a sandbox."""

from __future__ import annotations

import io
import tarfile

import pytest

from fake_hook import FakeSandboxHook
from sandbox_provider.sandbox.batch import (
    ExportLimits,
    ExportRequest,
    ImportEntry,
    glob_base,
    read_export_archive,
)
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError

BIG = ExportLimits(max_file_bytes=1 << 20, max_total_bytes=1 << 22)


class Sink:
    """Collects what an export hands over: ``{(index, name): bytes}``."""

    def __init__(self) -> None:
        self.files: dict[tuple[int, str], bytes] = {}
        self._open: tuple[tuple[int, str], io.BytesIO] | None = None

    def begin(self, index: int, name: str) -> io.BytesIO:
        self._open = ((index, name), io.BytesIO())
        return self._open[1]

    def end(self, index: int, name: str, size: int) -> None:
        assert self._open is not None and self._open[0] == (index, name)
        data = self._open[1].getvalue()
        assert len(data) == size
        self.files[(index, name)] = data
        self._open = None


def _entry(path: str, data: bytes) -> ImportEntry:
    return ImportEntry(path=path, size=len(data), open=lambda: io.BytesIO(data))


@pytest.fixture
def fake(tmp_path):
    hook = FakeSandboxHook(str(tmp_path))
    handle = hook.create()
    yield hook, handle
    hook.destroy(handle)


def test_the_default_batch_moves_files_trees_and_globs_one_file_at_a_time(fake):
    hook, handle = fake
    written = hook.import_batch(
        handle, [_entry("out/a.csv", b"a"), _entry("out/sub/b.csv", b"bb"), _entry("out/c.txt", b"ccc")]
    )
    assert written == 6
    hook.run_command(handle, "ln -s sub out/link && ln -s ../c.txt out/sub/to-c", timeout=10, max_output_bytes=99)
    sink = Sink()
    total = hook.export_batch(
        handle,
        [ExportRequest("out/c.txt"), ExportRequest("out", "tree"), ExportRequest("out/*.csv", "glob")],
        sink,
        limits=BIG,
    )
    assert sink.files == {
        (0, "c.txt"): b"ccc",
        (1, "a.csv"): b"a",
        (1, "c.txt"): b"ccc",
        (1, "sub/b.csv"): b"bb",
        (1, "sub/to-c"): b"ccc",
        (1, "link/b.csv"): b"bb",
        (1, "link/to-c"): b"ccc",
        (2, "a.csv"): b"a",
    }
    assert total == sum(len(v) for v in sink.files.values())


def test_the_default_batch_keeps_both_limits(fake):
    hook, handle = fake
    hook.import_batch(handle, [_entry("d/a", b"x" * 10), _entry("d/b", b"y" * 10)])
    with pytest.raises(SandboxFileTooLargeError) as per_file:
        hook.export_batch(handle, [ExportRequest("d", "tree")], Sink(), limits=ExportLimits(9, 100))
    assert per_file.value.max_bytes == 9
    with pytest.raises(SandboxFileTooLargeError) as total:
        hook.export_batch(handle, [ExportRequest("d", "tree")], Sink(), limits=ExportLimits(10, 15))
    assert total.value.max_bytes == 15
    with pytest.raises(SandboxError, match="not a directory"):
        hook.export_batch(handle, [ExportRequest("d/a", "tree")], Sink(), limits=BIG)


def test_glob_bases():
    assert glob_base("out/*/r.txt") == ("out", ["*", "r.txt"])
    assert glob_base("*.csv") == (".", ["*.csv"])
    assert glob_base("/tmp/x/*.csv") == ("/tmp/x", ["*.csv"])


# -- archives out of a sandbox are hostile ------------------------------------------------------------------


def _archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    raw.seek(0)
    return raw


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _special(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def test_a_clean_archive_reaches_the_sink_by_request_and_name():
    sink = Sink()
    folder = tarfile.TarInfo("1/sub")
    folder.type = tarfile.DIRTYPE
    total = read_export_archive(
        _archive(_file("0/a.txt", b"a"), (folder, None), _file("1/./sub/b", b"bb")),
        [ExportRequest("a.txt"), ExportRequest("d", "tree")],
        sink,
        limits=BIG,
    )
    assert sink.files == {(0, "a.txt"): b"a", (1, "sub/b"): b"bb"} and total == 3


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (_special("0/link", tarfile.SYMTYPE, "/etc/shadow"), "symbolic link"),
        (_special("0/hard", tarfile.LNKTYPE, "0/a"), "hard link"),
        (_special("0/zero", tarfile.CHRTYPE), "device"),
        (_special("0/fifo", tarfile.FIFOTYPE), "FIFO"),
        (_file("0/../../escape", b"x"), "outside the export"),
        (_file("/etc/cron.d/x", b"x"), "outside the export"),
        (_file("7/other", b"x"), "outside the export"),
        (_file("sneaky", b"x"), "outside the export"),
    ],
)
def test_a_hostile_member_fails_the_whole_export_before_its_bytes(member, message):
    sink = Sink()
    with pytest.raises(SandboxError, match=message):
        read_export_archive(_archive(_file("0/a", b"fine"), member), [ExportRequest("d", "tree")], sink, limits=BIG)
    assert list(sink.files) == [(0, "a")]


def test_a_repeated_name_and_the_limits_are_refused_from_the_headers():
    with pytest.raises(SandboxError, match="twice"):
        read_export_archive(
            _archive(_file("0/a", b"1"), _file("0/./a", b"2")), [ExportRequest("d", "tree")], Sink(), limits=BIG
        )
    sink = Sink()
    with pytest.raises(SandboxFileTooLargeError) as err:
        read_export_archive(
            _archive(_file("0/a", b"x" * 50)), [ExportRequest("d", "tree")], sink, limits=ExportLimits(49, 100)
        )
    assert err.value.path == "d/a" and not sink.files
    with pytest.raises(SandboxError, match="more than 1 files"):
        read_export_archive(
            _archive(_file("0/a", b"1"), _file("0/b", b"2")),
            [ExportRequest("d", "tree")],
            Sink(),
            limits=ExportLimits(10, 10, max_files=1),
        )
