"""Config checks of the device mesh and the multi-host start-up (`trainer.mesh.*`, `trainer.distributed.*`):
sections of `rl/config_check.py`'s table, reporting through an `errors.Checker`. Whether the mesh fits the
run's devices and divides the batch sizes is checked with the batch arithmetic (`rl/config_check.py`)."""

from __future__ import annotations

from jaxrl_post.errors import Checker, is_int, pos_int
from jaxrl_post.runtime.distributed import config_errors


def check_mesh(c: Checker) -> None:
    """`trainer.mesh.{data,fsdp,tensor}` (and `expert` when the config has it): -1 or a positive int;
    `trainer.mesh.dcn_data` / `dcn_fsdp`, when present: positive ints (slices along the axis)."""
    mesh = c.cfg.trainer.mesh
    for axis in ("data", "fsdp", "tensor") + (("expert",) if "expert" in mesh else ()):
        c.check(f"trainer.mesh.{axis}", lambda v: is_int(v) and (v == -1 or v > 0), "must be -1 or a positive int")
    for axis in ("dcn_data", "dcn_fsdp"):
        if axis in mesh:
            c.check(f"trainer.mesh.{axis}", pos_int, "must be a positive int (slices along the axis; 1 = one slice)")


def check_distributed(c: Checker) -> None:
    """`trainer.distributed.*` and the per-process prompt share (`runtime.distributed.config_errors`)."""
    c.errors += config_errors(c.cfg)
