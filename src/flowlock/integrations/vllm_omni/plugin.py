"""The vLLM plugin that puts every vLLM-Omni worker's native MiniMax-H3 DiT on flowlock's strict path.

vLLM-Omni's diffusion worker calls ``vllm.plugins.load_general_plugins()`` when it starts, which
runs every function registered under the ``vllm.general_plugins`` entry-point group (flowlock's
is :func:`register`). With the switch off (``FLOWLOCK_VLLM_OMNI`` unset or ``off``) it does nothing
and imports nothing. With ``FLOWLOCK_VLLM_OMNI=strict`` (or ``audit``) it wraps
``MiniMaxH3DiTModel.post_load_weights``, which vLLM-Omni's H3 pipeline calls on each DiT right after
its weights are loaded (and again after each full-weight sync): the wrapper runs the original
check, then ``flowlock.integrations.vllm_omni.install(model, mode)`` once per model. The worker code
is unchanged; the first forward already runs strict.

Refusals are loud: an unknown switch value raises ``ValueError`` naming the variable; a
vLLM-Omni without ``MiniMaxH3DiTModel.post_load_weights`` raises ``RuntimeError``; a model
``install`` refuses (a TP layout, a class) raises from the model load, so the worker fails to start
instead of sampling off the strict path. :func:`unregister` restores the original method and
removes every install made through the plugin.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref

SWITCH_ENV = "FLOWLOCK_VLLM_OMNI"
_MODES = ("strict", "audit")
_OFF = ("", "off")

_lock = threading.Lock()
_original = None
_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def switch_mode() -> str | None:
    """The mode ``FLOWLOCK_VLLM_OMNI`` asks for: ``"strict"``, ``"audit"`` or ``None`` (off)."""
    value = os.environ.get(SWITCH_ENV, "").strip().lower()
    if value in _OFF:
        return None
    if value not in _MODES:
        raise ValueError(f"{SWITCH_ENV} must be one of {_MODES} or unset / 'off', got {os.environ[SWITCH_ENV]!r}")
    return value


def _dit_class():
    try:
        from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel
    except ImportError as err:
        raise RuntimeError(f"{SWITCH_ENV} is on but vLLM-Omni's MiniMax-H3 DiT cannot be imported ({err})") from err
    if not callable(MiniMaxH3DiTModel.__dict__.get("post_load_weights")):
        raise RuntimeError(f"{SWITCH_ENV} is on but this vLLM-Omni's MiniMaxH3DiTModel has no post_load_weights "
                           "to install flowlock after loading (flowlock is tested against vllm-omni 0.30.0)")
    return MiniMaxH3DiTModel


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Safe to call more than once (vLLM may load plugins
    in several processes, and again in one); a no-op with the switch off."""
    global _original
    mode = switch_mode()
    if mode is None:
        return
    cls = _dit_class()
    with _lock:
        if _original is not None:
            return
        original = cls.__dict__["post_load_weights"]

        @functools.wraps(original)
        def post_load_weights(self):
            original(self)
            if self not in _handles:
                from flowlock.integrations.vllm_omni import install

                _handles[self] = install(self, mode=mode)

        cls.post_load_weights = post_load_weights
        _original = original


def installed(model) -> bool:
    """Whether the plugin installed flowlock on ``model``."""
    return model in _handles


def unregister() -> None:
    """Restore ``MiniMaxH3DiTModel.post_load_weights`` and remove the plugin's installs; a no-op when
    :func:`register` installed nothing."""
    global _original
    with _lock:
        if _original is None:
            return
        _dit_class().post_load_weights = _original
        _original = None
        handles = list(_handles.values())
        _handles.clear()
    for handle in handles:
        handle.remove()
