"""Tools over run directories: summaries, sweeps, scaling-law fits."""
