# PPO (CleanRL's ppo.py, https://docs.cleanrl.dev/rl-algorithms/ppo/#ppopy) acting with local policy copies in
# clusterenv workers, under several weight-sync strategies: EveryUpdate, FixedInterval(n) and APS(threshold).
# Per run it records the return curve, the weight pulls, and the KL between the learner and each worker's copy
# at every rollout start, with whether the worker then pulled; `--env-ids` with a Box action space trains
# ppo_continuous.py's Gaussian actor instead of ppo.py's categorical one.
#
#   python benchmarks/aps_sweep.py                  # the main sweep: CartPole, 8 strategies x 8 seeds, ~13 min here
#   python benchmarks/aps_sweep.py --ratio behaviour --name aps_sweep_behaviour \
#       --strategies every fixed:4 aps:0.002 aps:0.005 aps:0.02 --seeds 1 2 3   # the ppo.py ratio, see below; ~3 min
#   python benchmarks/aps_sweep.py --env-ids Acrobot-v1 --name aps_sweep_acrobot \
#       --strategies every fixed:4 fixed:8 aps:0.01 aps:0.02 aps:0.05 --seeds 1 2 3 4   # ~7 min
#   python benchmarks/aps_sweep.py --total-timesteps 8192 --seeds 1  # a smoke run
#   (the cross-task sweeps, CartPole, Acrobot, LunarLander and Pendulum: see benchmarks/aps_report.py)
#   python benchmarks/aps_sweep.py --plot-only                      # redraw table and plots from the JSON
#
# Differences from ppo.py, all forced by acting in the workers: the rollout comes from `PolicyRunner.rollout`,
# values are computed on the learner after the rollout, NEXT_STEP reset steps are masked out of the loss, and
# truncated episodes bootstrap from their last observation. With a stale acting copy the PPO ratio needs a
# reference policy: `--ratio behaviour` takes ppo.py's literally (ratio against the copy that acted). Then the
# clip keeps the learner within PPO's trust region (KL ~0.01) of the *acting* copy, so APS with a threshold
# above that never pulls and training stalls. `--ratio decoupled` (the default) clips against the learner's own
# pre-update policy and weights each sample by min(pi_learner / pi_acting, 1) (Hilton et al. 2021, "Batch
# size-invariance for policy optimization"): the learner can move away from a stale copy, and APS decides when
# the copy is too far behind. With EveryUpdate both are ppo.py (the weight is 1, the two policies are one).
import functools
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tyro
from support.report import command_line
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal

import clusterenv
from clusterenv import APS, EveryUpdate, FixedInterval, Never, PolicyRunner

log = logging.getLogger("aps_sweep")


