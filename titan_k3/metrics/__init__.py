"""Run directory, metrics and events: everything a run reports, recomputable from its files."""
