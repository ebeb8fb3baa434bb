"""Start, health-check and stop the processes a run needs: vLLM servers and Gym servers."""

from rl_bridge.services.process import ManagedProcess, ServiceError, free_port, wait_for_http

__all__ = ["ManagedProcess", "ServiceError", "free_port", "wait_for_http"]
