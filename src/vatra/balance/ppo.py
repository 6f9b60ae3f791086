"""The learned balancer: a PPO policy (stable-baselines3) trained in the simulated cluster
(:mod:`vatra.balance.sim`) and deployed online with the same safety limits as ``proportional``.

``vatra balance train-agent`` trains and saves the policy, then scores it in the simulator beside
``static`` and ``proportional`` on the same clusters. Online (``balance.method = "ppo"``) the policy
sees the measured window's features and proposes a split; it is clipped to ``max_change``, never
taken when the time models predict it slower than the even split (so it cannot do worse than
``static`` by the models' account), and passes the same hysteresis as ``proportional``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from vatra._extras import require
from vatra.balance._base import BalancePolicy
from vatra.balance.proportional import ProportionalPolicy
from vatra.balance.split import predicted_step, proportional_split
from vatra.config import BalanceConfig
from vatra.errors import ConfigError

Decide = Callable[[Any, np.ndarray], list[int]]  # (env, observation) -> next split


def train_agent(
    out: Path,
    *,
    ranks: int,
    global_batch: int,
    timesteps: int,
    seed: int = 0,
    max_change: float = 0.5,
    min_batch: int = 1,
) -> Path:
    """Train PPO in the simulated cluster and save it to ``out`` (a .zip stable-baselines3 reads)."""
    sb3 = require("stable_baselines3", "balance", "the ppo balancer")
    from vatra.balance.sim import ClusterEnv

    env = ClusterEnv(ranks, global_batch, max_change=max_change, min_batch=min_batch)
    model = sb3.PPO(
        "MlpPolicy",
        env,
        seed=seed,
        n_steps=400,
        batch_size=100,
        gamma=0.8,
        learning_rate=1e-3,
        policy_kwargs={"log_std_init": -2.0},
        device="cpu",
    )
    model.learn(total_timesteps=timesteps)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    return out if out.suffix == ".zip" else out.with_name(out.name + ".zip")


def load_agent(path: str | Path, ranks: int) -> Any:
    """A saved policy for ``ranks`` ranks, or a one-line error naming what does not fit."""
    sb3 = require("stable_baselines3", "balance", "the ppo balancer")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"balance.policy = {str(p)!r}: no such file; train one with 'vatra balance train-agent'"
        )
    try:
        model = sb3.PPO.load(p, device="cpu")
    except Exception as err:
        raise ConfigError(
            f"balance.policy = {str(p)!r} is not a saved PPO policy ({type(err).__name__})"
        ) from None
    shape = model.observation_space.shape
    if shape != (4 * ranks,):
        raise ConfigError(
            f"balance.policy = {str(p)!r} was trained for {shape[0] // 4} ranks but the run has {ranks}; "
            f"train one with 'vatra balance train-agent --ranks {ranks}'"
        )
    return model


class LearnedPolicy(BalancePolicy):
    """``BalancePolicy`` whose proposal comes from the PPO policy."""

    def __init__(self, cfg: BalanceConfig, world_size: int, agent: Any = None) -> None:
        super().__init__(cfg, world_size)
        self.agent = agent if agent is not None else load_agent(cfg.policy, world_size)

    def propose(self, current: list[int]) -> list[int]:
        from vatra.balance.sim import apply_action, features  # gymnasium: an optional dependency

        cfg, caps = self.cfg, self.caps or [sum(current)] * len(current)
        obs, target = features(current, self.busy, self.models, caps, cfg.min_batch)
        action, _ = self.agent.predict(obs, deterministic=True)
        proposed = apply_action(current, target, action, caps, cfg.max_change, cfg.min_batch)
        even = proportional_split(sum(current), [1.0] * len(current), lo=cfg.min_batch, hi=caps)
        if predicted_step(self.models, proposed) > predicted_step(self.models, even):
            return even  # never slower than static by the models' account
        return proposed


def simulate(
    decide: Callable[[], Decide], *, ranks: int, global_batch: int, episodes: int, seed: int
) -> float:
    """Mean compute balance of a balancer over ``episodes`` simulated clusters (seeds ``seed``,
    ``seed + 1``…);
    ``decide()`` makes a fresh balancer per episode."""
    from vatra.balance.sim import ClusterEnv

    scores = []
    for e in range(episodes):
        env = ClusterEnv(ranks, global_batch)
        obs, _ = env.reset(seed=seed + e)
        choose = decide()
        total = 0.0
        for _ in range(env.episode):
            total += env.run_split(choose(env, obs))
            obs = env._obs()
        scores.append(total / env.episode)
    return float(np.mean(scores))


def static_decider() -> Decide:
    return lambda env, obs: list(env.sizes)


def policy_decider(make_policy: Callable[[int], BalancePolicy]) -> Callable[[], Decide]:
    """A balancer fed the simulator's windows as the plugin feeds it a run's (one window a
    decision), knowing the simulated caps; ``make_policy(ranks)`` makes a fresh one per episode."""

    def make() -> Decide:
        policy: BalancePolicy | None = None

        def choose(env: Any, obs: np.ndarray) -> list[int]:
            nonlocal policy
            if policy is None:
                policy = make_policy(env.ranks)
                policy.caps = list(env.caps)
            wall = max(env.busy)
            policy.observe([[b, t, wall] for b, t in zip(env.sizes, env.busy, strict=True)], 1, 1)
            return policy.decide(list(env.sizes))[0]

        return choose

    return make


def rule_decider(cfg: BalanceConfig) -> Callable[[], Decide]:
    """``proportional`` in the simulator."""
    return policy_decider(lambda ranks: ProportionalPolicy(cfg, ranks))


def agent_decider(agent: Any, cfg: BalanceConfig) -> Callable[[], Decide]:
    """A learned policy in the simulator, with the online guard."""
    return policy_decider(lambda ranks: LearnedPolicy(cfg, ranks, agent))


def compare(
    agent: Any, *, ranks: int, global_batch: int, episodes: int = 50, seed: int = 10_000
) -> dict[str, float]:
    """Mean simulated compute balance of static, proportional and the agent on the same clusters (seeds
    not used in training: those start at 0)."""
    rule = BalanceConfig(method="proportional")
    learned = BalanceConfig(method="ppo", policy="-")
    opts = {"ranks": ranks, "global_batch": global_batch, "episodes": episodes, "seed": seed}
    return {
        "static": simulate(static_decider, **opts),
        "proportional": simulate(rule_decider(rule), **opts),
        "ppo": simulate(agent_decider(agent, learned), **opts),
    }