@dataclass
class Args:
    env_ids: list[str] = field(default_factory=lambda: ["CartPole-v1"])
    """environments to train on"""
    strategies: list[str] = field(
        default_factory=lambda: [
            "every",
            "fixed:2",
            "fixed:4",
            "fixed:8",
            "aps:0.005",
            "aps:0.01",
            "aps:0.02",
            "aps:0.05",
        ]
    )
    """sync strategies: every, never, fixed:N (FixedInterval(N)), aps:default (APS()), aps:T (APS(threshold=T)),
    aps:xK (APS(updates=K): K versions' worth of the learner's movement), aps:p95:T (APS(T, statistic="p95"))"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 7, 8])
    """seeds per strategy"""
    total_timesteps: int = 100_000
    """env steps per run (reset steps included, as in CleanRL)"""
    num_envs: int = 8
    """parallel envs"""
    num_workers: int = 2
    """clusterenv worker processes"""
    num_steps: int = 128
    """steps per env per rollout"""
    learning_rate: float = 1e-3
    """Adam learning rate (annealed to 0)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly"""
    gamma: float = 0.99
    """discount"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    num_minibatches: int = 4
    """minibatches per epoch"""
    update_epochs: int = 4
    """epochs per update"""
    norm_adv: bool = True
    """normalize advantages"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clipped value loss"""
    ent_coef: float = 0.01
    """entropy coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """gradient clipping"""
    ratio: str = "decoupled"
    """PPO ratio against: "behaviour" (the copy that acted, as ppo.py does) or "decoupled" (the learner's policy
    before this update, with the data weighted by min(pi_learner / pi_behaviour, is_clip); Hilton et al. 2021)"""
    is_clip: float = 1.0
    """with --ratio decoupled: truncation of the importance weight pi_learner / pi_behaviour"""
    probe_steps: int = 16
    """steps per worker whose observations the KL is measured on"""
    prefetch: int = 0
    """rollouts each worker collects ahead of the learner (PolicyRunner(prefetch=k)): real policy lag"""
    return_window: int = 20
    """episodes in the rolling mean return"""
    solved_return: float | None = None
    """rolling mean return that counts as solved; default: 475 on CartPole-v1 (its threshold), -100 on Acrobot-v1"""
    final_fraction: float = 0.1
    """the final return is the mean over episodes ending in this last fraction of training"""
    out_dir: str = "benchmarks/results"
    """where NAME.json, NAME.md, NAME_returns.png and NAME_tradeoff.png go"""
    name: str = "aps_sweep"
    """file name stem of the outputs"""
    resume: bool = False
    """keep the runs already in NAME.json and train only the missing (env, strategy, seed) runs"""
    plot_only: bool = False
    """skip training; redraw from the JSON in out_dir"""


STRATEGY_SPECS = "every, never, fixed:N, aps:default, aps:T, aps:xK or aps:p95:T"


def make_strategy(spec):
    name, _, value = spec.partition(":")
    try:
        if name == "every" and not value:
            return EveryUpdate()
        if name == "never" and not value:
            return Never()
        if name == "fixed":
            return FixedInterval(int(value))
        if name == "aps" and value == "default":
            return APS()
        if name == "aps" and value.startswith("x"):
            return APS(updates=float(value[1:]))
        if name == "aps" and value.startswith(("p95:", "max:")):
            statistic, _, threshold = value.partition(":")
            return APS(float(threshold), statistic=statistic)
        if name == "aps":
            return APS(threshold=float(value))
    except ValueError:
        pass
    raise SystemExit(f"error: unknown strategy {spec!r}; use {STRATEGY_SPECS}")


def label(spec):
    name, _, value = spec.partition(":")
    if name == "aps" and value == "default":
        return "APS()"
    if name == "aps" and value.startswith("x"):
        return f"APS(updates={value[1:]})"
    if name == "aps" and value.startswith(("p95:", "max:")):
        statistic, _, threshold = value.partition(":")
        return f'APS({threshold}, "{statistic}")'
    return {"every": "EveryUpdate", "never": "Never", "fixed": f"FixedInterval({value})", "aps": f"APS({value})"}[name]


def layer_init(layer, std=2**0.5, bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class GaussianActor(nn.Module):
    """CleanRL's ppo_continuous.py actor: means, then a state-independent log std (``clusterenv.Gaussian``'s layout)."""

    def __init__(self, obs_size, act_size):
        super().__init__()
        self.mean = nn.Sequential(
            layer_init(nn.Linear(obs_size, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, act_size), std=0.01),
        )
        self.logstd = nn.Parameter(torch.zeros(1, act_size))

    def forward(self, x):
        mean = self.mean(x)
        return torch.cat([mean, self.logstd.expand_as(mean)], dim=-1)


class Agent(nn.Module):
    """ppo.py's agent on Discrete actions, ppo_continuous.py's on Box actions."""

    def __init__(self, envs):
        super().__init__()
        obs_size = int(np.array(envs.single_observation_space.shape).prod())
        self.continuous = isinstance(envs.single_action_space, gym.spaces.Box)
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_size, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        if self.continuous:
            self.actor = GaussianActor(obs_size, int(np.prod(envs.single_action_space.shape)))
        else:
            self.actor = nn.Sequential(
                layer_init(nn.Linear(obs_size, 64)),
                nn.Tanh(),
                layer_init(nn.Linear(64, 64)),
                nn.Tanh(),
                layer_init(nn.Linear(64, envs.single_action_space.n), std=0.01),
            )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action):
        if self.continuous:
            mean, logstd = self.actor(x).chunk(2, dim=-1)
            probs = Normal(mean, logstd.exp())
            return action, probs.log_prob(action).sum(-1), probs.entropy().sum(-1), self.critic(x)
        probs = Categorical(logits=self.actor(x))
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def advantages_and_returns(args, batch, values, next_value):
    """GAE over a NEXT_STEP rollout: reset steps get no advantage and cut the trace."""
    rewards = torch.as_tensor(batch.rewards, dtype=torch.float32)
    terminated = torch.as_tensor(batch.terminations, dtype=torch.float32)
    done = torch.as_tensor(batch.terminations | batch.truncations, dtype=torch.float32)
    reset_step = torch.as_tensor(batch.autoreset)
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(next_value)
    for t in reversed(range(args.num_steps)):
        # After a truncation obs[t + 1] is the episode's last observation (NEXT_STEP), so bootstrap from it.
        nextvalues = next_value if t == args.num_steps - 1 else values[t + 1]
        delta = rewards[t] + args.gamma * nextvalues * (1.0 - terminated[t]) - values[t]
        lastgaelam = delta + args.gamma * args.gae_lambda * (1.0 - done[t]) * lastgaelam
        lastgaelam = torch.where(reset_step[t], torch.zeros_like(lastgaelam), lastgaelam)
        advantages[t] = lastgaelam
    return advantages, advantages + values


def action_space_of(env_id):
    env = gym.make(env_id)
    try:
        return env.action_space
    finally:
        env.close()


def make_envs(args, env_id):
    """Fresh envs for one run: a wrapper's running statistics (NormalizeReward's) must not carry into the next run."""
    wrappers = [gym.wrappers.RecordEpisodeStatistics]
    if isinstance(action_space_of(env_id), gym.spaces.Box):
        # ppo_continuous.py's reward scaling (returns are recorded before it, unscaled).
        wrappers.append(functools.partial(gym.wrappers.NormalizeReward, gamma=args.gamma))
    return clusterenv.make_vec(
        env_id, num_envs=args.num_envs, vector_kwargs={"num_workers": args.num_workers}, wrappers=wrappers
    )


def solved_header(threshold):
    """The table's column for steps to solve; a task with no known threshold (no --solved-return) has none."""
    if np.isfinite(threshold):
        return f"steps to {threshold:g} (solved seeds)"
    return "steps to solve (no --solved-return)"


