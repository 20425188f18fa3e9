"""Typed errors raised for bad user input; the CLI prints their message and exits non-zero."""
from __future__ import annotations


class SsmspecError(Exception):
    """Base of every user-facing error: the message says what went wrong and what to do."""


class ModelLoadError(SsmspecError):
    """A model directory is missing, malformed, or in a format ssmspec does not read."""


class TokenizerMismatchError(SsmspecError):
    """Two models that must share a vocabulary (target and drafter, teacher and student) do not."""


class InputError(SsmspecError):
    """A bad argument value: empty prompt, negative temperature, and the like."""


class DataError(SsmspecError):
    """A training data file that cannot be read or holds malformed records."""


class ProfileMismatchError(SsmspecError):
    """A profile.json measured on another model architecture or dtype than the one in use."""


class CodePathError(SsmspecError):
    """A code-path setting that is not understood (a backend name, SSMSPEC_STREAM_LAYERS), or a
    kernel asked for explicitly that cannot run or build here."""


class ResourceError(SsmspecError):
    """A run that would not fit: more memory than the device has, a longer text than the model's context."""
