"""Gyre's exception hierarchy.

Every error a user can cause derives from `GyreError`; each boundary (CLI exit code, HTTP
response, MPI control message) turns these into its own shape in exactly one place.
`assert` is kept for internal invariants only.
"""

from __future__ import annotations


class GyreError(Exception):
    """Base class of all errors Gyre reports to users."""


class ConfigError(GyreError, ValueError):
    """A configuration value is missing, unknown or out of range.

    The message names the key path, the offending value and what is allowed.
    """


class ProtocolError(GyreError):
    """A peer (harness, engine, cell) sent something the protocol does not allow."""


class EngineError(GyreError):
    """A rollout engine failed or refused a request."""


class StoreError(GyreError):
    """The HDF5 trace store cannot be read or written as asked."""


class SchedulerError(GyreError):
    """An event is inconsistent with the scheduler's state."""


class TrainingError(GyreError, ValueError):
    """Training input is unusable (empty batch, missing reward, NaN log-probs, ...)."""


class HarnessError(GyreError):
    """A harness could not be prepared, started or supervised."""
