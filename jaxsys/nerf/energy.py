"""Energy accounting of the colour network: MACs for real-valued layers, ACs for spike inputs.

For a layer ``Linear(fan_in -> fan_out)``:

* a real-valued input vector costs ``fan_in * fan_out`` multiply-accumulates (MACs);
* a binary spike input costs one accumulate (AC) per spike per output: ``spikes * fan_out``.

The SNN colour MLP's first layer reads real features (MACs); every later layer reads spikes
(ACs, from the spike counts the network actually produced). The ANN baseline is all MACs.
Energy uses the 45 nm figures used throughout the SNN literature (Horowitz, ISSCC 2014):
``E = 4.6 pJ * MACs + 0.9 pJ * ACs``. Only valid (unpadded) samples count.

Usage::

  ann = ann_ops(num_points, dims)                    # dims = (39, 128, 128, 3)
  snn = snn_ops(num_points, dims, spikes_per_layer)  # spike totals after each LIF
  saving = 1 - energy_pj(snn) / energy_pj(ann)
"""

from __future__ import annotations

import dataclasses

from jaxsys.core.errors import InputError

__all__ = ["ann_ops", "E_AC_PJ", "E_MAC_PJ", "energy_pj", "OpCounts", "snn_ops"]

E_MAC_PJ = 4.6
E_AC_PJ = 0.9


@dataclasses.dataclass(frozen=True)
class OpCounts:
  macs: float
  acs: float

  def energy_pj(self, e_mac: float = E_MAC_PJ, e_ac: float = E_AC_PJ) -> float:
    return e_mac * self.macs + e_ac * self.acs


def energy_pj(ops: OpCounts, e_mac: float = E_MAC_PJ, e_ac: float = E_AC_PJ) -> float:
  """``e_mac * MACs + e_ac * ACs`` in picojoules."""
  return ops.energy_pj(e_mac, e_ac)


def _check_dims(dims):
  if len(dims) < 2 or min(dims) < 1:
    raise InputError(f"dims={tuple(dims)} must list >= 2 positive layer widths (input first)")


def ann_ops(num_points: int, dims) -> OpCounts:
  """An ANN MLP with widths ``dims`` on ``num_points`` inputs: every layer is MACs."""
  _check_dims(dims)
  per_point = sum(a * b for a, b in zip(dims[:-1], dims[1:]))
  return OpCounts(macs=float(num_points) * per_point, acs=0.0)


def snn_ops(num_points: int, dims, spikes) -> OpCounts:
  """A spiking MLP with widths ``dims``: layer 1 MACs on real inputs, layer ``k > 1`` ACs
  ``spikes[k-2] * dims[k]`` from the spikes of the LIF before it (``len(spikes) == len(dims) - 2``)."""
  _check_dims(dims)
  if len(spikes) != len(dims) - 2:
    raise InputError(f"spikes has {len(spikes)} layers, dims={tuple(dims)} needs {len(dims) - 2}")
  macs = float(num_points) * dims[0] * dims[1]
  acs = sum(float(s) * fan_out for s, fan_out in zip(spikes, dims[2:]))
  return OpCounts(macs=macs, acs=acs)
