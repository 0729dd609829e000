"""APS where weights are heavy: PPO with a 1.5M-parameter actor on workers behind a slow link.

The other host is a network namespace (``tests/netns.py``) joined to the learner's by a veth
pair limited with ``tc ... tbf`` to each of ``--links``; its ``--num-workers`` workers
(``launcher="external"``) reach the learner only over that link, so every weight pull crosses
it. The learner trains with ``aps_sweep.py``'s PPO loop (CleanRL's ppo.py, decoupled ratio),
its actor widened to ``--hidden`` units (two hidden layers: 1,507,970 parameters at 1224, 6.0 MB
as float32); the critic stays on the learner. Each cell is a sync strategy and a weight
encoding (``PolicyRunner(weights=...)``), run for the same env-step budget with each seed.
Cells alternate within each seed, seeds within each link.

    sudo python benchmarks/aps_heavy.py            # the committed results; ~50 min on 2 cores
    sudo python benchmarks/aps_heavy.py --quick    # a smoke run: one link, one seed, 3 updates per cell
    python benchmarks/aps_heavy.py --report-only   # redraw the table and plot from the JSON

Writes ``results/aps_heavy.json``, ``results/aps_heavy.md`` and ``results/aps_heavy.png``.
Needs root and iproute2 (the namespace and its link are removed at the end, whatever happens).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import tyro
from torch import nn

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent)]  # aps_sweep's PPO; tests.netns for the namespace
from aps_sweep import Agent, label, layer_init, train  # noqa: E402
from aps_sweep import Args as SweepArgs  # noqa: E402
from support.report import command_line  # noqa: E402

from clusterenv import ClusterEnv, LossyWeights  # noqa: E402
from tests import netns  # noqa: E402

log = logging.getLogger("aps_heavy")
RESULTS = ROOT / "results"
SECRET = "the aps_heavy benchmark's own secret"
# (strategy spec as aps_sweep.py reads it, weights encoding): every strategy with full and lossless
# weights, APS with lossy ones too. APS at 0.05, the best single threshold over the four tasks of the
# APS evidence page; FixedInterval(4) the best single interval there.
CELLS = (
    ("every", "full"),
    ("every", "lossless"),
    ("fixed:4", "full"),
    ("fixed:4", "lossless"),
    ("aps:0.05", "full"),
    ("aps:0.05", "lossless"),
    ("aps:0.05", "lossy"),
)


@dataclasses.dataclass
class Args(SweepArgs):
    """aps_sweep.py's PPO settings, with this benchmark's defaults and its own options."""

    links: tuple[str, ...] = ("100mbit", "1gbit")
    """link rates (tc's units), each a run of every cell and seed"""
    cells: tuple[str, ...] = tuple(f"{strategy}/{weights}" for strategy, weights in CELLS)
    """strategy/weights pairs: every, fixed:N, aps:default, aps:T (aps_sweep.py's specs) / full, lossless, lossy"""
    seeds: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 3])
    total_timesteps: int = 24_576
    num_envs: int = 8
    num_workers: int = 4
    learning_rate: float = 2.5e-4
    solved_return: float | None = 475.0
    hidden: int = 1224
    """width of the actor's two hidden layers"""
    target_return: float = 100.0
    """the rolling mean return whose first crossing is time_to_target_s"""
    quick: bool = False
    """smoke run: the first link, one seed, 3 updates per cell"""
    report_only: bool = False
    """redraw the table and plot from the JSON"""
    resume: bool = False
    """keep the runs already in the JSON, run only the missing (link, cell, seed)"""
    name: str = "aps_heavy"


def make_env() -> gym.Env:
    """CartPole, its episode returns recorded for the learning curve (imported by the workers)."""
    return gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))


def heavy_agent(envs, hidden: int) -> Agent:
    """aps_sweep.py's agent with a wide actor: what the workers hold and pull."""
    agent = Agent(envs)
    obs_size = int(np.prod(envs.single_observation_space.shape))
    agent.actor = nn.Sequential(
        layer_init(nn.Linear(obs_size, hidden)),
        nn.Tanh(),
        layer_init(nn.Linear(hidden, hidden)),
        nn.Tanh(),
        layer_init(nn.Linear(hidden, envs.single_action_space.n), std=0.01),
    )
    return agent


