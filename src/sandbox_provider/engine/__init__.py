"""
The session engine every consumer shares: :class:`SandboxSession` owns one sandbox's life for one job
(provision or attach, stage, run, export, destroy or release), driven by :class:`SessionOptions`.

Beside it: ``options`` (what a consumer asks of a session, checked at parse time and after rendering),
``transfer`` (staging and exports, all or nothing), ``storage`` and ``publish`` (where exported files go,
through ``.partial`` siblings), ``watch`` (a session ends with the worker that started it) and
``output`` (what a reader is shown of a command's output) and ``task_log`` (what of it reaches a task
log, without slowing the command). The engine drives hooks through the contract
in :mod:`sandbox_provider.sandbox` and imports no backend and no consumer.
"""

from sandbox_provider.engine.options import SessionOptions
from sandbox_provider.engine.session import SandboxSession, task_holder

__all__ = ["SandboxSession", "SessionOptions", "task_holder"]
