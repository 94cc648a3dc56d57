"""The launcher floor: ``rl`` itself, its config and checks before a run, the processes it starts; above the three
process packages, whose configs it imports."""
