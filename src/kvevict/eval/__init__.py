"""Quality under a KV budget: tasks, metrics, the grid runner and its report."""
