# Stable-Baselines3's PPO with the envs in clusterenv workers. The one change that matters is the
# VecEnv class: `--backend subproc` runs SB3's SubprocVecEnv, `--backend dummy` its DummyVecEnv, and
# with the same seed DummyVecEnv and clusterenv give the same episodes and the same trained weights.
# Needs `pip install -e ".[sb3]"`.
import os
import time
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import torch
import tyro
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from clusterenv.sb3 import ClusterVecEnv


@dataclass
class Args:
    env_id: str = "CartPole-v1"
    """the id of the environment"""
    num_envs: int = 8
    """the number of parallel environments"""
    num_workers: int | None = None
    """clusterenv worker processes (with --backend clusterenv; default: clusterenv's default layout)"""
    backend: Literal["clusterenv", "subproc", "dummy"] = "clusterenv"
    """`ClusterVecEnv`, SB3's `SubprocVecEnv`, or SB3's `DummyVecEnv`"""
    total_timesteps: int = 100_000
    """total timesteps of the experiment"""
    n_steps: int = 256
    """steps per env per rollout (SB3's `n_steps`)"""
    seed: int = 1
    """seed of the experiment"""
    runs_dir: str = "runs"
    """where `<run_name>/episodes.csv` goes"""


def make_env(env_id: str):
    def thunk():
        return Monitor(gym.make(env_id))

    return thunk


class EpisodeCSV(BaseCallback):
    """Each finished episode's return and length, from Monitor's `info["episode"]`, to a CSV file."""

    def __init__(self, path: str):
        super().__init__()
        self.file = open(path, "w")
        self.file.write("global_step,env,episodic_return,episodic_length\n")

    def _on_step(self) -> bool:
        for env, info in enumerate(self.locals["infos"]):
            if "episode" in info:
                self.file.write(f"{self.num_timesteps},{env},{info['episode']['r']},{info['episode']['l']}\n")
        return True

    def _on_training_end(self) -> None:
        self.file.close()


if __name__ == "__main__":
    args = tyro.cli(Args)
    torch.set_num_threads(1)
    thunks = [make_env(args.env_id) for _ in range(args.num_envs)]
    if args.backend == "clusterenv":
        env = ClusterVecEnv(thunks, num_workers=args.num_workers)  # was: SubprocVecEnv(thunks)
    elif args.backend == "subproc":
        env = SubprocVecEnv(thunks)
    else:
        env = DummyVecEnv(thunks)
    run_dir = os.path.join(args.runs_dir, f"{args.env_id}__sb3_ppo__{args.seed}__{int(time.time())}")
    os.makedirs(run_dir, exist_ok=True)
    started = time.time()
    model = PPO("MlpPolicy", env, n_steps=args.n_steps, seed=args.seed, device="cpu", verbose=0)
    model.learn(args.total_timesteps, callback=EpisodeCSV(os.path.join(run_dir, "episodes.csv")))
    env.close()
    print(f"{args.total_timesteps} steps in {time.time() - started:.1f} s on {args.backend}; episodes in {run_dir}")