def weights_option(name: str) -> str | LossyWeights:
    return {"full": "full", "lossless": "lossless", "lossy": LossyWeights()}[name]


def strategy_label(spec: str) -> str:
    name, _, value = spec.partition(":")
    if name == "aps" and not value.replace(".", "", 1).isdigit():
        return label(spec)  # APS(), APS(updates=K), APS(T, "p95")
    return {"every": "EveryUpdate", "fixed": f"Fixed({value})", "aps": f"APS(eps={value})"}[name]


def time_to_target(curve: list[dict], target: float) -> float | None:
    return next((p["wall_s"] for p in curve if p["mean_return"] is not None and p["mean_return"] >= target), None)


def run_cell(host: netns.OtherHost, args: Args, link: str, cell: str, seed: int) -> dict:
    """One PPO run with its workers on the other host; the JSON row of the issue's form, and more."""
    spec, weights = cell.split("/")
    with netns.external_workers(host, args.num_workers, SECRET) as address:
        with ClusterEnv(
            [make_env] * args.num_envs, num_workers=args.num_workers, bind=address, secret=SECRET, launcher="external"
        ) as envs:
            moved = host.rx_bytes() + host.tx_bytes()
            result = train(
                args,
                envs,
                spec,
                seed,
                make_agent=functools.partial(heavy_agent, hidden=args.hidden),
                weights=weights_option(weights),
            )
            result["link_bytes"] = host.rx_bytes() + host.tx_bytes() - moved
    measured = [
        (kl, pulled) for kl, pulled in zip(result["start_kls"], result["start_pulled"], strict=True) if kl is not None
    ]
    # The acting copy's KL at a rollout start: the measured one if the worker kept its copy; after a pull,
    # 0 for exact weights and at most the guard's bound for a lossy delta (the guard checked it on the worker).
    pulled_kl = LossyWeights().guard_kl if weights == "lossy" else 0.0
    acting = [pulled_kl if pulled else kl for kl, pulled in measured]
    return {
        "link_mbit": netns.rate_bits(link) // 10**6,
        "strategy": strategy_label(spec),
        "deltas": None if weights == "full" else weights,
        "seed": seed,
        "wall_s": result["wall_s"],
        "weight_bytes": result["weight_bytes"],
        "pulls": result["pulls"],
        "final_return": result["final_return"],
        "time_to_target_s": time_to_target(result["curve"], args.target_return),
        "max_kl_at_rollout_start": max(acting) if acting else None,
        "max_kl_before_pull": max((kl for kl, _ in measured), default=None),
        "full_pulls": result["full_pulls"],
        "delta_pulls": result["delta_pulls"],
        "guard_trips": result["guard_trips"],
        "link_bytes": result["link_bytes"],
        "env_steps": result["env_steps"],
        "curve": [{k: p[k] for k in ("step", "wall_s", "mean_return", "pulls")} for p in result["curve"]],
    }


