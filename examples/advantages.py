# Generalized advantage estimation (GAE) for the PPO examples under Gymnasium 1.x NEXT_STEP autoreset.
#
# CleanRL's ppo.py was written for gymnasium 0.29, where an env reset inside `step` and the loop needed one
# `dones` flag. Under NEXT_STEP (the 1.x default) the step after a done is a *reset step*: the env ignores the
# action, returns reward 0 and the first observation of the new episode. So, per step t of a (T, N) rollout:
#   * a termination at t: no bootstrap, V(after) = 0;
#   * a truncation at t: bootstrap from V(obs[t + 1]), the true final observation of the episode, which is
#     what NEXT_STEP returns at step t (the reset only comes at step t + 1);
#   * either one: the advantage of t does not look past t (the next row belongs to a reset);
#   * a reset step t: no transition to learn from; it is masked out of the loss.
import torch


def compute_advantages(rewards, values, next_values, terminations, truncations, autoreset, gamma, gae_lambda):
    """GAE advantages, returns and the loss mask of a rollout; every argument is a (T, N) tensor.

    Args:
        rewards: reward of step t.
        values: V(obs[t]).
        next_values: V(obs[t + 1]), the observation step t returned (for t = T - 1, the one after the rollout).
        terminations, truncations: the done flags step t returned.
        autoreset: True where step t was a reset step.
        gamma, gae_lambda: the discount and the GAE lambda.

    Returns:
        (advantages, returns, mask): advantages and returns (advantages + values) are 0 and values on reset
        steps; mask is a bool tensor, False on reset steps, for the rows that go into the loss.
    """
    terminations, truncations, mask = terminations.bool(), truncations.bool(), ~autoreset.bool()
    bootstrap = (~terminations).to(values.dtype)
    continues = (~(terminations | truncations)).to(values.dtype)
    deltas = (rewards + gamma * next_values * bootstrap - values) * mask
    advantages = torch.zeros_like(values)
    lastgaelam = torch.zeros_like(values[0])
    for t in reversed(range(values.shape[0])):
        lastgaelam = deltas[t] + gamma * gae_lambda * continues[t] * lastgaelam * mask[t]
        advantages[t] = lastgaelam
    return advantages, advantages + values, mask
