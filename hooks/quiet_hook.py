"""The base of our hooks: classy_vision's ClassyHook makes every hook name each event VISSL's trainer runs."""

from __future__ import annotations

from classy_vision.hooks import ClassyHook


class QuietHook(ClassyHook):
    """Does nothing at each of VISSL's events (``vissl.hooks.SSLClassyHookFunctions``); a hook overrides those it
    acts on, so that it reads as what it does."""

    on_start = ClassyHook._noop
    on_phase_start = ClassyHook._noop
    on_forward = ClassyHook._noop
    on_loss_and_meter = ClassyHook._noop
    on_backward = ClassyHook._noop
    on_update = ClassyHook._noop
    on_step = ClassyHook._noop
    on_phase_end = ClassyHook._noop
    on_end = ClassyHook._noop
    on_exception = ClassyHook._noop
