"""Tests of the embedded rollout engine and its client."""
