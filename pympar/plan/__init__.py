"""A layout planner: what a layout costs before the job runs (work in progress)."""
