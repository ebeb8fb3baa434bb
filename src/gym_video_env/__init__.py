"""NeMo Gym side of video GRPO: media handlers (pluggy hooks), a video model server, video environments."""

from gym_video_env.hookspecs import MediaError, MediaSettings, hookimpl
from gym_video_env.plugins import get_plugin_manager

__all__ = ["MediaError", "MediaSettings", "get_plugin_manager", "hookimpl"]