def solved_return(args, envs):
    if args.solved_return is not None:
        return args.solved_return
    return {"CartPole-v1": 475.0, "Acrobot-v1": -100.0, "LunarLander-v3": 200.0, "Pendulum-v1": -200.0}.get(
        envs.spec.id, float("inf")
    )


def train(args, envs, spec, seed, *, make_agent=Agent, weights=None):
    """One PPO run; ``make_agent(envs)`` builds the agent, ``weights`` is the runner's weight encoding."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    agent = make_agent(envs)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    envs.reset(seed=seed)
    runner = PolicyRunner(
        envs,
        agent.actor,
        make_strategy(spec),
        seed=seed,
        probe_steps=args.probe_steps,
        prefetch=args.prefetch,
        weights=weights,
    )
    batch_size = args.num_envs * args.num_steps
    num_iterations = args.total_timesteps // batch_size
    global_step, start = 0, time.time()
    episodes, curve = [], []
    starts = []  # per rollout and worker: (KL measured at its start, whether it pulled, the learner's movement)
    for iteration in range(1, num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
        before = [(w.kl_checks, w.pulls) for w in runner.telemetry.workers]
        batch = runner.rollout(args.num_steps)
        for (checks, pulls), w in zip(before, runner.telemetry.workers, strict=True):
            if w.kl_checks > checks:
                starts.append((w.last_kl, w.pulls > pulls, w.movement))
        for t, _env, ret, _length in batch.episodes():
            episodes.append((global_step + (t + 1) * args.num_envs, ret))
        global_step += batch_size

        # The batch keeps the observations' own dtype (MuJoCo's float64); the policy and the value net take float32,
        # as the workers' copies are given them.
        obs = torch.as_tensor(batch.obs, dtype=torch.float32)
        with torch.no_grad():
            values = agent.get_value(obs).squeeze(-1)
            next_value = agent.get_value(torch.as_tensor(batch.next_obs, dtype=torch.float32)).squeeze(-1)
        advantages, returns = advantages_and_returns(args, batch, values, next_value)

        # Reset steps carry no transition (the env ignored the action): leave them out of the loss.
        valid = torch.as_tensor(~batch.autoreset).reshape(-1)
        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)[valid]
        b_actions = torch.as_tensor(batch.actions).reshape((-1,) + envs.single_action_space.shape)[valid]
        b_logprobs = torch.as_tensor(batch.logprobs).reshape(-1)[valid]
        b_weights = torch.ones_like(b_logprobs)
        if args.ratio == "decoupled":
            # Clip against the learner's own pre-update policy; correct for the stale acting copy by weighting.
            with torch.no_grad():
                _, prox_logprobs, _, _ = agent.get_action_and_value(b_obs, b_actions)
            b_weights = torch.clamp((prox_logprobs - b_logprobs).exp(), max=args.is_clip)
            b_logprobs = prox_logprobs
        is_weight = float(b_weights.mean())
        b_advantages = advantages.reshape(-1)[valid]
        b_returns = returns.reshape(-1)[valid]
        b_values = values.reshape(-1)[valid]
        b_inds = np.arange(len(b_obs))
        clipfracs = []
        for _epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            # Masking reset steps leaves a batch size that rarely divides evenly: near-equal minibatches.
            for mb_inds in np.array_split(b_inds, args.num_minibatches):
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]
                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                pg_loss1 = -mb_advantages * ratio
                pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                pg_loss = (b_weights[mb_inds] * torch.max(pg_loss1, pg_loss2)).mean()
                newvalue = newvalue.view(-1)
                if args.clip_vloss:
                    v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                    v_clipped = b_values[mb_inds] + torch.clamp(
                        newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef
                    )
                    v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                    v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()
                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
        runner.publish(agent.actor)

        recent = [ret for _, ret in episodes[-args.return_window :]]
        telemetry = runner.telemetry.total
        curve.append(
            {
                "step": global_step,
                "wall_s": time.time() - start,
                "mean_return": float(np.mean(recent)) if recent else None,
                "pulls": telemetry.pulls,
                "approx_kl": float(approx_kl),
                "clipfrac": float(np.mean(clipfracs)),
                "is_weight": is_weight,
            }
        )
    runner.stop()  # hands back the prefetched rollouts (none without prefetch) and frees the envs
    telemetry = runner.telemetry
    total = telemetry.total
    final_from = args.total_timesteps * (1 - args.final_fraction)
    final = [ret for step, ret in episodes if step >= final_from]
    solved_at = next(
        (
            step
            for i, (step, _) in enumerate(episodes)
            if i + 1 >= args.return_window
            and np.mean([r for _, r in episodes[i + 1 - args.return_window : i + 1]]) >= solved_return(args, envs)
        ),
        None,
    )
    return {
        "strategy": spec,
        "seed": seed,
        "updates": num_iterations,
        "env_steps": global_step,
        "final_return": float(np.mean(final)) if final else None,
        "solved_at": solved_at,
        "solved_return": solved_return(args, envs),
        "pulls_per_worker": total.pulls / envs.num_workers,
        "pulls": total.pulls,
        "weight_bytes": total.weight_bytes,
        "full_pulls": total.full_pulls,
        "delta_pulls": total.delta_pulls,
        "guard_trips": total.guard_trips,
        "probe_bytes": total.probe_bytes,
        "initial_bytes": total.initial_bytes,
        "mean_lag": total.mean_lag,
        "lag_counts": {str(k): v for k, v in sorted(total.lag_counts.items())},
        "mean_kl": total.mean_kl,
        # KL(learner || worker's copy) on the probe states at each rollout start, before the pull decision, and
        # whether the worker then pulled (after a pull the copy that acts is the learner's policy: KL 0).
        "start_kls": [kl for kl, _, _ in starts],
        "start_pulled": [pulled for _, pulled, _ in starts],
        # The learner's movement the decision used (APS() and APS(updates=K) only; None for the others).
        "start_movements": [movement for _, _, movement in starts],
        "pull_reasons": dict(total.pull_reasons),
        "wall_s": time.time() - start,
        "curve": curve,
    }


def mean_spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"


def lag_histogram(runs):
    """Percent of acting steps at lag 0, 1, 2 and 3 or more versions, over all runs."""
    counts = np.zeros(4)
    for r in runs:
        for lag, count in r.get("lag_counts", {}).items():
            counts[min(int(lag), 3)] += count
    if not counts.sum():
        return "n/a"
    return " / ".join(f"{100 * c / counts.sum():.0f}" for c in counts)


def write_report(args, results):
    lines = [
        "# APS sweep: PPO with local policies on clusterenv workers",
        "",
        f"{len({r['seed'] for r in results})} seeds x {args.total_timesteps} env steps per run, {args.num_envs} envs on "
        f"{args.num_workers} workers, {args.num_steps} steps per rollout (one update per rollout), "
        f"{args.prefetch} rollouts prefetched per worker, PPO ratio "
        f"against the {args.ratio} policy, learning rate {args.learning_rate}"
        f"{' annealed' if args.anneal_lr else ''}, gamma {args.gamma}, GAE lambda {args.gae_lambda}, "
        f"{args.update_epochs} epochs x {args.num_minibatches} minibatches per update. "
        f"Final return: mean episodic training return over the last {args.final_fraction:.0%} of steps, "
        "mean ± std over seeds. Pulls and lag: per worker, mean over seeds. Bytes: all workers, weights pulled "
        "(+ learner logits sent for KL checks).",
        "",
        f"Produced by `{command_line(__file__, drop=['--plot-only'])}`.",
        "",
    ]
    for env_id in sorted({r["env_id"] for r in results}):
        rows = [r for r in results if r["env_id"] == env_id]
        every = [r["pulls_per_worker"] for r in rows if r["strategy"] == "every"]
        threshold = rows[0].get("solved_return", 475.0)
        lines += [
            f"## {env_id}",
            "",
            f"| strategy | final return | {solved_header(threshold)} | pulls/worker "
            "| pull reduction vs EveryUpdate "
            "| weight MB (+ probe MB) | mean lag | lag 0 / 1 / 2 / 3+ (% of steps) | mean KL |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for spec in args.strategies:
            runs = [r for r in rows if r["strategy"] == spec]
            if not runs:
                continue
            solved = [r["solved_at"] for r in runs if r["solved_at"] is not None]
            if not np.isfinite(threshold):
                solved_text = "n/a"
            elif solved:
                solved_text = f"{np.mean(solved):,.0f} ({len(solved)}/{len(runs)})"
            else:
                solved_text = f"never (0/{len(runs)})"
            pulls = np.mean([r["pulls_per_worker"] for r in runs])
            reduction = f"{np.mean(every) / pulls:.1f}x" if every and pulls else "n/a"
            weight_mb = np.mean([r["weight_bytes"] for r in runs]) / 1e6
            probe_mb = np.mean([r["probe_bytes"] for r in runs]) / 1e6
            kl = [r["mean_kl"] for r in runs if r["mean_kl"] is not None]
            kl_text = f"{np.mean(kl):.4f}" if kl else "n/a"
            lag = np.mean([r["mean_lag"] for r in runs])
            lines.append(
                f"| {label(spec)} | {mean_spread([r['final_return'] for r in runs])} | {solved_text} | {pulls:.1f} "
                f"| {reduction} | {weight_mb:.2f} (+ {probe_mb:.2f}) | {lag:.2f} | {lag_histogram(runs)} | {kl_text} |"
            )
        wall = sum(r["wall_s"] for r in rows)
        lines += ["", f"Training wall time for {env_id}: {wall / 60:.1f} min over {len(rows)} runs.", ""]
    path = os.path.join(args.out_dir, f"{args.name}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def plot(args, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env_ids = sorted({r["env_id"] for r in results})
    # One panel per family, each with the baselines, so that eight curves do not share one axis.
    families = [("FixedInterval", "fixed"), ("APS", "aps")]
    fig, axes = plt.subplots(len(env_ids), 2, figsize=(13, 4.2 * len(env_ids)), squeeze=False)
    for row, env_id in zip(axes, env_ids, strict=True):
        for ax, (family, prefix) in zip(row, families, strict=True):
            for spec in args.strategies:
                if not (spec.startswith(prefix) or spec in ("every", "never")):
                    continue
                runs = [r for r in results if r["env_id"] == env_id and r["strategy"] == spec]
                if not runs:
                    continue
                steps = [p["step"] for p in runs[0]["curve"]]
                curves = np.array(
                    [[np.nan if p["mean_return"] is None else p["mean_return"] for p in r["curve"]] for r in runs]
                )
                mean, std = np.nanmean(curves, axis=0), np.nanstd(curves, axis=0)
                style = "-" if spec.startswith(prefix) else "k-."
                (line,) = ax.plot(steps, mean, style, label=label(spec), linewidth=1.4)
                ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.08)
            ax.set_title(
                f"{env_id}: EveryUpdate vs {family} (mean ± std over {len({r['seed'] for r in results})} seeds)",
                fontsize=10,
            )
            ax.set_xlabel("env steps")
            ax.set_ylabel(f"rolling mean return ({args.return_window} episodes)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    curves_path = os.path.join(args.out_dir, f"{args.name}_returns.png")
    fig.savefig(curves_path, dpi=110)

    fig, axes = plt.subplots(1, len(env_ids), figsize=(7 * len(env_ids), 4.5), squeeze=False)
    for ax, env_id in zip(axes[0], env_ids, strict=True):
        for spec in args.strategies:
            runs = [r for r in results if r["env_id"] == env_id and r["strategy"] == spec]
            if not runs:
                continue
            pulls = [r["pulls_per_worker"] for r in runs]
            finals = [r["final_return"] if r["final_return"] is not None else np.nan for r in runs]
            marker = "o" if spec.startswith("aps") else "s" if spec.startswith("fixed") else "^"
            ax.errorbar(
                np.mean(pulls), np.nanmean(finals), yerr=np.nanstd(finals), fmt=marker, capsize=3, label=label(spec)
            )
        ax.set_xscale("symlog", linthresh=1)
        ax.set_title(f"{env_id}: weight pulls vs final return (mean ± std over seeds)")
        ax.set_xlabel("weight pulls per worker (log scale)")
        ax.set_ylabel("final episodic return")
        ax.legend(fontsize=8)
    fig.tight_layout()
    tradeoff_path = os.path.join(args.out_dir, f"{args.name}_tradeoff.png")
    fig.savefig(tradeoff_path, dpi=110)
    plt.close("all")
    return curves_path, tradeoff_path


def main():
    args = tyro.cli(Args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, f"{args.name}.json")
    for spec in args.strategies:
        make_strategy(spec)  # bad specs fail before any worker starts
    if args.ratio not in ("behaviour", "decoupled"):
        raise SystemExit(f"error: --ratio must be behaviour or decoupled, got {args.ratio!r}")
    if args.plot_only:
        with open(json_path) as f:
            saved = json.load(f)
        results = saved["results"]
    else:
        # The learner takes one core; the workers share the rest.
        torch.set_num_threads(1)
        results, sweep_start = [], time.time()
        if args.resume and os.path.exists(json_path):
            with open(json_path) as f:
                results = json.load(f)["results"]
        done = {(r["env_id"], r["strategy"], r["seed"]) for r in results}
        for env_id in args.env_ids:
            for seed in args.seeds:
                for spec in args.strategies:
                    if (env_id, spec, seed) in done:
                        continue
                    with make_envs(args, env_id) as envs:
                        result = train(args, envs, spec, seed)
                    result["env_id"] = env_id
                    results.append(result)
                    log.info(
                        "%s %-16s seed %d: final %s, solved at %s, %.0f pulls/worker, lag %.2f, %.0f s",
                        env_id,
                        label(spec),
                        seed,
                        result["final_return"],
                        result["solved_at"],
                        result["pulls_per_worker"],
                        result["mean_lag"],
                        result["wall_s"],
                    )
                    with open(json_path, "w") as f:
                        json.dump({"args": asdict(args), "results": results}, f)
        log.info("Sweep took %.1f min.", (time.time() - sweep_start) / 60)
    log.info("Wrote %s, %s", write_report(args, results), ", ".join(plot(args, results)))


if __name__ == "__main__":
    main()
