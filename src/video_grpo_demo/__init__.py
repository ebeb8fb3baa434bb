"""The demo: what the embedded default run trains on, apart from the product.

- :mod:`~video_grpo_demo.tiny_models`: tiny random-weight Qwen and Nemotron checkpoints built
  locally (entry points ``video_grpo.models``: ``qwen2_5_vl``, ``qwen3_vl``);
- :mod:`~video_grpo_demo.synthetic`: synthetic clips with known content (colours, shapes, a
  frame-index barcode), the PyAV clip writer and seeded multiple-choice tasks;
- :mod:`~video_grpo_demo.rows`: rows of the ``video_mcqa`` and ``video_segments`` environments
  from those clips (entry points ``gym_video_env.row_generators``);
- :mod:`~video_grpo_demo.task`: the training loop's rows of a recipe's task (entry points
  ``video_grpo.tasks``: ``mcqa``, ``segments``, ``agentic``), with bad media mixed in from
- :mod:`~video_grpo_demo.bad_inputs`: a corpus of bad and unusual inputs with the outcome each
  layer owes;
- :mod:`~video_grpo_demo.commands`: ``video-grpo tiny-model`` and ``make-clips`` (entry points
  ``video_grpo.commands``).

It imports ``rl_bridge`` and ``gym_video_env``; they never import it: they find it through the
entry points above (``pyproject.toml``). Importing this package imports nothing else, so the Gym
environment (without the trainer's packages) can load :mod:`~video_grpo_demo.rows`.
"""
