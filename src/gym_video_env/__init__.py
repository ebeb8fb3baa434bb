"""NeMo Gym side of video GRPO: media handlers (pluggy hooks), a video model server, video environments."""

from gym_video_env.hookspecs import hookimpl

__all__ = ["hookimpl"]
