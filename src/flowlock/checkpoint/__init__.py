"""diffusers <-> vLLM-Omni native checkpoints of MiniMax-H3: names, layouts, streaming conversion.

Knows names and layouts only: no engine is imported. The directory machinery (streaming, atomic
publication, manifest) lives at this level; everything H3-specific (geometry, name table, q/k/v
layouts, the in-memory mapper) in :mod:`flowlock.checkpoint.minimax_h3`. In memory:
:func:`diffusers_to_native`, :func:`native_to_diffusers`. On disk: :func:`convert_directory`
(``flowlock convert``), :func:`verify_directory` and :func:`sweep_partials` (``flowlock convert
--clean``). Every refusal is a :class:`CheckpointError` naming what is wrong.
"""

from flowlock.checkpoint.convert import ConversionReport, convert_directory
from flowlock.checkpoint.errors import CheckpointError
from flowlock.checkpoint.manifest import verify_directory
from flowlock.checkpoint.minimax_h3.geometry import H3Geometry
from flowlock.checkpoint.minimax_h3.mapper import convert_state_dict, diffusers_to_native, native_to_diffusers
from flowlock.checkpoint.minimax_h3.names import Entry, name_table
from flowlock.checkpoint.minimax_h3.qkv_layout import QKV_LAYOUTS, fuse_qkv, rope_inv_freq, split_qkv, swap_halves
from flowlock.checkpoint.partial import Sweep, sweep_partials

__all__ = [
    "QKV_LAYOUTS", "CheckpointError", "ConversionReport", "Entry", "H3Geometry", "convert_directory",
    "convert_state_dict", "diffusers_to_native", "fuse_qkv", "name_table", "native_to_diffusers",
    "Sweep", "rope_inv_freq", "split_qkv", "swap_halves", "sweep_partials", "verify_directory",
]
