"""Where a run's roles run as processes, started by :func:`.launch.start_roles`: on this host
(:mod:`.local`, with :mod:`.policy_ranks` for a policy of several ranks) or as Ray actors
(:mod:`.ray_cluster`, planned against the cluster by :mod:`.ray_hardware`). Either returns the
:class:`.handles.Roles` the controller drives; :mod:`.vllm_servers` configures the vLLM servers."""
