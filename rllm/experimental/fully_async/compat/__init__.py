"""Compatibility with rLLM's original fully-async module (its protocol types and rollout-function contract)."""
