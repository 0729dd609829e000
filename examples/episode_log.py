"""Episode statistics for the example scripts: CSV, progress bar, TensorBoard (if installed), PNG curve.

Shared by `ppo_cartpole.py`, `dqn_cartpole.py` and `ppo_atari.py`, which import it from this folder
(Python puts a script's own folder first on `sys.path`).
"""

import csv
import os
import time

import numpy as np
from tqdm import tqdm

try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # TensorBoard is optional: episodes.csv and the PNG are always written
    SummaryWriter = None

__all__ = ["EpisodeLog"]


class EpisodeLog:
    """Episode statistics to `episodes.csv`, the progress bar, TensorBoard (if installed) and a PNG.

    Given a ClusterEnv (`envs`), it also logs, at every progress update, the live and lost worker
    processes, the envs whose episodes a lost or recycled worker cut (`infos["worker_restarted"]`),
    the workers' CPU seconds and resident memory (`worker_info`), and the learner's busy and waiting
    time per batch step (`learner_info`), to `workers.csv` and TensorBoard.
    """

    def __init__(self, run_dir, total_timesteps, window, envs=None):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir, self.window, self.start = run_dir, window, time.time()
        self.file = open(os.path.join(run_dir, "episodes.csv"), "w", newline="")
        self.csv = csv.writer(self.file)
        self.csv.writerow(["global_step", "env", "episodic_return", "episodic_length", "wall_time_s"])
        self.steps, self.returns = [], []
        self.writer = SummaryWriter(run_dir) if SummaryWriter is not None else None
        self.bar = tqdm(total=total_timesteps, unit="step", unit_scale=True, dynamic_ncols=True, mininterval=1.0)
        self.envs = envs if hasattr(envs, "worker_info") else None
        self.cut_envs = 0
        if self.envs is not None:
            self.workers_file = open(os.path.join(run_dir, "workers.csv"), "w", newline="")
            self.workers_csv = csv.writer(self.workers_file)
            self.workers_csv.writerow(
                [
                    "global_step",
                    "live_workers",
                    "lost_workers",
                    "cut_envs",
                    "workers_cpu_s",
                    "workers_rss_mb",
                    "learner_busy_ms",
                    "learner_waiting_ms",
                    "wall_time_s",
                ]
            )

    def record(self, global_step, infos):
        # RecordEpisodeStatistics runs inside each env (in the workers, for ClusterEnv). With NEXT_STEP
        # autoreset its `episode` info comes with the step that ended the episode; with SAME_STEP it
        # is under `final_info`, because the step's own info is that of the reset.
        if "worker_restarted" in infos:
            self.cut_envs += int(np.count_nonzero(infos["worker_restarted"]))
        for info in (infos, infos.get("final_info", {})):
            if "_episode" not in info:
                continue
            for i in np.flatnonzero(info["_episode"]):
                ret, length = float(info["episode"]["r"][i]), int(info["episode"]["l"][i])
                self.csv.writerow([global_step, int(i), ret, length, round(time.time() - self.start, 3)])
                self.steps.append(global_step)
                self.returns.append(ret)
                if self.writer is not None:
                    self.writer.add_scalar("charts/episodic_return", ret, global_step)
                    self.writer.add_scalar("charts/episodic_length", length, global_step)

    def mean_return(self):
        return float(np.mean(self.returns[-self.window :])) if self.returns else float("nan")

    def progress(self, global_step, scalars, **postfix):
        if self.envs is not None:
            workers = self.envs.worker_info
            states = [w["state"] for w in workers]
            fleet = (states.count("active"), states.count("lost"), self.cut_envs)
            # Summed over the worker processes this learner started (None for workers started elsewhere).
            cpu_s = sum(w["cpu_s"] or 0.0 for w in workers)
            rss_mb = sum(w["rss_mb"] or 0.0 for w in workers)
            timing = self.envs.learner_info
            busy, waiting = ((timing[k] or {}).get("p50", float("nan")) for k in ("busy_ms", "waiting_ms"))
            usage = [round(cpu_s, 2), round(rss_mb, 1), round(busy, 3), round(waiting, 3)]
            self.workers_csv.writerow([global_step, *fleet, *usage, round(time.time() - self.start, 3)])
            self.workers_file.flush()
            scalars = {
                **scalars,
                "workers/live": fleet[0],
                "workers/cut_envs": fleet[2],
                "workers/cpu_s": cpu_s,
                "workers/rss_mb": rss_mb,
                "learner/busy_ms": busy,
                "learner/waiting_ms": waiting,
            }
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, global_step)
        self.bar.set_postfix(episodes=len(self.returns), ret=f"{self.mean_return():.1f}", **postfix, refresh=False)
        self.bar.update(global_step - self.bar.n)

    def close(self, title):
        self.bar.close()
        self.file.close()
        if self.envs is not None:
            self.workers_file.close()
        if self.writer is not None:
            self.writer.close()
        # The Figure API needs no display and no global pyplot state.
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4), layout="tight")
        ax = fig.subplots()
        ax.plot(self.steps, self.returns, ".", alpha=0.3, label="episode")
        if self.returns:
            kernel = min(self.window, len(self.returns))
            rolling = np.convolve(self.returns, np.ones(kernel) / kernel, mode="valid")
            ax.plot(self.steps[kernel - 1 :], rolling, label=f"mean of {kernel}")
        ax.set(title=title, xlabel="global step", ylabel="episodic return")
        ax.legend(loc="lower right")
        fig.savefig(os.path.join(self.run_dir, "learning_curve.png"), dpi=100)
        print(
            f"{title}: {len(self.returns)} episodes in {time.time() - self.start:.1f} s; mean episodic return of the "
            f"last {min(self.window, len(self.returns))}: {self.mean_return():.1f}; logs in {self.run_dir}"
        )
