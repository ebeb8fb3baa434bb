"""Where a run's roles run as processes: on this host (:mod:`.roles`, :mod:`.policy_ranks`) or as Ray
actors (:mod:`.ray_roles`)."""
