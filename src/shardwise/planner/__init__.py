"""The planner: the real runtime run on fake tensors in a fake world of N ranks, traced, so a
plan predicts per-rank memory and bytes before launch (`plan.plan`, also `shardwise.plan`), and
under a budget picks each unit's settings (`budget`, priced by `costs`)."""
