# The cross-task report of the APS sweeps: does one APS setting transfer across tasks where no single
# FixedInterval(n) does, where are the pulls spent, and what divergence does each strategy act with? Three APS
# families: an absolute bound on the mean KL (aps:T), one on its 95th percentile over the probe states
# (aps:p95:T), and the default's bound relative to the learner's movement (aps:default, aps:xK).
#
# Reads the JSON files that `benchmarks/aps_sweep.py` wrote (one per task, the same strategies), writes
# NAME.md (tables) and NAME_pareto.png (return against pulls, per task). The sweeps (about 3 h on 2 cores):
#
#   S="every fixed:2 fixed:4 fixed:8 aps:0.01 aps:0.05 aps:0.1 aps:p95:0.1 aps:x4 aps:x8 aps:default"
#   python benchmarks/aps_sweep.py --env-ids CartPole-v1 --strategies $S --seeds 1 2 3 4 5 6 7 8 --name aps_cartpole
#   python benchmarks/aps_sweep.py --env-ids CartPole-v1 --strategies $S --seeds 1 2 3 4 5 6 7 8 --no-anneal-lr \
#       --name aps_cartpole_constant_lr
#   python benchmarks/aps_sweep.py --env-ids Acrobot-v1 --strategies $S --seeds 1 2 3 4 5 6 7 8 --name aps_acrobot
#   python benchmarks/aps_sweep.py --env-ids LunarLander-v3 --strategies $S --seeds 1 2 3 4 5 6 7 8 \
#       --total-timesteps 1000000 --num-envs 64 --num-workers 4 --num-minibatches 32 --gamma 0.999 --gae-lambda 0.98 \
#       --solved-return 200 --name aps_lunarlander
#   python benchmarks/aps_sweep.py --env-ids Pendulum-v1 --strategies $S --seeds 1 2 3 4 --total-timesteps 122880 \
#       --num-envs 8 --num-steps 256 --gamma 0.9 --gae-lambda 0.95 --update-epochs 10 --num-minibatches 32 \
#       --ent-coef 0.0 --name aps_pendulum
#   python benchmarks/aps_report.py
import json
import os
from dataclasses import dataclass, field

import numpy as np
import tyro
from aps_sweep import label  # noqa: I001 (the sibling script)
from support.report import command_line

#: The five task settings, one sweep each: the regret is computed over all of them.
TASK_SWEEPS = ("aps_cartpole", "aps_acrobot", "aps_lunarlander", "aps_pendulum", "aps_cartpole_constant_lr")


@dataclass
class Args:
    sweeps: list[str] = field(default_factory=lambda: list(TASK_SWEEPS))
    """sweep names (NAME.json in results_dir), one task each"""
    transfer: list[str] = field(default_factory=lambda: list(TASK_SWEEPS))
    """the sweeps the single-setting regret is computed over; a sweep that has not run all its (strategy, seed)
    runs yet is left out of it"""
    results_dir: str = "benchmarks/results"
    """where the sweeps' JSON files are, and where the report goes"""
    name: str = "aps_report"
    """file name stem of the outputs"""


def load(results_dir, name):
    with open(os.path.join(results_dir, f"{name}.json")) as f:
        saved = json.load(f)
    return saved["args"], saved["results"]


def task_title(args, name):
    anneal = "annealed" if args.get("anneal_lr", True) else "constant"
    return f"{args['env_ids'][0]} (lr {anneal})" if "constant" in name else args["env_ids"][0]


def finals(runs):
    return np.array([np.nan if r["final_return"] is None else r["final_return"] for r in runs], dtype=float)


def auc(run):
    """Area under the learning curve: the mean of the rolling mean return over all updates."""
    values = [p["mean_return"] for p in run["curve"] if p["mean_return"] is not None]
    return float(np.mean(values)) if values else float("nan")


def acting_kls(runs):
    """KL(learner || acting copy) at each rollout start, per worker: 0 after a pull, else the measured KL."""
    out = []
    for r in runs:
        out += [
            0.0 if pulled else kl for kl, pulled in zip(r.get("start_kls", []), r.get("start_pulled", []), strict=True)
        ]
    return np.array(out, dtype=float)


