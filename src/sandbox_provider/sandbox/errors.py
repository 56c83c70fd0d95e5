"""Errors raised by sandbox hooks and the session engine.

``SandboxError`` is something the caller (a Dag author, or a model through the toolset) can work
around: a missing path, a command the image lacks, a file over a limit. ``SandboxTerminalError``
means the sandbox cannot be used at all (credentials rejected, daemon unreachable, sandbox gone,
a spec the backend cannot enforce): it fails the task and leaves the retry to Airflow.
"""

from __future__ import annotations

__all__ = ["SandboxError", "SandboxFileTooLargeError", "SandboxHandleError", "SandboxTerminalError"]


class SandboxError(Exception):
    """A recoverable failure inside a sandbox: the caller can change the request and try again."""


class SandboxTerminalError(SandboxError):
    """The sandbox cannot be used: fail the task and let Airflow's retries take over."""


class SandboxFileTooLargeError(SandboxError):
    """
    A file is larger than the byte budget the caller allowed.

    :param path: the path as the sandbox sees it.
    :param size_bytes: the file's size, or at least the number of bytes seen before giving up.
    :param max_bytes: the budget that was exceeded, in bytes.
    """

    def __init__(self, path: str, size_bytes: int, max_bytes: int) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.max_bytes = max_bytes
        super().__init__(f"{path!r} holds {size_bytes} bytes, more than the limit of {max_bytes} bytes.")

    def __reduce__(self):  # keep the three-argument constructor picklable
        return (type(self), (self.path, self.size_bytes, self.max_bytes))


class SandboxHandleError(SandboxTerminalError, ValueError):
    """
    A string that cannot name a sandbox of this backend: empty, a missing XCom (``"None"``), or not of
    the backend's handle pattern. Nothing is sent to the backend with it.

    It is a :class:`ValueError` too, since the value is wrong wherever it came from.
    """
