"""The simulator: a serving loop over the scheduler's engine step, its clock and its figures."""
