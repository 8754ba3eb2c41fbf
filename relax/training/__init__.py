"""Turning a step's samples into trainer inputs and the RL objective (config -> pure algorithms)."""
