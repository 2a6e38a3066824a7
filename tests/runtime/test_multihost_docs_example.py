"""docs/multihost.md "Several processes on one machine": the command as written passes the config check on the
mesh it runs on (2 processes x 4 devices, default mesh: 8 batch devices), and the `:tiny` config without its
micro-batch override is refused there with the one line the docs quote. The run itself (2 x 4 == 1 x 8 on the
default mesh) is `tests/e2e/test_multihost.py`.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

from jaxrl_post.api import load_config
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl.config_check import validate_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _docs_command() -> tuple[int, str, dict]:
    """(devices per process, --config spec, {key: value}) of the section's bash block."""
    with open(os.path.join(REPO, "docs", "multihost.md")) as f:
        text = f.read()
    section = text.split("## Several processes on one machine", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("$i", "0")  # process 0's command
    devices = int(re.search(r"xla_force_host_platform_device_count=(\d+)", block).group(1))
    spec = re.search(r"--config=(\S+)", block).group(1)
    overrides = {}
    for key, value in re.findall(r"--config\.(\S+?)=(\S+)", block):
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value  # strings (paths, addresses) as the flag parser reads them
    return devices, spec, overrides


def test_docs_two_process_example_passes_the_config_check():
    devices, spec, overrides = _docs_command()
    n_proc = overrides["trainer.distributed.num_processes"]
    assert (devices, n_proc) == (4, 2)
    cfg = load_config(os.path.join(REPO, spec), overrides)
    assert (cfg.trainer.mesh.data, cfg.trainer.mesh.fsdp, cfg.trainer.mesh.tensor) == (1, -1, 1)  # default mesh
    validate_config(cfg, n_devices=devices * n_proc)  # raises ConfigError naming every bad key


def test_tiny_without_the_docs_micro_batch_is_refused_on_eight_devices():
    _, spec, overrides = _docs_command()
    overrides.pop("actor.ppo_micro_batch_size")
    cfg = load_config(os.path.join(REPO, spec), overrides)
    with pytest.raises(ConfigError, match=r"actor\.ppo_micro_batch_size.*4 responses \(global\) are not divisible"):
        validate_config(cfg, n_devices=8)
