"""
The stamps of a Kubernetes sandbox, as a mixin of
:class:`~sandbox_provider.hooks.kubernetes.hook.KubernetesSandboxHook`: the creation stamps are the
Pod's annotations, fixed at create; the holder of an attached sandbox joins them, written by a
compare-and-swap on the Pod's ``resourceVersion``, so two tasks attaching at once cannot both win
(:class:`~sandbox_provider.sandbox.attach.Attachable` reads the stamps, then writes the holder: here the
write fails when anything changed since the read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sandbox_provider.hooks.kubernetes import driver
from sandbox_provider.sandbox.attach import expiry_of
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    EXPIRES_AT_TAG,
    HOLDER_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    TRACE_TAGS,
    WORKDIR_TAG,
)

__all__ = ["FIXED_STAMPS", "KubernetesStamps"]

#: Stamps fixed when the Pod is created.
FIXED_STAMPS = (OWNER_TAG, EXPIRES_AT_TAG, NETWORK_TAG, WORKDIR_TAG, *TRACE_TAGS)
#: Times a compare-and-swap of the stamps is retried when only the Pod's status moved under it.
CAS_ATTEMPTS = 5


class KubernetesStamps:
    """Mixin: ``read_tags`` and ``write_tags`` over the Pod's annotations; put it before ``Attachable``."""

    if TYPE_CHECKING:
        _pods: dict[str, dict[str, Any]]
        _known_expiry: dict[str, float]

        def _api(self) -> tuple[Any, Any]: ...
        def _resolved(self) -> dict[str, Any]: ...
        def _read_pod(self, name: str, doing: str) -> dict[str, Any]: ...
        def _json(self, response: Any) -> dict[str, Any]: ...
        def _api_error(self, err: Any, doing: str, handle: str | None) -> SandboxError: ...
        def check_handle(self, handle: Any) -> str: ...

    def read_tags(self, handle: str) -> Mapping[str, str]:
        """
        Return the sandbox's stamps: its Pod's annotations (the creation stamps, and the holder).

        :raises SandboxTerminalError: if the sandbox is missing or has ended.
        """
        handle = self.check_handle(handle)
        pod = self._read_pod(handle, f"reading the stamps of sandbox {handle}")
        meta = pod["metadata"]
        if (meta.get("labels") or {}).get(driver.SANDBOX_LABEL) != handle:
            raise SandboxTerminalError(f"Pod {handle!r} was not created by this provider; it cannot be used.")
        if not driver.is_running(pod):
            raise SandboxTerminalError(
                f"Sandbox {handle} has ended: {driver.pod_problem(pod) or 'it is being deleted'}."
            )
        self._pods[handle] = meta
        tags = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items() if k.startswith("airflow_")}
        expires = expiry_of(tags)
        if expires is not None:
            self._known_expiry[handle] = expires
        return tags

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """
        Replace the sandbox's changeable stamps (the holder) with those in ``tags``, as a
        compare-and-swap: the write names the Pod's ``resourceVersion`` that :meth:`read_tags` saw,
        so the API server refuses it when anything changed since. When only the Pod's status moved
        (the changeable stamps are still what was read), the swap is tried again on the new version.

        :raises SandboxTerminalError: if another writer changed the stamps since they were read (two
            tasks attaching at once: one wins), if ``tags`` changes a stamp fixed at create, or if the
            sandbox is gone.
        """
        handle = self.check_handle(handle)
        meta = self._pods.get(handle) or self._read_pod(handle, f"reading the stamps of sandbox {handle}")["metadata"]
        seen = dict(meta.get("annotations") or {})
        for key in FIXED_STAMPS:
            if seen.get(key) != tags.get(key):
                raise SandboxTerminalError(
                    f"Stamp {key!r} of Kubernetes sandbox {handle!r} is fixed when the sandbox is provisioned "
                    f"({seen.get(key)!r}); only the holder and other stamps can change afterwards."
                )
        changes = _annotation_changes(seen, tags)
        for _ in range(CAS_ATTEMPTS):
            if self._swap(handle, meta["resourceVersion"], changes):
                return
            fresh = self._read_pod(handle, f"reading the stamps of sandbox {handle}")["metadata"]
            if _changeable(fresh.get("annotations") or {}) != _changeable(seen):
                holder = (fresh.get("annotations") or {}).get(HOLDER_TAG)
                raise SandboxTerminalError(
                    f"Sandbox {handle!r} was claimed by {holder!r} while this task was attaching. Two tasks asked "
                    "for it at once; provision one sandbox per task, or run them one after another."
                )
            meta = fresh
        raise SandboxTerminalError(f"The stamps of sandbox {handle!r} kept changing; try again.")

    def _swap(self, handle: str, version: str, changes: Mapping[str, str | None]) -> bool:
        """The merge patch of ``changes`` at ``version``; False when the Pod has moved on (409)."""
        from kubernetes.client.exceptions import ApiException

        core, _ = self._api()
        body = {"metadata": {"resourceVersion": version, "annotations": dict(changes)}}
        try:
            patched = core.patch_namespaced_pod(
                handle,
                self._resolved()["namespace"],
                body,
                _preload_content=False,
                _content_type="application/merge-patch+json",
            )
        except ApiException as err:
            if err.status == 409:
                return False
            raise self._api_error(err, f"writing the stamps of sandbox {handle}", handle) from err
        self._pods[handle] = self._json(patched)["metadata"]
        return True


def _changeable(annotations: Mapping[str, Any]) -> dict[str, str]:
    """The stamps that may change after create (the holder), from a Pod's annotations."""
    return {k: str(v) for k, v in annotations.items() if k.startswith("airflow_") and k not in FIXED_STAMPS}


def _annotation_changes(seen: Mapping[str, Any], tags: Mapping[str, str]) -> dict[str, str | None]:
    """The merge-patch annotations that turn the changeable stamps ``seen`` into those of ``tags`` (None removes)."""
    now, wanted = _changeable(seen), _changeable(tags)
    changes: dict[str, str | None] = {k: v for k, v in wanted.items() if now.get(k) != v}
    changes.update({k: None for k in now if k not in wanted})
    return changes
