# CleanRL's ppo.py (https://docs.cleanrl.dev/rl-algorithms/ppo/#ppopy) with the envs in clusterenv workers.
# The one change that matters is the vector env class: `--backend gym` runs the Gymnasium original.
# `--local-policy` instead acts with a copy of the actor in every worker, which pulls new weights only
# when its KL to the learner's latest policy exceeds `--aps-threshold` (adaptive policy sync, APS).
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tyro
from advantages import compute_advantages
from episode_log import EpisodeLog
from torch.distributions.categorical import Categorical

import clusterenv


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.use_deterministic_algorithms(True)` (same seed, same results)"""
    torch_threads: int = 1
    """torch CPU threads; one is fastest for this small network and leaves the other cores to the envs"""
    cuda: bool = True
    """if toggled, the learner (network, optimizer, batches) runs on CUDA when torch can use it; else on the CPU"""
    backend: Literal["clusterenv", "gym", "async"] = "clusterenv"
    """`clusterenv.ClusterEnv` (envs in worker processes), `gym` for `gym.vector.SyncVectorEnv` (the Gymnasium
    original), or `async` for `gym.vector.AsyncVectorEnv` (Gymnasium's one process per env)"""
    local_policy: bool = False
    """act with a copy of the actor in each worker (clusterenv.PolicyRunner) instead of on the learner"""
    aps_threshold: float | None = None
    """with --local-policy: pull when KL(learner || a worker's copy) exceeds this many nats; default: APS(), which
    pulls when the copy is 16 versions' worth of the learner's own movement behind"""
    prefetch: int = 0
    """with --local-policy: rollouts each worker collects ahead while the learner trains (0: lockstep)"""
    is_clip: float = 1.0
    """with --local-policy: truncation of the importance weight pi_learner / pi_acting (decoupled PPO ratio)"""
    num_workers: int | None = None
    """clusterenv worker processes (default: clusterenv's default layout, clusterenv.learner.layout: one worker
    per core but one, the learner stepping one worker's share of the envs itself; with --local-policy the
    workers act and step that share too)"""
    learner_envs: int | None = None
    """clusterenv: the learner steps this many envs itself while the workers step the rest (default: the default
    layout's share; 0: every env in a worker; see docs/guides/dropin.md)"""
    spin_us: float | None = None
    """clusterenv: microseconds each side spins before it blocks (default: adapted, where every process has a
    core; 0: never)"""
    runs_dir: str = "runs"
    """where `<run_name>/episodes.csv` and `<run_name>/learning_curve.png` go"""

    # Algorithm specific arguments
    env_id: str = "CartPole-v1"
    """the id of the environment"""
    total_timesteps: int = 300000
    """total timesteps of the experiments"""
    learning_rate: float = 2.5e-3
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """Toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """Toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper."""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold"""
    return_window: int = 100
    """episodes averaged for the reported mean episodic return"""

    # to be filled in runtime
    batch_size: int = 0
    """the batch size (computed in runtime)"""
    minibatch_size: int = 0
    """the mini-batch size (computed in runtime)"""
    num_iterations: int = 0
    """the number of iterations (computed in runtime)"""


def check_args(args):
    """Bad CLI input ends here with a one-line error, before any worker starts."""
    if args.num_envs < 1:
        raise SystemExit(f"error: --num-envs must be at least 1, got {args.num_envs}")
    if args.torch_threads < 1:
        raise SystemExit(f"error: --torch-threads must be at least 1, got {args.torch_threads}")
    if args.num_steps < 1 or args.num_minibatches < 1:
        raise SystemExit("error: --num-steps and --num-minibatches must be at least 1")
    if args.total_timesteps < args.num_envs * args.num_steps:
        raise SystemExit(
            f"error: --total-timesteps ({args.total_timesteps}) must cover at least one rollout "
            f"of --num-envs x --num-steps = {args.num_envs * args.num_steps} steps"
        )
    if args.local_policy and args.backend != "clusterenv":
        raise SystemExit("error: --local-policy runs the actor in clusterenv workers; it needs --backend clusterenv")
    if args.local_policy and args.aps_threshold is not None and not args.aps_threshold > 0:
        raise SystemExit(f"error: --aps-threshold must be positive, got {args.aps_threshold}")
    if (args.learner_envs or args.spin_us is not None) and args.backend != "clusterenv":
        raise SystemExit("error: --learner-envs and --spin-us are ClusterEnv's options: they need --backend clusterenv")
    if args.learner_envs and args.local_policy:
        raise SystemExit("error: --local-policy acts in the workers, which then step every env: drop --learner-envs")
    if args.prefetch < 0 or (args.prefetch and not args.local_policy):
        raise SystemExit(f"error: --prefetch {args.prefetch} needs --local-policy and must not be negative")
    try:
        spec = gym.spec(args.env_id)
    except gym.error.Error as exc:
        raise SystemExit(f"error: --env-id {args.env_id!r}: {exc}") from None
    probe = gym.make(spec)
    space = probe.action_space
    probe.close()
    if not isinstance(space, gym.spaces.Discrete):
        raise SystemExit(f"error: --env-id {args.env_id!r} has action space {space}; this script needs Discrete")


def make_env(env_id, idx, run_name):
    def thunk():
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        return env

    return thunk


def layer_init(layer, std=2**0.5, bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, envs):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(np.array(envs.single_observation_space.shape).prod(), 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(np.array(envs.single_observation_space.shape).prod(), 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, envs.single_action_space.n), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    args.batch_size = int(args.num_envs * args.num_steps)
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = args.total_timesteps // args.batch_size
    run_name = f"{args.env_id}__{args.exp_name}__{args.backend}__{args.seed}__{int(time.time())}".replace("/", "-")

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    # cuBLAS is deterministic only with a fixed workspace; on CUDA an op with no deterministic kernel warns, not fails.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=device.type != "cpu")
    torch.set_num_threads(args.torch_threads)

    # env setup: the Gymnasium original is `envs = gym.vector.SyncVectorEnv([...])`
    env_fns = [make_env(args.env_id, i, run_name) for i in range(args.num_envs)]
    if args.backend == "clusterenv":
        envs: gym.vector.VectorEnv = clusterenv.ClusterEnv(
            env_fns, num_workers=args.num_workers, learner_envs=args.learner_envs, spin_us=args.spin_us
        )
    elif args.backend == "async":
        envs = gym.vector.AsyncVectorEnv(env_fns)  # Gymnasium's one process per env
    else:
        envs = gym.vector.SyncVectorEnv(env_fns)

    agent = Agent(envs).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    log = EpisodeLog(
        os.path.join(args.runs_dir, run_name), args.num_iterations * args.batch_size, args.return_window, envs
    )
    # Only the actor goes to the workers; the critic stays here and values the returned observations.
    runner = (
        clusterenv.PolicyRunner(
            envs,
            agent.actor,
            clusterenv.APS() if args.aps_threshold is None else clusterenv.APS(threshold=args.aps_threshold),
            seed=args.seed,
            prefetch=args.prefetch,
            device=device,  # the workers get CPU copies; the learner's KL probes run on `device`
        )
        if args.local_policy
        else None
    )

    # ALGO Logic: Storage setup
    obs = torch.zeros((args.num_steps, args.num_envs) + envs.single_observation_space.shape).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs) + envs.single_action_space.shape).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    terminated = torch.zeros((args.num_steps, args.num_envs), dtype=torch.bool).to(device)
    truncated = torch.zeros((args.num_steps, args.num_envs), dtype=torch.bool).to(device)
    autoreset = torch.zeros((args.num_steps, args.num_envs), dtype=torch.bool).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    # TRY NOT TO MODIFY: start the game
    global_step = 0
    start_time = time.time()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.Tensor(next_obs).to(device)
    next_autoreset = torch.zeros(args.num_envs, dtype=torch.bool).to(device)

    for iteration in range(1, args.num_iterations + 1):
        # Annealing the rate if instructed to do so.
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            lrnow = frac * args.learning_rate
            optimizer.param_groups[0]["lr"] = lrnow

        if runner is not None:
            # ALGO LOGIC: the workers' local actors play all num_steps; logprobs are those of the acting copy.
            batch = runner.rollout(args.num_steps)
            for t, info in enumerate(batch.infos):
                log.record(global_step + (t + 1) * args.num_envs, info)
            global_step += args.batch_size
            tensors = batch.as_tensors(device)
            obs.copy_(tensors["obs"])
            actions.copy_(tensors["actions"])
            logprobs.copy_(tensors["logprobs"])
            rewards.copy_(tensors["rewards"])
            terminated.copy_(tensors["terminations"])
            truncated.copy_(tensors["truncations"])
            autoreset.copy_(tensors["autoreset"])
            with torch.no_grad():
                values.copy_(agent.get_value(obs).squeeze(-1))
            next_obs = tensors["next_obs"].float()
        else:
            for step in range(0, args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                # Gymnasium 1.x NEXT_STEP autoreset: an env whose previous step ended its episode resets now,
                # ignoring its action (reward 0). CleanRL's 0.29 loop has no such step.
                autoreset[step] = next_autoreset

                # ALGO LOGIC: action logic
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                    values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob

                # TRY NOT TO MODIFY: execute the game and log data.
                next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                terminated[step] = torch.as_tensor(terminations).to(device)
                truncated[step] = torch.as_tensor(truncations).to(device)
                next_autoreset = terminated[step] | truncated[step]
                rewards[step] = torch.tensor(reward).to(device).view(-1)
                next_obs = torch.Tensor(next_obs).to(device)
                log.record(global_step, infos)

        # bootstrap value if not done
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            # V(obs[t + 1]): at a truncation NEXT_STEP returns the episode's true final observation (the reset
            # comes one step later), so this bootstraps truncated steps from the right state.
            next_values = torch.cat([values[1:], next_value])
            advantages, returns, valid = compute_advantages(
                rewards, values, next_values, terminated, truncated, autoreset, args.gamma, args.gae_lambda
            )

        # flatten the batch
        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape((-1,) + envs.single_action_space.shape)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        # Reset steps carry no transition (see examples/advantages.py): only the other rows go into the loss.
        b_valid = np.flatnonzero(valid.reshape(-1).cpu().numpy())
        b_weights = torch.ones_like(b_logprobs)
        if runner is not None:
            # The acting copy may lag the learner (APS, prefetch): clip against the learner's own pre-update
            # policy and weight each sample by min(pi_learner / pi_acting, is_clip) (Hilton et al. 2021,
            # "decoupled" PPO). With an up-to-date copy the weight is 1 and this is ppo.py.
            with torch.no_grad():
                _, prox_logprobs, _, _ = agent.get_action_and_value(b_obs, b_actions.long())
            b_weights = torch.clamp((prox_logprobs - b_logprobs).exp(), max=args.is_clip)
            b_logprobs = prox_logprobs

        # Optimizing the policy and value network
        clipfracs = []
        for _epoch in range(args.update_epochs):
            b_inds = np.random.permutation(b_valid)
            for mb_inds in np.array_split(b_inds, args.num_minibatches):
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()

                with torch.no_grad():
                    # calculate approx_kl http://joschu.net/blog/kl-approx.html
                    old_approx_kl = (-logratio).mean()
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]

                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                # Policy loss
                pg_loss1 = -mb_advantages * ratio
                pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                pg_loss = (b_weights[mb_inds] * torch.max(pg_loss1, pg_loss2)).mean()

                # Value loss
                newvalue = newvalue.view(-1)
                if args.clip_vloss:
                    v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                    v_clipped = b_values[mb_inds] + torch.clamp(
                        newvalue - b_values[mb_inds],
                        -args.clip_coef,
                        args.clip_coef,
                    )
                    v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                    v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
                    v_loss = 0.5 * v_loss_max.mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        y_pred, y_true = b_values[b_valid].cpu().numpy(), b_returns[b_valid].cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y

        # TRY NOT TO MODIFY: record rewards for plotting purposes
        sps = int(global_step / (time.time() - start_time))
        scalars = {
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            "losses/value_loss": v_loss.item(),
            "losses/policy_loss": pg_loss.item(),
            "losses/entropy": entropy_loss.item(),
            "losses/old_approx_kl": old_approx_kl.item(),
            "losses/approx_kl": approx_kl.item(),
            "losses/clipfrac": np.mean(clipfracs),
            "losses/explained_variance": explained_var,
            "charts/SPS": sps,
        }
        postfix = {}
        if runner is not None:
            runner.publish(agent.actor)
            sync = runner.telemetry.summary()
            scalars.update(sync)
            postfix["pulls"] = sync["sync/pulls"]
        log.progress(global_step, scalars, **postfix)

    if runner is not None:
        runner.stop()
    envs.close()
    mode = (
        f"local policy, APS {args.aps_threshold or '(default)'}, prefetch {args.prefetch}"
        if args.local_policy
        else args.backend
    )
    log.close(f"PPO {args.env_id} ({mode}, seed {args.seed}, {device})")
