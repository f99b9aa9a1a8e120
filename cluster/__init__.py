"""The Ray side: controller, instances per region and role, planner, simulator."""
