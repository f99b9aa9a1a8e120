"""The Ray side: the cluster config, the controller (instances per region and role,
health checks and replacement, planning and role flips) and the P:D planner."""
