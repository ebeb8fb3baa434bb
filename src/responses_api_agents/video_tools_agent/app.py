"""``video_tools_agent``: a tool loop whose tools may return video, which the next model turn sees.

Like Gym's ``simple_agent`` (model call, tool calls against the resources server, repeat until
the model answers without a tool call or ``max_steps`` model calls were made, then ``/verify``),
with two differences:

- a tool route may answer ``{"output": [content parts]}`` (``input_text``, ``input_video``,
  ``input_image``); the parts become the ``function_call_output``, and its media move into a user
  message directly after it (the ``relocate_tool_output_media`` hook of ``gym_video_env``). The
  trajectory holds exactly the items the model was prompted with, so a trainer can rebuild each
  turn's media. Any other answer is passed on as text, as ``simple_agent`` does;
- with ``observation_route`` set, a model turn without tool calls does not end the loop at once:
  the agent asks that resources-server route for the next observation (``{"output": [content
  parts]}``, e.g. the next clip of a video) and adds it as a user message, as Gym's
  ``image_tools_agent`` does with crops. An empty ``output`` ends the loop. Environments push new
  clips this way whether or not the model calls tools, also after a turn cut at
  ``max_output_tokens``.

A model call after the first that the model server refuses because the trajectory outgrew the
model's context (vLLM's 400 "maximum context length") is a failure the policy caused: the episode
ends there, ``/verify`` is not called, and ``/run`` answers the trajectory so far with
``reward: policy_fault_reward`` and ``policy_fault: "context_overflow"``, so a trainer scores it
instead of dropping it. (The first call's overflow is the prompt's: a bad row, answered as below.)

An inner server's refusal of the row itself (HTTP 4xx other than 408 and 429: e.g. the model
server or vLLM refusing a video that does not decode) is answered with that status and body,
where Gym's agents answer 500: callers can tell a bad row, which retrying cannot fix, from a
failing server. With ``max_steps: 1`` and no ``observation_route`` the agent is ``simple_agent``
with that difference. ``seed_session: false`` skips ``/seed_session`` for a resources server
that keeps no state per episode. ``first_call_params`` adds request fields to the first model
call only (e.g. a structured-outputs choice that makes the first turn an action).

``model_servers`` lists replicas of ``model_server`` (the same server as separate processes, each
with its own port): each trajectory makes all its model calls to the one its prompt hashes to
(:mod:`gym_video_env.affinity`), so a GRPO group's identical first turns meet in one model-server
process, which can coalesce them, where uvicorn workers sharing a port would split them at random.
A request whose ``metadata`` names a replica (``model_replica``: an index into that list, removed
before the model call) goes to that one instead: a rollout client that deals a group's samples over
several agent replicas keeps the group on one model server that way. A name that is no index, or an
index past the list, is answered HTTP 400 naming it.

The returned response's ``output`` is the whole trajectory after the prompt (assistant turns with
vLLM's token ids, tool calls, tool outputs and the user messages carrying the clips).
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import ClientResponseError
from fastapi import FastAPI, HTTPException, Request, Response
from nemo_gym.base_resources_server import BaseRunRequest, BaseVerifyResponse
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, Body, SimpleResponsesAPIAgent
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.server_utils import get_response_json, is_nemo_gym_fastapi_entrypoint, raise_for_status
from pydantic import ConfigDict, PositiveInt

from gym_video_env import MediaSettings
from gym_video_env.affinity import MODEL_REPLICA_KEY, pick, prompt_key, take_model_replica
from gym_video_env.request_media import relocate_tool_outputs


class VideoToolsAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    model_servers: list[ModelServerRef] = []
    """Replicas of ``model_server``; a trajectory's model calls all go to the one of
    ``[model_server, *model_servers]`` that its prompt hashes to."""
    max_steps: PositiveInt = 8
    """Most model calls per trajectory."""
    observation_route: str | None = None
    """Resources-server route (e.g. ``/next_segment``) asked for the next observation after a model
    turn without tool calls. ``None``: such a turn ends the trajectory."""
    policy_fault_reward: float = 0.0
    """Reward of a trajectory that ended in a policy fault (its context outgrew the model's)."""
    seed_session: bool = True
    """Call the resources server's ``/seed_session`` with the row before the episode, as Gym's
    agents do. ``False`` for a resources server that keeps no state per episode (its
    ``seed_session`` is Gym's, which does nothing): one request a sample fewer."""
    first_call_params: dict[str, Any] | None = None
    """Request fields merged into the first model call only (a dict value such as ``metadata`` is
    merged key by key), e.g. ``{"metadata": {"extra_body": "<json>"}}``, which Gym's model server
    merges into its request to vLLM: a first turn decoded under its own structured-outputs choice
    (an action, not a blind answer). ``None``: every call is made with the row's parameters."""


class VideoToolsAgentRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")


class VideoToolsAgentVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class VideoToolsAgent(SimpleResponsesAPIAgent):
    ray_enabled = False
    config: VideoToolsAgentConfig

    def setup_exception_middleware(self, app: FastAPI) -> None:
        """Answer an inner server's refusal of the row with its own 4xx status and body (see the
        module docstring); every other error as Gym's middleware does."""

        @app.middleware("http")
        async def inner_refusal_middleware(request: Request, call_next: Any) -> Response:
            try:
                return await call_next(request)
            except ClientResponseError as error:
                content = getattr(error, "response_content", None)
                if content is None or not 400 <= error.status < 500 or error.status in _RETRYABLE_4XX:
                    raise
                return Response(content=content, status_code=error.status, media_type="application/json")

        super().setup_exception_middleware(app)

    async def responses(
        self,
        request: Request,
        response: Response,
        body: NeMoGymResponseCreateParamsNonStreaming = Body(),  # noqa: B008 (FastAPI)
    ) -> NeMoGymResponse:
        result, model_cookies, _ = await self._episode(
            body.model_dump(mode="json", exclude_unset=True),
            model_cookies=request.cookies,
            resources_cookies=request.cookies,
        )
        for key, value in model_cookies.items():
            response.set_cookie(key, value)
        return NeMoGymResponse.model_validate(result)

    async def run(self, request: Request, body: VideoToolsAgentRunRequest) -> VideoToolsAgentVerifyResponse:
        row = body.model_dump(mode="json")
        resources_cookies = dict(request.cookies)
        if self.config.seed_session:
            seeded = await self.server_client.post(
                server_name=self.config.resources_server.name,
                url_path="/seed_session",
                json=row,
                cookies=request.cookies,
            )
            await raise_for_status(seeded)
            resources_cookies = _cookies(seeded)
        result, _, policy_fault = await self._episode(
            body.responses_create_params.model_dump(mode="json", exclude_unset=True),
            model_cookies=request.cookies,
            resources_cookies=resources_cookies,
        )
        if policy_fault is not None:
            return VideoToolsAgentVerifyResponse.model_validate(
                {
                    **row,
                    "response": result,
                    "reward": self.config.policy_fault_reward,
                    "policy_fault": policy_fault,
                }
            )
        verified = await self.server_client.post(
            server_name=self.config.resources_server.name,
            url_path="/verify",
            json={**row, "response": result},
            cookies=resources_cookies,
        )
        await raise_for_status(verified)
        # The verifier's answer is checked against the response model and passed on as it came:
        # not parsed into Python objects and serialized again (a trajectory's token ids and
        # logprobs are most of it). FastAPI sends a returned Response as it is.
        content = await verified.read()
        VideoToolsAgentVerifyResponse.model_validate_json(content)
        return Response(content=content, media_type="application/json")

    async def _episode(
        self, params: dict[str, Any], *, model_cookies: Any, resources_cookies: dict[str, str]
    ) -> tuple[dict[str, Any], dict[str, str], str | None]:
        """Run the loop for the request ``params``: the last model response with the whole
        trajectory, the model server's cookies, and the policy fault that ended it (or ``None``)."""
        servers = [self.config.model_server, *self.config.model_servers]
        try:  # a request naming a replica this agent lacks is the client's error: HTTP 400
            params, named = take_model_replica(params)
            if named is not None and named >= len(servers):
                raise ValueError(
                    f"metadata {MODEL_REPLICA_KEY}={named}: the agent has {len(servers)} model servers"
                )
        except ValueError as error:
            raise HTTPException(status_code=400, detail=str(error)) from error
        prompt = params["input"]
        prompt_items = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if named is None:
            named = pick(prompt_key(prompt_items), len(servers)) if len(servers) > 1 else 0
        model_server = servers[named].name
        trajectory: list[dict[str, Any]] = []
        usage: dict[str, int] = {}
        last: dict[str, Any] | None = None
        policy_fault: str | None = None
        for call in range(self.config.max_steps):
            request_body = {**params, "input": prompt_items + trajectory}
            if call == 0 and self.config.first_call_params:
                request_body = _merged(request_body, self.config.first_call_params)
            answer = await self.server_client.post(
                server_name=model_server,
                url_path="/v1/responses",
                json=request_body,
                cookies=model_cookies,
            )
            if last is not None and answer.status == 400:
                content = await answer.content.read()
                if _CONTEXT_OVERFLOW.search(content.decode(errors="replace")):
                    policy_fault = "context_overflow"
                    break
                await raise_for_status(answer, content)
            await raise_for_status(answer)
            model_cookies = _cookies(answer)
            last = await get_response_json(answer)
            trajectory += last["output"]
            _add_usage(usage, last.get("usage"))
            calls = [item for item in last["output"] if item.get("type") == "function_call"]
            if calls:
                outputs = [await self._call_tool(call, resources_cookies) for call in calls]
                trajectory += relocate_tool_outputs(outputs, MediaSettings())
                continue
            observation = await self._observation(resources_cookies)
            if not observation:
                break
            trajectory.append({"type": "message", "role": "user", "content": observation})
        assert last is not None  # max_steps >= 1
        # The last response's usage shape, with the token counts of all turns.
        total_usage = {**last["usage"], **usage} if last.get("usage") else None
        return {**last, "output": trajectory, "usage": total_usage}, model_cookies, policy_fault

    async def _observation(self, cookies: dict[str, str]) -> list[dict[str, Any]]:
        """The next observation's content parts from ``observation_route`` (none when it is unset)."""
        if self.config.observation_route is None:
            return []
        answer = await self.server_client.post(
            server_name=self.config.resources_server.name,
            url_path=self.config.observation_route,
            json={},
            cookies=cookies,
        )
        await raise_for_status(answer)
        cookies.update(_cookies(answer))
        payload = await get_response_json(answer)
        output = payload.get("output") if isinstance(payload, dict) else None
        if not isinstance(output, list):
            raise TypeError(
                f"{self.config.resources_server.name}{self.config.observation_route} answered {payload!r}; "
                'an observation route must answer {"output": [content parts]}'
            )
        return output

    async def _call_tool(self, call: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        """The ``function_call_output`` of one call: the tool's content parts, or its answer as text."""
        try:
            arguments = json.loads(call["arguments"])
        except json.JSONDecodeError as error:
            return _tool_output(call, f"Invalid tool call arguments: {error}")
        answer = await self.server_client.post(
            server_name=self.config.resources_server.name,
            url_path=f"/{call['name']}",
            json=arguments,
            cookies=cookies,
        )
        cookies.update(_cookies(answer))
        text = (await answer.content.read()).decode()
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            return _tool_output(call, text)
        if answer.ok and isinstance(payload, dict) and isinstance(payload.get("output"), list):
            return _tool_output(call, payload["output"])
        return _tool_output(call, text)


# vLLM's refusals of a prompt longer than the model's context (chat completions and the
# multimodal input processor word it differently).
_CONTEXT_OVERFLOW = re.compile(r"maximum context length|longer than the maximum model length", re.IGNORECASE)

# Request Timeout and Too Many Requests: the server, not the row, failed.
_RETRYABLE_4XX = frozenset({408, 429})


def _merged(body: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``body`` with ``extra``'s fields; a field that is a dict in both is merged key by key."""
    merged = dict(body)
    for key, value in extra.items():
        current = merged.get(key)
        merged[key] = {**current, **value} if isinstance(current, dict) and isinstance(value, dict) else value
    return merged


def _tool_output(call: dict[str, Any], output: str | list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call["call_id"], "output": output}


def _cookies(response: Any) -> dict[str, str]:
    return {str(name): str(getattr(morsel, "value", morsel)) for name, morsel in response.cookies.items()}


def _add_usage(total: dict[str, int], usage: dict[str, Any] | None) -> None:
    """Add a response's token counts (``input_tokens``, ``output_tokens``, ``total_tokens``) to ``total``."""
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        if usage and isinstance(usage.get(key), int):
            total[key] = total.get(key, 0) + usage[key]


if __name__ == "__main__":
    VideoToolsAgent.run_webserver()
elif is_nemo_gym_fastapi_entrypoint(__file__):  # a uvicorn worker (rollout.gym_workers > 1)
    app = VideoToolsAgent.run_webserver()
