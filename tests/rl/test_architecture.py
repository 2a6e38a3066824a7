"""The RL trainer's shape (issue 32): it composes role objects and one state, it inherits nothing.

`RLTrainer` has no mixin base, at most 15 instance attributes, and its constructor shows the roles of a run
(policy, rollout, reference, critic, teacher) as objects; the arrays they train live in one `TrainState`
pytree (train_state.py).
"""

from __future__ import annotations

import jax
import pytest

from configs import ppo
from jaxrl_post.engine import train_state
from jaxrl_post.rl import roles
from jaxrl_post.rl.trainer import RLTrainer

MAX_ATTRIBUTES = 15


def test_rltrainer_inherits_no_mixin():
    assert [k.__name__ for k in RLTrainer.__mro__] == ["RLTrainer", "object"]
    assert not any(k.__name__.endswith("Mixin") for k in RLTrainer.__mro__)


@pytest.fixture(scope="module")
def ppo_trainer(tmp_path_factory):
    c = ppo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path_factory.mktemp("arch") / "run")
    t = RLTrainer(c, console_write=lambda s: None)
    yield t
    t.close()


@pytest.mark.slow
def test_tiny_trainer_has_few_attributes_and_one_state(ppo_trainer):
    t = ppo_trainer
    attrs = vars(t)
    assert len(attrs) <= MAX_ATTRIBUTES, sorted(attrs)
    assert isinstance(t.policy, roles.PolicyRole) and isinstance(t.critic, roles.CriticRole)
    assert isinstance(t.reference, roles.ReferencePolicy) and t.teacher is None  # PPO tiny: KL in reward
    assert isinstance(t.state, train_state.TrainState) and isinstance(t.host, train_state.HostState)
    # one pytree: actor and critic params + optimizer states and the RNG key, nothing else on the trainer
    leaves = jax.tree.leaves(t.state)
    n = sum(len(jax.tree.leaves(x)) for x in (t.state.actor, t.state.critic, t.state.rollout, t.state.rng))
    assert len(leaves) == n > 0
    assert not any(isinstance(v, jax.Array) for v in attrs.values())  # no stray arrays beside the state
