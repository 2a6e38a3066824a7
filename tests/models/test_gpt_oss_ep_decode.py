"""GPT-OSS greedy rollout on the expert mesh (issue 58): a tiny random `GptOssForCausalLM` (router and expert biases,
clamped SwiGLU, attention sinks, sliding / full layers, YaRN) saved by transformers, loaded on one device and on 8 fake
CPU devices as expert 4 x fsdp 2 (experts over 'expert', their D dim over 'fsdp', tokens exchanged by all-to-all in
the prefill and in every cached decode step). References: the one-device `Generator` and transformers' `generate` on
the same weights. One subprocess (the fake device count must be set before jax starts) prints a JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # one subprocess: transformers' generate and 3 rollout programs on 8 fake devices

NEW = 12  # greedy tokens after 8-token prompts; the sliding layers' window (4) drops keys in decode

_SCRIPT = r"""
import json, re, sys, tempfile
import jax, numpy as np, torch
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models.hf_io import load_hf_dir
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout import generate as generate_module
from jaxrl_post.rollout.paged.engine import PagedGenerator
from jaxrl_post.runtime.sharding import make_mesh
from tests.models.test_gpt_oss import _hf_model
from tests.models.test_moe import _batch

NEW = int(sys.argv[1])
E = 12  # divides the expert axis (4): 3 per device; no other dim of the decode program is 12 (rows: 8)
out = {}
hf = _hf_model(seed=1, num_local_experts=E)
path = tempfile.mkdtemp()
hf.save_pretrained(path)
mesh = make_mesh(data=1, fsdp=2, expert=4, tensor=1)
single, sharded = load_hf_dir(path), load_hf_dir(path, mesh=mesh)
cfg = single.config
out["config"] = dict(family=cfg.family, moe_bias=cfg.moe_bias, sinks=cfg.attention_sinks,
                     swiglu_limit=cfg.swiglu_limit, layer_types=list(cfg.layer_types), num_experts=cfg.num_experts)
out["spec"] = str(sharded.layers[0].mlp.gate_up_proj.get_value().sharding.spec)

ids, mask = _batch(cfg.vocab_size, b=3, t=8, seed=2)  # 3 prompts, 2 left-padded; padded to 8 rows on the mesh
with torch.no_grad():
    ref = hf.generate(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                      do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
out["hf"] = ref.numpy()[:, ids.shape[1]:].tolist()

class Recorded:  # the Generator's own decode program: its optimized HLO, compiled with the call's arguments
    def __init__(self, fn):
        self.fn, self.hlo = fn, None
    def __call__(self, *args, **kw):
        if kw.get("mesh") is not None:
            self.hlo = self.fn.lower(*args, **kw).compile().as_text()
        return self.fn(*args, **kw)

recorded = Recorded(generate_module._decode)
generate_module._decode = recorded
dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
params = SamplingParams(max_new_tokens=NEW, do_sample=False, eos_token_ids=())
kw = dict(compact_min_rows=None, decode_chunk=4, return_routed_experts=True)
a = Generator(single, **kw).generate(dp, params).batch
b = Generator(sharded, mesh=mesh, **kw).generate(dp, params).batch
out["single"] = a["responses"].tolist()
out["mesh"] = b["responses"].tolist()
out["routes_equal"] = bool((a["routed_experts"] == b["routed_experts"]).all())
out["routes_used"] = len(np.unique(a["routed_experts"][a["attention_mask"].astype(bool)]))
out["logp_diff"] = float(np.abs(a["rollout_log_probs"] - b["rollout_log_probs"]).max())
out["logp_min"] = float(a["rollout_log_probs"].min())

hlo = recorded.hlo
gathers = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)
out["decode_hlo"] = dict(
    all_to_all=len(re.findall(r" all-to-all\(", hlo)),
    expert_gathers=[g for g in gathers if g.split(",")[0] == str(E)],
    gathers=sorted(set(gathers)),
)
try:
    PagedGenerator(sharded, mesh=mesh)
    out["paged"] = "accepted"
except ValueError as e:
    out["paged"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def run():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS
    )
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(NEW)], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def test_gpt_oss_model_and_layout(run):
    """The loaded model is a GPT-OSS with every feature on (biased experts, sinks, clamp, sliding + full layers), and
    its fused gate_up `[E, D, 2F]` is split over 'expert' (E) and 'fsdp' (D; 2F over the size-1 'tensor')."""
    assert run["config"] == dict(
        family="gpt_oss",
        moe_bias=True,
        sinks=True,
        swiglu_limit=1.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_experts=12,
    )
    assert run["spec"] == "P('expert', 'fsdp', 'tensor')"  # tensor: size 1 here


def test_gpt_oss_greedy_decode_on_expert_mesh_equals_one_device_and_transformers(run):
    """`Generator` on expert 4 x fsdp 2 (prefill + cached decode through the all-to-all dispatch): the same 12 greedy
    tokens as the one-device `Generator` and as transformers' `generate`, the same `routed_experts` (more than half
    of the 12 experts used), and rollout log-probs within 1e-5 (float32)."""
    assert run["single"] == run["hf"]
    assert run["mesh"] == run["single"]
    assert run["routes_equal"] and run["routes_used"] > 6
    assert run["logp_min"] < -0.1  # non-trivial log-probs: the comparison below is not of zeros
    assert run["logp_diff"] < 1e-5, run["logp_diff"]


def test_gpt_oss_decode_program_exchanges_tokens_and_never_gathers_experts(run):
    """The Generator's compiled decode loop on the expert mesh has all-to-alls (each MoE layer's token exchange) and
    no all-gather whose result is an `[E, ...]` array (all experts on one device); the experts' D shards are gathered
    over 'fsdp' only as `[E/ep, ...]` (3 experts)."""
    hlo = run["decode_hlo"]
    assert hlo["all_to_all"] >= 2, hlo
    assert hlo["expert_gathers"] == [], hlo


def test_paged_engine_refuses_the_expert_mesh(run):
    """The paged engine runs data replicas of a tensor-parallel engine only: an expert mesh raises ValueError naming
    the mesh (no expert-parallel paged decode; docs/moe.md)."""
    assert run["paged"].startswith("the paged engine runs 'data' replicas"), run["paged"]
