"""Refit, the trainer's side: put the policy's current weights into running vLLM servers.

Modules:

* :mod:`.client`: :class:`~.client.RefitClient`, the HTTP control plane of one server (pause,
  reload from disk or drive an in-memory transfer, reset caches, stamp the weight version,
  resume; sleep and wake for colocated placement). Imports without vLLM.
* :mod:`.sync`: :class:`~.sync.WeightSync`, one policy rank's in-memory connection to one server
  through vLLM's weight-transfer API, and the policy's weights as its ``WeightSource``;
* :mod:`.engines`: the trainer half of the CPU ``video_grpo_gloo`` transfer;
* :mod:`.legacy_engines`: trainer halves of vLLM's ``ipc`` and ``nccl`` engines for releases
  without them.

The vLLM side (the worker engine that receives) is :mod:`vllm_video_plugin.refit_receiver`.
"""