def measured_kls(runs):
    return np.array([kl for r in runs for kl in r.get("start_kls", [])], dtype=float)


def early_pull_share(runs):
    """Share of a run's pulls made in the first half of its updates (a fixed schedule: 0.5)."""
    shares = []
    for r in runs:
        pulls = [p["pulls"] for p in r["curve"]]
        if pulls and pulls[-1]:
            shares.append(pulls[len(pulls) // 2 - 1] / pulls[-1])
    return float(np.mean(shares)) if shares else float("nan")


def curve_mean(runs, key):
    return float(np.mean([np.mean([p[key] for p in r["curve"]]) for r in runs]))


def summarize(results, strategies):
    rows = {}
    for spec in strategies:
        runs = [r for r in results if r["strategy"] == spec]
        if not runs:
            continue
        values = finals(runs)
        acting, measured = acting_kls(runs), measured_kls(runs)
        rows[spec] = {
            "seeds": len(runs),
            "final": float(np.nanmean(values)),
            "by_seed": {r["seed"]: r["final_return"] for r in runs if r["final_return"] is not None},
            "final_std": float(np.nanstd(values)),
            "final_se": float(np.nanstd(values) / np.sqrt(max(1, np.sum(~np.isnan(values))))),
            "auc": float(np.mean([auc(r) for r in runs])),
            "pulls": float(np.mean([r["pulls_per_worker"] for r in runs])),
            "weight_mb": float(np.mean([r["weight_bytes"] for r in runs]) / 1e6),
            "kl_seeds": sum(1 for r in runs if "start_kls" in r),
            "acting_mean": float(acting.mean()) if acting.size else float("nan"),
            "acting_p95": float(np.percentile(acting, 95)) if acting.size else float("nan"),
            "acting_max": float(acting.max()) if acting.size else float("nan"),
            "measured_p95": float(np.percentile(measured, 95)) if measured.size else float("nan"),
            "is_weight": curve_mean(runs, "is_weight") if all("is_weight" in r["curve"][0] for r in runs) else None,
            "clipfrac": curve_mean(runs, "clipfrac"),
            "early_pulls": early_pull_share(runs),
            "bound_ratio": bound_ratio(spec, runs),
        }
    return rows


def bound_ratio(spec, runs):
    """The largest acting KL at a rollout start over the strategy's own bound there (≤ 1: the bound held).

    An absolute bound is its threshold; a relative one is K times the learner's movement the decision used
    (recorded as start_movements). None where there is no bound, or its movement was not recorded.
    """
    kind, value = family(spec)
    if kind == "fixed":
        return None
    ratios = []
    for r in runs:
        movements = r.get("start_movements", [None] * len(r.get("start_kls", [])))
        for kl, pulled, movement in zip(r.get("start_kls", []), r.get("start_pulled", []), movements, strict=True):
            if kl is None or pulled:
                continue
            if kind == "relative":
                if movement is None:
                    return None
                ratios.append(kl / (value * movement) if movement > 0 else (0.0 if kl == 0 else np.inf))
            elif kind == "aps":
                ratios.append(kl / value)
    return max(ratios) if ratios else None


#: The default's relative bound, as aps_sweep.py's aps:default makes it (APS()).
DEFAULT_SPEC = "aps:default"

FAMILY_NAMES = {
    "fixed": "fixed interval",
    "aps": "APS threshold (mean KL)",
    "p95": "APS threshold on the p95 KL",
    "relative": "APS bound relative to the learner's movement",
}


def family(spec):
    """``("fixed", n)``, ``("aps", threshold)``, ``("p95", threshold)`` or ``("relative", K)`` (aps:default: APS().updates)."""
    from clusterenv import APS

    name, _, value = spec.partition(":")
    if name == "every":
        return "fixed", 1
    if name == "fixed":
        return "fixed", int(value)
    if value == "default":
        return "relative", float(APS().updates)
    if value.startswith("x"):
        return "relative", float(value[1:])
    if value.startswith(("p95:", "max:")):
        return value.split(":")[0], float(value.split(":")[1])
    return "aps", float(value)


def regret_table(tasks, strategies):
    """Per strategy and task: (best mean final return on the task - its own) / (best - worst), 0 = the task's best."""
    regret = {}
    for task, rows in tasks.items():
        means = {s: rows[s]["final"] for s in strategies if s in rows}
        best, worst = max(means.values()), min(means.values())
        for s, m in means.items():
            regret.setdefault(s, {})[task] = (best - m) / (best - worst) if best > worst else 0.0
    return regret


def default_verdict(transfer, titles, regret, strategies):
    """The issue's targets for the default, APS(): its regret, whether it is the best single setting, its pulls."""
    if DEFAULT_SPEC not in regret or len(regret[DEFAULT_SPEC]) < len(transfer):
        return []
    values = [regret[DEFAULT_SPEC][t] for t in transfer]
    worst = {
        s: max(regret[s][t] for t in transfer) for s in strategies if s in regret and len(regret[s]) == len(transfer)
    }
    best = min(worst, key=worst.get)
    lines = [
        f"The default, APS(): worst regret **{max(values):.3f}** (target ≤ 0.30: {met(max(values) <= 0.30)}), "
        f"mean **{np.mean(values):.3f}** (target ≤ 0.15: {met(np.mean(values) <= 0.15)}); the best single setting by "
        f"worst regret is {label(best)} ({worst[best]:.3f})"
        + (", the default itself." if best == DEFAULT_SPEC else "."),
        "",
    ]
    pulls = [
        f"{titles[name]} {rows[DEFAULT_SPEC]['pulls']:.1f} against {rows['fixed:4']['pulls']:.1f}"
        for name, rows in transfer.items()
        if "fixed:4" in rows
    ]
    if pulls:
        lines += [f"Its pulls per worker against FixedInterval(4)'s: {'; '.join(pulls)}.", ""]
    return lines


#: Resamples of the seeds behind the regret's confidence section (a fixed generator: the report is reproducible).
BOOTSTRAP_RESAMPLES = 4000


def seed_bootstrap(transfer, titles, strategies):
    """How much of the regret table is seed noise: the table again on each task's seeds drawn with replacement.

    Per resample and task, one draw of the task's seeds (with replacement) serves every strategy, as the strategies
    ran on the same seeds; the regret and the best single setting by worst regret follow as in the table. The
    spread over resamples says how much the table could move; it is not a confidence interval of its values
    (a worst case over tasks of a ratio of differences is biased upward under resampling).
    """
    complete = [s for s in strategies if all(s in rows for rows in transfer.values())]
    if DEFAULT_SPEC not in complete:
        return []
    seeds = {
        name: sorted(set.intersection(*(set(rows[s]["by_seed"]) for s in complete))) for name, rows in transfer.items()
    }
    rng = np.random.default_rng(0)
    wins = dict.fromkeys(complete, 0)
    worst_of_default, mean_of_default, both_met = [], [], 0
    for _ in range(BOOTSTRAP_RESAMPLES):
        resampled = {}
        for name, rows in transfer.items():
            drawn = rng.choice(seeds[name], len(seeds[name]))
            resampled[name] = {
                s: {"final": float(np.mean([rows[s]["by_seed"][seed] for seed in drawn]))} for s in complete
            }
        regret = regret_table(resampled, complete)
        worst = {s: max(regret[s].values()) for s in complete}
        wins[min(worst, key=worst.get)] += 1
        values = list(regret[DEFAULT_SPEC].values())
        worst_of_default.append(max(values))
        mean_of_default.append(float(np.mean(values)))
        both_met += max(values) <= 0.30 and np.mean(values) <= 0.15
    ranked = sorted(complete, key=lambda s: -wins[s])
    share = ", ".join(f"{label(s)} {wins[s] / BOOTSTRAP_RESAMPLES:.0%}" for s in ranked if wins[s])
    low, mid, high = np.percentile(worst_of_default, [5, 50, 95])
    mean_low, mean_mid, mean_high = np.percentile(mean_of_default, [5, 50, 95])
    return [
        "### How much of it is seed noise",
        "",
        f"The regret table again on {BOOTSTRAP_RESAMPLES} resamples of each task's seeds (drawn with replacement, "
        f"one draw per task for all strategies; {', '.join(f'{titles[n]}: {len(seeds[n])}' for n in transfer)} "
        "seeds). The ranges are the spread over resamples, not confidence intervals:",
        "",
        f"- Best single setting by worst regret: {share}.",
        f"- APS()'s worst regret: median {mid:.2f}, 90% of resamples in [{low:.2f}, {high:.2f}]; its mean regret: "
        f"median {mean_mid:.2f}, [{mean_low:.2f}, {mean_high:.2f}].",
        f"- Both targets (worst ≤ 0.30, mean ≤ 0.15) met in {both_met / BOOTSTRAP_RESAMPLES:.0%} of resamples.",
        "",
    ]


def met(target_met):
    return "met" if target_met else "missed"


def fmt(value, digits=1):
    return "n/a" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.{digits}f}"


def write(args, tasks, sweep_args, strategies, missing):
    lines = [
        "# APS against fixed schedules, across tasks",
        "",
        "PPO with local policies in clusterenv workers (`benchmarks/aps_sweep.py`), one sweep per task, the same "
        "strategies on each. Final return: mean episodic training return over the last 10% of steps, mean ± std "
        "over seeds. AUC: the mean of the rolling 20-episode return over all updates. Pulls: weight pulls per worker. "
        "KL at rollout starts: KL(learner ‖ acting copy) on the worker's probe states when each rollout starts, "
        "per worker and rollout, after the pull decision (0 after a pull; `aps_sweep.py` records the KL measured "
        "before the decision and whether the worker then pulled). IS weight: the mean decoupled-PPO importance "
        "weight min(π_learner / π_acting, 1) (1: no correction). Early pulls: the share of a run's pulls made in "
        "the first half of training (0.5 for a fixed schedule).",
        "",
        f"Produced by `{command_line(__file__)}` from {', '.join(f'`{s}.json`' for s in tasks)}.",
        "",
    ]
    for name, rows in tasks.items():
        a = sweep_args[name]
        lines += [
            f"### {task_title(a, name)}",
            "",
            f"{rows[next(iter(rows))]['seeds']} seed{'s' if rows[next(iter(rows))]['seeds'] != 1 else ''} × {a['total_timesteps']:,} steps, {a['num_envs']} envs on "
            f"{a['num_workers']} workers, learning rate {a['learning_rate']}"
            f"{' annealed' if a['anneal_lr'] else ' constant'}; the sweep's own report: `{name}.md`."
            + (f" **Incomplete: {missing[name]} of its runs have not run yet.**" if missing[name] else ""),
            "",
            "| strategy | final return | AUC | pulls/worker | weight MB | KL at rollout starts: mean / p95 / max "
            "| acting KL / bound, max | KL before the decision, p95 | IS weight | clip fraction | early pulls |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for spec, r in rows.items():
            kl_note = "" if r["kl_seeds"] == r["seeds"] else f" ({r['kl_seeds']} seeds)"
            lines.append(
                f"| {label(spec)} | {fmt(r['final'])} ± {fmt(r['final_std'])} | {fmt(r['auc'])} | {fmt(r['pulls'])} "
                f"| {fmt(r['weight_mb'], 2)} | {fmt(r['acting_mean'], 4)} / {fmt(r['acting_p95'], 4)} / "
                f"{fmt(r['acting_max'], 3)}{kl_note} | {fmt(r['bound_ratio'], 2)} | {fmt(r['measured_p95'], 4)} "
                f"| {fmt(r['is_weight'], 3)} "
                f"| {fmt(r['clipfrac'], 3)} | {fmt(r['early_pulls'], 2)} |"
            )
        lines.append("")

    transfer = {name: tasks[name] for name in args.transfer if name in tasks and not missing[name]}
    regret = regret_table(transfer, strategies)
    titles = {name: task_title(sweep_args[name], name) for name in transfer}
    lines += [
        "### One setting for every task: regret",
        "",
        "Regret of a strategy on a task: (best mean final return on that task − its own) / (best − worst), over "
        "the strategies above; 0 is the task's best strategy, 1 its worst. The best single setting of each family "
        "is the one with the lowest worst-case regret over the tasks.",
        "",
        "| strategy | " + " | ".join(titles.values()) + " | mean | worst |",
        "|---|" + "---|" * (len(titles) + 2),
    ]
    best = {}
    for spec in strategies:
        if spec not in regret or len(regret[spec]) < len(transfer):
            continue
        values = [regret[spec][t] for t in transfer]
        lines.append(
            f"| {label(spec)} | "
            + " | ".join(f"{v:.2f}" for v in values)
            + f" | {np.mean(values):.2f} | {max(values):.2f} |"
        )
        fam = family(spec)[0]
        if fam not in best or max(values) < best[fam][1]:
            best[fam] = (spec, max(values))
    lines += [""]
    for fam, (spec, worst) in sorted(best.items()):
        lines.append(f"- Best single {FAMILY_NAMES[fam]}: {label(spec)}, worst-case regret {worst:.2f}.")
    lines.append("")
    lines += default_verdict(transfer, titles, regret, strategies)
    lines += seed_bootstrap(transfer, titles, strategies)
    aps_families = [fam for fam in best if fam != "fixed"]
    if aps_families and "fixed" in best:
        a_spec = min((best[fam] for fam in aps_families), key=lambda b: b[1])[0]
        f_spec = best["fixed"][0]
        lines += [
            f"Per task, {label(a_spec)} against {label(f_spec)} and against the task's own best fixed interval:",
            "",
            "| task | "
            + f"{label(a_spec)}: return, pulls | {label(f_spec)}: return, pulls | best fixed n*: return, pulls |",
            "|---|---|---|---|",
        ]
        for name in transfer:
            rows = tasks[name]
            fixed = [s for s in rows if family(s)[0] == "fixed"]
            star = max(fixed, key=lambda s: rows[s]["final"])
            cells = [
                f"{fmt(rows[s]['final'])} ± {fmt(rows[s]['final_se'])} (se), {fmt(rows[s]['pulls'])}"
                for s in (a_spec, f_spec, star)
            ]
            lines.append(f"| {titles[name]} | {cells[0]} | {cells[1]} | {label(star)}: {cells[2]} |")
        lines.append("")
    path = os.path.join(args.results_dir, f"{args.name}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def plot(args, tasks, sweep_args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], tasks.items(), strict=True):
        for fam, marker, color in (
            ("fixed", "s", "tab:blue"),
            ("aps", "o", "tab:red"),
            ("p95", "^", "tab:orange"),
            ("relative", "D", "tab:green"),
        ):
            specs = [s for s in rows if family(s)[0] == fam]
            if not specs:
                continue
            xs = [rows[s]["pulls"] for s in specs]
            ys = [rows[s]["final"] for s in specs]
            es = [rows[s]["final_se"] for s in specs]
            ax.errorbar(
                xs,
                ys,
                yerr=es,
                fmt=marker,
                color=color,
                capsize=3,
                label="FixedInterval / EveryUpdate" if fam == "fixed" else FAMILY_NAMES[fam],
            )
            for s, x, y in zip(specs, xs, ys, strict=True):
                ax.annotate(
                    label(s).replace("FixedInterval", "n=").replace("(", "").replace(")", ""),
                    (x, y),
                    fontsize=7,
                    xytext=(4, 3),
                    textcoords="offset points",
                )
        ax.set_xscale("log")
        ax.set_title(task_title(sweep_args[name], name), fontsize=10)
        ax.set_xlabel("weight pulls per worker (log)")
        ax.set_ylabel("final return (mean ± s.e. over seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(args.results_dir, f"{args.name}_pareto.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    args = tyro.cli(Args)
    tasks, sweep_args, strategies, missing = {}, {}, [], {}
    for name in args.sweeps:
        if not os.path.exists(os.path.join(args.results_dir, f"{name}.json")):
            print(f"skipping {name}: no {name}.json")
            continue
        a, results = load(args.results_dir, name)
        sweep_args[name] = a
        for s in a["strategies"]:
            if s not in strategies:
                strategies.append(s)
        tasks[name] = summarize(results, a["strategies"])
        done = {(r["strategy"], r["seed"]) for r in results}
        missing[name] = sum((s, seed) not in done for s in a["strategies"] for seed in a["seeds"])
    print("wrote", write(args, tasks, sweep_args, strategies, missing), plot(args, tasks, sweep_args))


if __name__ == "__main__":
    main()
