"""Imported by the fork server of `tests.engine.hooked` only: pays once, in the server, what a
rank would pay on its first meta-device init (`torch.nn.init.normal_` on "meta" imports
torch's reference decompositions, ~900 modules, 1.5-2 s on the loaded 2-core machine)."""

import torch

torch.empty(1, device="meta").normal_()