def cell_name(run: dict) -> str:
    return f"{run['strategy']} {run['deltas'] or 'full'}"


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(args: Args, saved: dict) -> str:
    runs = saved["runs"]
    lines = [
        "# APS where weights are heavy",
        "",
        f"{' then '.join(f'`{c}`' for c in saved['commands'])} on {saved['host']}, {saved['cores']} cores, "
        f"{saved['date']}. PPO (aps_sweep.py's loop) on {saved['env']} with a {saved['policy_params']:,}-parameter "
        f"actor ({args.hidden}x{args.hidden} MLP, {saved['policy_params'] * 4 / 1e6:.1f} MB as float32), "
        f"{args.num_envs} envs on {args.num_workers} workers in another network namespace behind a tbf-limited "
        f"veth link; {saved['env_steps']:,} env steps per run, lockstep rollouts of {args.num_steps} steps. "
        f"Medians over seeds {sorted({r['seed'] for r in runs})}, with the range over seeds in brackets. "
        f"Time to target: wall-clock seconds until the rolling mean return ({args.return_window} episodes) first "
        f"reaches {args.target_return:g} (runs that never did are left out; how many did is in brackets). "
        "Max KL: the largest KL(learner ‖ acting copy) at a rollout start over the run's workers and seeds, after "
        "the pull decision (a pulled copy counts 0, or the guard's bound, 0.001, for a lossy delta); before "
        "the decision in brackets. "
        "Weight bytes: weight arrays and delta frames the runner handed to the wire (pulls after the first "
        "shipment); link bytes: everything that crossed the link, both ways, headers included.",
        "",
    ]
    for link in sorted({r["link_mbit"] for r in runs}):
        rows = [r for r in runs if r["link_mbit"] == link]
        lines += [
            f"### {link:,} Mbit/s",
            "",
            "| strategy | weights | wall s | weight MB | link MB | pulls (delta / full, guard trips) "
            "| final return | time to target s | max KL at rollout start (before pull) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in dict.fromkeys(cell_name(r) for r in rows):
            lines.append(table_row([r for r in rows if cell_name(r) == name]))
        lines += ["", *targets(rows), ""]
    lines += [f"![Return against wall-clock time]({args.name}.png)", ""]
    return "\n".join(lines)


def spread(cell: list[dict], key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
    """``median [min, max]`` of ``key`` over a cell's seeds."""
    values = [r[key] / scale for r in cell if r[key] is not None]
    if not values:
        return "n/a"
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def table_row(cell: list[dict]) -> str:
    """One cell's row: medians over its seeds."""
    reached = [r["time_to_target_s"] for r in cell if r["time_to_target_s"] is not None]
    target = f"{statistics.median(reached):.0f} ({len(reached)}/{len(cell)})" if reached else f"never (0/{len(cell)})"
    kls = [r["max_kl_at_rollout_start"] for r in cell if r["max_kl_at_rollout_start"] is not None]
    before = [r["max_kl_before_pull"] for r in cell if r["max_kl_before_pull"] is not None]
    pulls = " ".join(
        [
            f"{median([r['pulls'] for r in cell]):.0f}",
            f"({median([r['delta_pulls'] for r in cell]):.0f} / {median([r['full_pulls'] for r in cell]):.0f},",
            f"{median([r['guard_trips'] for r in cell]):.0f})",
        ]
    )
    return (
        f"| {cell[0]['strategy']} | {cell[0]['deltas'] or 'full'} | {spread(cell, 'wall_s')} "
        f"| {spread(cell, 'weight_bytes', 1e6, '.1f')} | {spread(cell, 'link_bytes', 1e6, '.1f')} | {pulls} "
        f"| {spread(cell, 'final_return')} | {target} "
        f"| {f'{max(kls):.3f} ({max(before):.3f})' if kls and before else 'n/a'} |"
    )


def targets(rows: list[dict]) -> list[str]:
    """The issue's three ratios at this link, from the medians over seeds, per APS threshold run."""

    def cell(strategy: str, deltas: str | None) -> list[dict]:
        return [r for r in rows if r["strategy"] == strategy and r["deltas"] == deltas]

    def ratio(key: str, over: list[dict], under: list[dict]) -> float:
        return median([r[key] for r in over]) / max(1, median([r[key] for r in under]))

    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    every_full, out = cell("EveryUpdate", None), []
    for aps in [s for s in strategies if s.startswith("APS")]:
        if every_full and (lossy := cell(aps, "lossy")):
            out.append(
                f"- EveryUpdate with full weights takes **{ratio('wall_s', every_full, lossy):.2f}x** the wall-clock "
                f"time of {aps} with lossy deltas, which sends **{ratio('weight_bytes', every_full, lossy):.1f}x** "
                "fewer weight bytes."
            )
    for strategy in strategies:
        if (full := cell(strategy, None)) and (lossless := cell(strategy, "lossless")):
            out.append(
                f"- {strategy}: lossless deltas send **{ratio('weight_bytes', full, lossless):.2f}x** fewer weight "
                "bytes than full weights."
            )
    return out


def plot(args: Args, saved: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link_mbit"] for r in saved["runs"]})
    fig, axes = plt.subplots(1, len(links), figsize=(7 * len(links), 4.6), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        rows = [r for r in saved["runs"] if r["link_mbit"] == link]
        for name in dict.fromkeys(cell_name(r) for r in rows):
            cell = [r for r in rows if cell_name(r) == name]
            # Per seed, return against wall time; the cell's line is the median curve on a common time grid.
            end = max(p["wall_s"] for r in cell for p in r["curve"])
            grid = np.linspace(0, end, 60)
            curves = []
            for r in cell:
                t = np.array([p["wall_s"] for p in r["curve"]])
                y = np.array([np.nan if p["mean_return"] is None else p["mean_return"] for p in r["curve"]])
                curves.append(np.where(grid <= t[-1], np.interp(grid, t, np.nan_to_num(y)), np.nan))
            style = ":" if name.endswith("full") else "--" if name.endswith("lossless") else "-"
            ax.plot(grid, np.nanmedian(np.array(curves), axis=0), style, label=name, linewidth=1.5)
        ax.axhline(args.target_return, color="grey", linewidth=0.6)
        ax.set_title(f"{link:,} Mbit/s link: median over seeds")
        ax.set_xlabel("wall-clock seconds")
        ax.set_ylabel(f"rolling mean return ({args.return_window} episodes)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=110)
    plt.close(fig)


def main(args: Args) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    path = RESULTS / f"{args.name}.json"
    if args.quick:
        args = dataclasses.replace(
            args, links=args.links[:1], seeds=args.seeds[:1], total_timesteps=3 * args.num_envs * args.num_steps
        )
    if not args.report_only:
        if reason := netns.unavailable():
            sys.exit(f"Cannot make another host here: {reason}.")
        # Lockstep: the workers wait while the learner trains, so its update may use every core.
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        probe = gym.vector.SyncVectorEnv([make_env])
        params = sum(p.numel() for p in heavy_agent(probe, args.hidden).actor.parameters())
        probe.close()
        saved = {
            "env": "CartPole-v1",
            "policy_params": params,
            "env_steps": args.total_timesteps,
            "cores": len(os.sched_getaffinity(0)),
            "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "runs": [],
            "commands": [],
        }
        saved["commands"].append(f"sudo {command_line(__file__)}")
        if args.resume and path.exists():
            previous = json.loads(path.read_text())
            saved["runs"], saved["commands"] = previous["runs"], previous.get("commands", [])
        done = {(r["link_mbit"], cell_name(r), r["seed"]) for r in saved["runs"]}
        for link in args.links:
            with netns.other_host(link) as host:
                for round_, seed in enumerate(args.seeds):
                    order = args.cells[round_ % len(args.cells) :] + args.cells[: round_ % len(args.cells)]
                    for cell in order:
                        spec, weights = cell.split("/")
                        key = (netns.rate_bits(link) // 10**6, f"{strategy_label(spec)} {weights}", seed)
                        if key in done:
                            continue
                        run = run_cell(host, args, link, cell, seed)
                        saved["runs"].append(run)
                        log.info(
                            "%s %s seed %d: %.0f s, %.1f MB of weights, %d pulls, final return %s",
                            link,
                            cell,
                            seed,
                            run["wall_s"],
                            run["weight_bytes"] / 1e6,
                            run["pulls"],
                            run["final_return"],
                        )
                        RESULTS.mkdir(exist_ok=True)
                        path.write_text(json.dumps(saved, indent=1) + "\n")
    saved = json.loads(path.read_text())
    (RESULTS / f"{args.name}.md").write_text(summarize(args, saved))
    plot(args, saved)
    print((RESULTS / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main(tyro.cli(Args))
