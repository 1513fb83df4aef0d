"""The kernel: claiming and fencing, executing steps per effect class, waits,
budgets, evidence and AI tasks. Data flows one way: worker -> claim -> replay
-> execute step -> journal."""
