"""Megatron-Core policy through Megatron-Bridge: model build, forward, and the host support it needs.

Modules:

* :mod:`.te_standin`: import ``megatron.bridge`` where Transformer Engine is not installed;
* :mod:`.cpu_support`: run megatron-core on a host without CUDA (a no-op with CUDA);
* :mod:`.distributed`: the process group and Megatron's parallel state from torchrun's
  environment (NCCL on GPUs, gloo on CPU; TP and DP);
* :mod:`.attention`: a ``scaled_dot_product_attention`` core attention for the local layer spec;
* :mod:`.vision_attention`: the HF vision tower's windowed attention, one call per window size;
* :mod:`.model`: build the policy from an HF checkpoint (``AutoBridge``) and compute its logits;
* :mod:`.logprobs`: per-token log-probabilities from (vocabulary-parallel) logits;
* :mod:`.batch`: policy samples and their collation into right-padded micro-batches;
* :mod:`.policy`: the trainable policy (logprobs, training step) and what it composes:
  :mod:`.policy_config` (its settings), :mod:`.policy_loss` (the loss interface and step metrics),
  :mod:`.optimizer` (Megatron's Adam, fused kernels), :mod:`.hf_export` (HF-named weights to
  safetensors or to vLLM servers) and :mod:`.checkpoint` (training checkpoints and RNG state).

Importing this package imports neither megatron-core nor Megatron-Bridge.
"""
