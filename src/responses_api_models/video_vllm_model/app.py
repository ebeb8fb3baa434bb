"""``video_vllm_model``: Gym's vLLM model server with video handling from ``gym_video_env``.

Every ``vllm_model`` flag works as there; :class:`VideoVLLMModelConfig` adds the video flags
(documented in ``configs/video_vllm_model.yaml``). On top of the stock server:

- ``/v1/responses`` bodies are prepared before Gym validates them
  (:func:`gym_video_env.request_media.prepare_request_media`): media in tool outputs are moved
  into a following user message (or rejected, by policy), every media part is checked against the
  media root and size limits and converted by the installed media handlers (pluggy hooks of
  ``gym_video_env``). A rejected part gives HTTP 400 whose message names the part and the reason;
  the server keeps serving.
- Requests to vLLM carry the video sampling contract as per-request ``media_io_kwargs`` when
  ``send_media_io_kwargs`` is on (vLLM needs ``--trust-request-mm-kwargs``), plus any configured
  ``mm_processor_kwargs``; the ``/tokenize`` fallback for prompt token ids gets the same media kwargs.
- Responses carry the contract (canonical JSON) in ``metadata["video_sampling_contract"]``, so a
  trainer knows how the frames of a trajectory were sampled.
- A request vLLM refuses (HTTP 4xx: a video that does not decode, a ``file://`` URL outside its
  allowed path, a decode limit) is answered with vLLM's status and error body, not as a server
  error (the stock server does this for context-length errors only). When vLLM names the media by
  content only (``<bytes sha256:...>``), the message names the input as the request did too: its
  path relative to ``media_root``, or its URL (:func:`gym_video_env.request_media.name_media_error`).
- ``vllm_connection_retries`` bounds the retries of a vanished vLLM (the stock server retries
  forever unless it follows an endpoint file): a caller that supervises vLLM decides instead
  whether to restart it, re-dispatch, or stop sending an input that kills it, and an input that
  does is not replayed into every restarted vLLM.
- ``coalesce_window_ms`` sends identical chat completions that arrive within that window (a GRPO
  group's first turns) to vLLM as one request with ``n`` choices, one for each caller
  (:mod:`gym_video_env.coalesce`); ``GET /coalescing`` answers its counters, summed over the
  vLLM servers (how many requests went out full, how far apart each batch's callers arrived).
  A request whose ``metadata`` declares it one of a group's ``G`` samples
  (:func:`gym_video_env.coalesce.group_metadata`, with or without a window) goes to vLLM with
  ``n = G`` when the group's first sample arrives; the group's other samples take its other choices.
- ``route_by_prompt`` sends each conversation to the vLLM server its prompt hashes to
  (:mod:`gym_video_env.affinity`) instead of the one its session id hashes to: a group's samples
  meet on one server, where their first turns can be coalesced and their clip is processed once.
  Either way no per-session table grows with the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from aiohttp.client_exceptions import ClientResponseError
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from nemo_gym.base_responses_api_model import Body
from nemo_gym.openai_utils import (
    NeMoGymChatCompletion,
    NeMoGymChatCompletionCreateParamsNonStreaming,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
)
from nemo_gym.server_utils import is_nemo_gym_fastapi_entrypoint
from pydantic import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    PrivateAttr,
    field_validator,
    model_validator,
)
from responses_api_models.vllm_model.app import (
    _PROPAGATE_CONTEXT_ERROR_ATTRIBUTE,  # the stock server's marker for "answer with vLLM's status"
    VLLMModel,
    VLLMModelConfig,
)

from gym_video_env import MediaSettings
from gym_video_env.affinity import pick, prompt_key
from gym_video_env.coalesce import CoalescingClient, check_max_wait, merged_stats
from gym_video_env.plugins import get_plugin_manager
from gym_video_env.request_media import (
    MediaRequestError,
    ToolOutputMediaPolicy,
    chat_media_urls,
    name_media_error,
    prepare_request_media,
)
from vllm_video_plugin.contract import VideoSamplingContract

CONTRACT_METADATA_KEY = "video_sampling_contract"


class VideoVLLMModelConfig(VLLMModelConfig):
    """``vllm_model``'s config plus the video flags."""

    media_root: str | None = None
    """Directory every local media file (``path``, ``file://`` URL, frame manifest) must resolve
    into. ``None``: local files are rejected. vLLM's ``--allowed-local-media-path`` must cover it."""
    max_video_bytes: PositiveInt | None = None
    """Largest video file or inline video, in bytes. ``None``: no limit."""
    max_image_bytes: PositiveInt | None = None
    """Largest image file or inline image, in bytes. ``None``: no limit."""
    allow_remote_media_urls: bool = False
    """Pass ``http(s)://`` media URLs on to vLLM (which fetches them)."""
    tool_output_media: ToolOutputMediaPolicy = "relocate"
    """Media inside a ``function_call_output``: ``relocate`` into a user message right after it,
    or ``reject`` the request."""
    video_sampling_contract: dict[str, Any] | None = None
    """Fields of a ``vllm_video_plugin.contract.VideoSamplingContract``. ``None``: vLLM's own
    sampling applies and responses carry no contract."""
    send_media_io_kwargs: bool = False
    """Send the contract to vLLM on every request as ``media_io_kwargs`` (vLLM must run with
    ``--trust-request-mm-kwargs``). Off: vLLM's ``--media-io-kwargs`` must hold the same contract."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Sent to vLLM on every request as ``mm_processor_kwargs`` (needs ``--trust-request-mm-kwargs``)."""
    vllm_connection_retries: NonNegativeInt | None = None
    """Connection-error retries of one request to vLLM (0.5 s apart) before it fails with HTTP 500.
    ``None``: Gym's default, retry until vLLM answers again."""
    coalesce_window_ms: NonNegativeFloat = 0.0
    """Hold the first of identical chat completions this long; those that arrive meanwhile go to
    vLLM as one request with ``n`` choices, one for each caller (``gym_video_env.coalesce``: a
    GRPO group's first turns). 0: every request goes alone."""
    coalesce_max_n: PositiveInt = 64
    """Most choices in one coalesced request."""
    coalesce_max_wait_ms: NonNegativeFloat = 0.0
    """If set (at least ``coalesce_window_ms``), the window restarts at each identical request: a
    batch goes ``coalesce_window_ms`` after its last caller, at the latest this long after its
    first. 0: the window is fixed, from the first caller."""
    route_by_prompt: bool = False
    """With several vLLM servers (``base_url`` a list), send each conversation to the one its
    prompt (the messages before the first assistant turn) hashes to, so a GRPO group's samples meet
    on one server (``gym_video_env.affinity``). Off: Gym's routing, by a hash of the session id
    (a group's samples spread over the servers)."""

    @field_validator("video_sampling_contract")
    @classmethod
    def _check_contract(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            VideoSamplingContract.model_validate(value)
        return value

    @field_validator("media_root")
    @classmethod
    def _check_media_root(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_dir():
            raise ValueError(f"media_root {value!r} is not a directory")
        return value

    @model_validator(mode="after")
    def _check_coalescing(self) -> VideoVLLMModelConfig:
        check_max_wait(self.coalesce_window_ms, self.coalesce_max_wait_ms)
        return self


class VideoVLLMModel(VLLMModel):
    """The model server; see the module docstring."""

    config: VideoVLLMModelConfig

    # vLLM's /tokenize must sample frames as the generation did, or the prompt token ids differ.
    _TOKENIZE_CHAT_FIELDS: ClassVar[tuple[str, ...]] = (*VLLMModel._TOKENIZE_CHAT_FIELDS, "media_io_kwargs")
    # Gym's model-call capture leaves this route out: it reads counters, it generates nothing.
    non_generating_model_routes: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        getattr(VLLMModel, "non_generating_model_routes", ())
    ) | {("GET", "/coalescing")}
    _media_settings: MediaSettings = PrivateAttr()
    _contract: VideoSamplingContract | None = PrivateAttr(default=None)
    _contract_json: str | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        config = self.config
        self._media_settings = MediaSettings(
            media_root=Path(config.media_root) if config.media_root is not None else None,
            max_video_bytes=config.max_video_bytes,
            max_image_bytes=config.max_image_bytes,
            allow_remote_urls=config.allow_remote_media_urls,
        )
        if config.video_sampling_contract is not None:
            self._contract = VideoSamplingContract.model_validate(config.video_sampling_contract)
            self._contract_json = self._contract.canonical_json()  # every response carries it
        # The media handlers' entry points are found, loaded and checked now: a misconfigured
        # plugin stops the server at start-up, and the first rollout does not pay for the search.
        get_plugin_manager()
        super().model_post_init(context)
        if config.vllm_connection_retries is not None:
            for client in self._clients:
                client.max_connection_retries = config.vllm_connection_retries
        # Always wrapped: a request may declare its group (gym_video_env.coalesce.group_metadata);
        # without a window the others pass through.
        self._clients = [
            CoalescingClient(
                client,
                window_s=config.coalesce_window_ms / 1000,
                max_n=config.coalesce_max_n,
                max_wait_s=config.coalesce_max_wait_ms / 1000 if config.coalesce_max_wait_ms else None,
            )
            for client in self._clients
        ]

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.get("/coalescing")(self.coalescing)
        return app

    async def coalescing(self) -> dict[str, Any]:
        """The coalescing counters (:meth:`CoalescingClient.stats`) summed over the vLLM servers;
        ``enabled``: whether the window is on (declared groups are coalesced either way)."""
        return {
            "enabled": self.config.coalesce_window_ms > 0,
            **merged_stats(client.stats() for client in self._clients),
        }

    async def responses_dispatch(self, request: Request, body: dict = Body()):  # noqa: B008 (FastAPI)
        """Prepare the media of the raw body, then serve it as the stock server does."""
        try:
            body = prepare_request_media(
                body, self._media_settings, tool_output_media=self.config.tool_output_media
            )
        except MediaRequestError as error:
            return JSONResponse(
                status_code=400,
                content={
                    "error": {
                        "message": str(error),
                        "type": "invalid_request_error",
                        "param": error.location,
                        "code": "invalid_media",
                    }
                },
            )
        return await super().responses_dispatch(request, body)

    async def responses(
        self,
        request: Request,
        body: NeMoGymResponseCreateParamsNonStreaming = Body(),  # noqa: B008 (FastAPI)
    ) -> NeMoGymResponse:
        response = await super().responses(request, body)
        if self._contract_json is not None:
            response.metadata = {**(response.metadata or {}), CONTRACT_METADATA_KEY: self._contract_json}
        return response

    async def chat_completions(
        self,
        request: Request,
        body: NeMoGymChatCompletionCreateParamsNonStreaming = Body(),  # noqa: B008 (FastAPI)
    ) -> NeMoGymChatCompletion:
        """The stock call, with vLLM's client errors (4xx) passed on as they are (see the module)."""
        if self.config.route_by_prompt and len(self._clients) > 1:
            request.state.video_grpo_server = pick(prompt_key(body.messages), len(self._clients))
        try:
            return await super().chat_completions(request, body)
        except ClientResponseError as error:
            if 400 <= error.status < 500:
                self._name_media_input(error, body)
                # The stock middleware then answers with vLLM's status and body.
                setattr(error, _PROPAGATE_CONTEXT_ERROR_ATTRIBUTE, True)
            raise

    def _resolve_client(self, request: Request) -> Any:
        """The server chosen by prompt in :meth:`chat_completions`, or the stock choice by session.

        The stock server remembers each session's server, a stable hash of the session id, for
        its lifetime: one entry for every rollout it ever served. The hash is recomputed instead
        (the same server), so the server's memory does not grow with the run.
        """
        index = getattr(request.state, "video_grpo_server", None)
        if index is not None:
            return self._clients[index]
        client = super()._resolve_client(request)
        getattr(self, "_session_id_to_client", {}).clear()
        return client

    def _name_media_input(self, error: ClientResponseError, body: Any) -> None:
        """Name the failing media input in vLLM's error body (``error.response_content``)."""
        content = getattr(error, "response_content", None)
        try:
            document = json.loads(content) if content else None
        except ValueError:
            return
        if not isinstance(document, dict):
            return
        holder = document.get("error") if isinstance(document.get("error"), dict) else document
        message = holder.get("message")
        if not isinstance(message, str):
            return
        messages = body.model_dump(mode="json").get("messages", []) if hasattr(body, "model_dump") else []
        named = name_media_error(message, chat_media_urls(messages), self._media_settings)
        if named != message:
            holder["message"] = named
            error.response_content = json.dumps(document).encode()

    def _preprocess_chat_completion_create_params(
        self, request: Request, body_dict: dict[str, Any]
    ) -> dict[str, Any]:
        body_dict = super()._preprocess_chat_completion_create_params(request, body_dict)
        if self._contract is not None and self.config.send_media_io_kwargs:
            body_dict["media_io_kwargs"] = {"video": self._contract.to_media_io_kwargs()}
        if self.config.mm_processor_kwargs:
            body_dict["mm_processor_kwargs"] = dict(self.config.mm_processor_kwargs)
        return body_dict


if __name__ == "__main__":
    VideoVLLMModel.run_webserver()
elif is_nemo_gym_fastapi_entrypoint(__file__):  # a uvicorn worker (rollout.gym_workers > 1)
    app = VideoVLLMModel.run_webserver()
