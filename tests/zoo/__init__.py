"""A zoo of ordinary Pyro models, each with an independent reference posterior, run through every engine."""
