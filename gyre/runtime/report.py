"""`gyre report RUN_DIR [--out DIR]`: PNG plots and one HTML page from a run's trace, in
`DIR` (default `RUN_DIR/report`), which may not be, hold or lie inside what the report reads
(the run's trace, config, policies, checkpoints; `gyre.fsafe`). The trace is read whole
before anything is written; a directory that cannot be written (read-only, full disk) is one
line naming it.

* `timeline.png` — the role timeline per cell (as the paper's Figure 6): rollout, training
  and the transitions between them, with optimizer steps marked;
* `train_share.png` — each cell's share of wall time spent training;
* `steps.png` — learning per step: the training reward with held-out eval points and
  their spread (`gyre eval RUN_DIR --policies all` writes them), the learning signal
  (grad norm; groups whose rewards tie; clipped executions) and staleness;
* `durations.png` — the distribution of execution durations (launch to close);
* `stats_*.png` — `gyre trace stats`' plots: staleness, tokens by role and provenance,
  tree shapes, outcomes (docs/trace-format.md);
* `index.html` — the held-out evaluations (policy, version, scored, mean, std), the run
  summary and the plots, styled for reading.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from gyre import fsafe
from gyre.errors import StoreError

COLORS = {"rollout": "#4c9be8", "to_train": "#f2b134", "train": "#e8574c",
          "to_rollout": "#9b59b6"}  # fmt: skip
EVAL_COLOR = "#2ca02c"  # in-run held-out evaluations (the timeline's eval row and bands)


def load_run(run_dir: Path) -> dict[str, Any]:
    """Tables of the trace as plain lists (readable while the run still writes)."""
    from gyre.trajectory.store import TraceReader

    path = run_dir / "trace.h5"
    if not path.exists():
        raise StoreError(f"{path} does not exist; give a run directory written by `gyre run`")
    from gyre.runtime.evaluation import load_results

    with TraceReader(path) as r:
        execs = [(i.execution_id, i.status, i.t_open, i.t_close) for i in r.executions()]
        events = r.rows("events")
        return {
            "meta": dict(r.run_meta),
            "roles": r.rows("roles"),
            "steps": r.rows("steps"),
            "events": events,
            "executions": execs,
            "evals": load_results(run_dir),
            "in_run": [json.loads(e["detail"]) for e in events if e["kind"] == "eval"],
        }


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Read the run, then write the plots and `index.html` into `out` (default
    RUN_DIR/report); the page's path."""
    import matplotlib

    from gyre.runtime.evaluation import run_inputs
    from gyre.trajectory.stats import plot_stats, run_stats

    matplotlib.use("Agg")
    out = run_dir / "report" if out is None else out
    fsafe.check_outputs_apart({"--out": out}, run_inputs(run_dir))
    data = load_run(run_dir)
    stats = run_stats(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.pop("steps", None)
    with fsafe.writing(out):
        out.mkdir(parents=True, exist_ok=True)
        t0 = min([r["t_start"] for r in data["roles"]] or [0.0])
        _timeline(data, t0, out / "timeline.png")
        shares = _train_share(data, out / "train_share.png")
        _steps(data, out / "steps.png")
        _metrics(data, out / "metrics.png")
        _durations(data, out / "durations.png")
        extra = [p.name for p in plot_stats(stats, out)]
        summary["train_share"] = {f"cell {c}": round(s, 3) for c, s in shares.items()}
        page = out / "index.html"
        page.write_text(_html(run_dir, summary, data, extra))
    return page


def _timeline(data: dict[str, Any], t0: float, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2 + 0.5 * _cells(data)))
    for r in data["roles"]:
        ax.barh(r["cell"], r["t_end"] - r["t_start"], left=r["t_start"] - t0,
                color=COLORS.get(r["role"], "grey"), edgecolor="none")  # fmt: skip
    for t in sorted({s["t"] for s in data["steps"]}):
        ax.axvline(t - t0, color="black", lw=0.8, ls="--")
    cells = _cells(data)
    for e in data["in_run"]:  # held-out evaluations, on the rollout engines that served them
        ax.barh(cells, e["t_end"] - e["t_start"], left=e["t_start"] - t0, color=EVAL_COLOR)
        for engine in e["engines"]:
            ax.barh(int(engine.lstrip("e")), e["t_end"] - e["t_start"], left=e["t_start"] - t0,
                    height=0.25, color=EVAL_COLOR)  # fmt: skip
    ax.set_xlabel("seconds since start (dashed: optimizer steps)")
    ax.set_ylabel("cell")
    ax.set_yticks(range(cells + (1 if data["in_run"] else 0)))
    if data["in_run"]:
        ax.set_yticklabels([*map(str, range(cells)), "eval"])
    names = [*COLORS, *(["held-out eval"] if data["in_run"] else [])]
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in [*COLORS.values(), EVAL_COLOR]]
    ax.legend(handles[: len(names)], names, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_title("Role timeline per cell")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cells(data: dict[str, Any]) -> int:
    return 1 + max([r["cell"] for r in data["roles"]] or [0])


def _train_share(data: dict[str, Any], path: Path) -> dict[int, float]:
    import matplotlib.pyplot as plt

    total: dict[int, float] = {}
    train: dict[int, float] = {}
    for r in data["roles"]:
        d = r["t_end"] - r["t_start"]
        total[r["cell"]] = total.get(r["cell"], 0.0) + d
        if r["role"] == "train":
            train[r["cell"]] = train.get(r["cell"], 0.0) + d
    shares = {c: train.get(c, 0.0) / total[c] if total[c] > 0 else 0.0 for c in sorted(total)}
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([str(c) for c in shares], list(shares.values()), color=COLORS["train"])
    ax.set_ylim(0, 1)
    ax.set_xlabel("cell")
    ax.set_ylabel("training time share")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return shares


def _steps(data: dict[str, Any], path: Path) -> None:
    """Learning per step: training reward with held-out eval points (mean ± std band over
    the eval instances), the learning signal (grad norm, tied groups) and staleness."""
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, float]] = {}
    for r in data["steps"]:
        series.setdefault(r["name"], {})[r["step"]] = r["value"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    _plot(axes[0], series, "reward_mean", "training reward")
    evals = sorted((e for e in data["evals"] if e.get("version") is not None),
                   key=lambda e: e["version"])  # fmt: skip
    if evals:
        x = [e["version"] for e in evals]
        mean = [e["mean"] for e in evals]
        lo = [e["mean"] - e["std"] for e in evals]
        hi = [e["mean"] + e["std"] for e in evals]
        axes[0].fill_between(x, lo, hi, color="#e8574c", alpha=0.2, label="held-out ± std")
        axes[0].plot(x, mean, "s-", color="#e8574c", label="held-out eval")
    _heldout_curve(axes[0], series)
    axes[0].set_ylim(-0.05, 1.05)
    axes[0].legend(loc="lower right", fontsize=8)
    _plot(axes[1], series, "grad_norm", "grad norm (0: no signal)")
    _plot(axes[2], series, "tied_groups", "groups whose rewards tie")
    _plot(axes[2], series, "gated_executions", "clipped executions")
    axes[2].set_ylim(-0.05, 1.05)
    axes[2].legend(loc="upper right", fontsize=8)
    _plot(axes[3], series, "staleness_mean", "mean staleness")
    last = max([0, *(s for v in series.values() for s in v), *(e["version"] for e in evals)])
    for ax in axes:
        _step_axis(ax, last)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _heldout_curve(ax: Any, series: dict[str, dict[int, float]]) -> None:
    """The in-run held-out curve (`eval.every_steps`): mean reward per evaluation, ± std."""
    points = sorted(series.get("eval/reward_mean", {}).items())
    if not points:
        return
    std = series.get("eval/reward_std", {})
    x, mean = [p[0] for p in points], [p[1] for p in points]
    ax.fill_between(x, [m - std.get(s, 0.0) for s, m in points],
                    [m + std.get(s, 0.0) for s, m in points], color=EVAL_COLOR, alpha=0.15)  # fmt: skip
    ax.plot(x, mean, "D-", color=EVAL_COLOR, label="held-out (in run)", clip_on=False, zorder=5)
    ax.annotate(f"{mean[-1]:.2f}", (x[-1], mean[-1]), textcoords="offset points",
                xytext=(-4, 6), ha="right", fontsize=8, color=EVAL_COLOR)  # fmt: skip


def _step_axis(ax: Any, last: int) -> None:
    """Integer step ticks, from 0 to a margin past the last step (its points visible)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-0.5, last + max(0.5, 0.03 * last))
    ax.set_xlabel("step (policy version)")


METRIC_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("objective", (("loss", "loss"), ("objective", "objective"))),
    ("gradient norm", (("grad_norm", "grad norm"),)),
    ("clip fraction", (("gated_executions", "clipped executions"),)),
    ("importance weights", (("ratio_mean", "ratio mean"), ("ratio_max", "ratio max"))),
    ("tokens / s", (("rollout_tokens_per_s", "rollout"), ("train_tokens_per_s", "training"))),
    ("step time (s)", (("step_s", "step"), ("train_wall_s", "training"))),
    ("response tokens / execution", (("response_tokens_mean", "mean"),)),
    ("turns / execution", (("turns_mean", "mean"),)),
    ("staleness", (("staleness_mean", "mean"), ("staleness_max", "max"))),
    ("learning rate", (("lr", "lr"),)),
)
"""`metrics.png`: (panel title, ((step metric, legend label), ...)); then reward per task."""


def _metrics(data: dict[str, Any], path: Path) -> None:
    """The numbers a researcher watches per step (docs/runtime.md "Step metrics"): one
    panel each, integer step ticks; the last panel is the reward of each task."""
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, float]] = {}
    for r in data["steps"]:
        series.setdefault(r["name"], {})[r["step"]] = r["value"]
    last = max([0, *(s for v in series.values() for s in v)])
    fig, axes = plt.subplots(3, 4, figsize=(16, 9))
    flat = list(axes.flat)
    for ax, (title, lines) in zip(flat, METRIC_PANELS, strict=False):
        for name, label in lines:
            _plot(ax, series, name, label)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("")
        if len(lines) > 1:
            ax.legend(fontsize=8)
    ax = flat[len(METRIC_PANELS)]
    for name in sorted(n for n in series if n.startswith("reward/")):
        _plot(ax, series, name, name.split("/", 1)[1])
    ax.set_title("reward per task", fontsize=10)
    ax.set_ylabel("")
    if any(n.startswith("reward/") for n in series):
        ax.legend(fontsize=8)
    for ax in flat[len(METRIC_PANELS) + 1 :]:
        ax.axis("off")
    for ax in flat[: len(METRIC_PANELS) + 1]:
        _step_axis(ax, last)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot(ax: Any, series: dict[str, dict[int, float]], name: str, label: str) -> None:
    points = sorted(series.get(name, {}).items())
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=label)
    ax.set_ylabel(label)


def _durations(data: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    d = [c - o for _, s, o, c in data["executions"] if c is not None and s != "not_launched"]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(d, bins=max(5, min(30, len(d))), color=COLORS["rollout"])
    ax.set_xlabel("execution duration, launch to close (s)")
    ax.set_ylabel("executions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; color: #222; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #e4e4e4; vertical-align: top; }
th { text-align: left; font-weight: 600; color: #444; }
td { font-variant-numeric: tabular-nums; }
table.inner th, table.inner td { border: none; padding: 0 0.8em 0 0; font-weight: normal; }
thead th { border-bottom: 2px solid #bbb; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #666; font-size: 0.9em; }
pre { white-space: pre-wrap; background: #f7f7f7; padding: 0.4em; margin: 0.2em 0; }
details { margin: 0.4em 0; } summary { cursor: pointer; }
"""


def _cell(value: Any) -> str:
    """One summary value as HTML: numbers rounded for reading, a mapping as a small table, a
    list of scalars as a comma list (nested lists as one line each); never a Python repr."""
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "—"}[value]
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_cell(v)}</td></tr>"
                       for k, v in value.items())  # fmt: skip
        return f"<table class='inner'>{rows}</table>" if rows else "—"
    if isinstance(value, list):
        if any(isinstance(v, (list, dict)) for v in value):
            return "<br>".join(f"{i}: {_cell(v)}" for i, v in enumerate(value)) or "—"
        return ", ".join(_cell(v) for v in value) or "—"
    return html.escape(str(value))


def _evals_table(evals: list[dict[str, Any]]) -> str:
    """The held-out evaluations (`gyre eval`), one row per evaluated policy."""
    if not evals:
        return ("<p class='note'>No held-out evaluation yet: <code>gyre eval RUN_DIR --initial"
                "</code> (or <code>--policies all</code>) records one.</p>")  # fmt: skip
    heads = ("policy", "version", "scored", "excluded", "mean reward", "std")
    keys = ("name", "version", "n", "excluded", "mean", "std")
    ordered = sorted(evals, key=lambda e: (e.get("version") is None, e.get("version") or 0))
    rows = "".join(
        "<tr>" + "".join(f"<td>{_cell(e.get(k))}</td>" for k in keys) + "</tr>" for e in ordered
    )
    head = "".join(f"<th>{h}</th>" for h in heads)
    return f"<table class='evals'><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _header(meta: dict[str, Any]) -> str:
    """What ran: the model, the learning rate and its schedule, the code's git commit, the
    Gyre version, and the whole config (folded) — from the trace's run metadata."""
    import yaml

    text = str(meta.get("config", ""))
    cfg = yaml.safe_load(text) if text else {}
    from gyre.train.config import OptimConfig

    train = (cfg or {}).get("train", {}) or {}
    optim = OptimConfig()  # what a key the config leaves out is
    lr: str | None = None  # a trace without its config: not known
    if text:
        schedule = train.get("lr_schedule", optim.lr_schedule)
        lr = f"{train.get('lr', optim.lr)} ({schedule}"
        if schedule != "constant":
            lr += f", warmup_steps {train.get('warmup_steps', optim.warmup_steps)}"
            if schedule == "cosine":
                lr += (f", min_lr {train.get('min_lr', optim.min_lr)}, decay_steps "
                       f"{train.get('decay_steps', optim.decay_steps)}")  # fmt: skip
        lr += ")"
    rows = (("model", meta.get("model", (cfg or {}).get("model"))), ("lr", lr),
            ("commit", meta.get("git_commit") or "not from a git checkout"),
            ("gyre", meta.get("gyre_version")), ("steps", (cfg or {}).get("steps")),
            ("policy", ((cfg or {}).get("schedule") or {}).get("policy")))  # fmt: skip
    body = "".join(f"<tr><th>{k}</th><td class='{k}'>{_cell(v)}</td></tr>" for k, v in rows)
    return (f"<table class='header'>{body}</table><details class='config'><summary>config"
            f"</summary><pre>{html.escape(text)}</pre></details>")  # fmt: skip


def _in_run_table(points: list[dict[str, Any]]) -> str:
    """The in-run held-out evaluations (`eval.every_steps`), one row per step."""
    heads = ("step", "mean reward", "std", "scored", "excluded", "policy versions", "engines",
             "seconds")  # fmt: skip
    keys = ("step", "reward_mean", "reward_std", "scored", "excluded", "versions", "engines",
            "seconds")  # fmt: skip
    rows = "".join(
        "<tr>" + "".join(f"<td>{_cell(p.get(k))}</td>" for k in keys) + "</tr>" for p in points
    )
    head = "".join(f"<th>{h}</th>" for h in heads)
    return f"<table class='in-run'><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _samples(points: list[dict[str, Any]]) -> str:
    """`eval.log_samples` transcripts of each in-run evaluation, folded per execution."""
    out = []
    for p in points:
        for eid, said in (p.get("samples") or {}).items():
            reward = (p.get("rewards") or {}).get(eid)
            msgs = "".join(
                f"<div class='msg {html.escape(str(m.get('role')))}'><b>"
                f"{html.escape(str(m.get('role')))}</b><pre>{html.escape(str(m.get('content')))}"
                "</pre></div>"
                for m in said.get("messages", [])
            )
            out.append(f"<details class='sample'><summary>step {p['step']} · "
                       f"{html.escape(eid)} · reward {_cell(reward)} · {said.get('calls', 0)} "
                       f"calls</summary>{msgs}<p><b>final answer</b></p><pre>"
                       f"{html.escape(str(said.get('final_answer', '')))}</pre></details>")  # fmt: skip
    return "".join(out)


def _html(run_dir: Path, summary: dict[str, Any], data: dict[str, Any],
          extra: list[str]) -> str:  # fmt: skip
    evals, points = data["evals"], data["in_run"]
    summary = {k: v for k, v in summary.items() if k != "evals"}  # its own table below
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{_cell(v)}</td></tr>" for k, v in summary.items()
    )
    imgs = "".join(
        f'<h2>{title}</h2><img src="{name}" alt="{title}">'
        for name, title in (
            ("timeline.png", "Role timeline"),
            ("train_share.png", "Training time share per cell"),
            ("steps.png", "Learning: reward (training, held-out), signal and staleness per step"),
            ("metrics.png", "Step metrics: objective, gradient, clipping, importance weights, "
             "throughput, step time, lengths, turns, staleness, lr, reward per task"),
            ("durations.png", "Execution durations"),
            *((name, "Run statistics: " + name[6:-4]) for name in extra),
        )
    )  # fmt: skip
    name = html.escape(run_dir.name)
    paced = ""
    if isinstance(summary.get("pace"), dict):
        from gyre.runtime.coordinator.progress import paced_line

        paced = f"<p class='paced'><b>{html.escape(paced_line(summary['pace']))}</b></p>"
    cells = ""
    if "train_backend" in summary:  # runs from before the backends were recorded lack it
        par = summary.get("parallel") or {}
        experts = f", experts over {par['expert']}" if (par.get("expert") or 1) > 1 else ""
        cells = (f"<p class='cells'>{summary.get('ranks_per_cell')} ranks per cell; training "
                 f"backend <b>{html.escape(str(summary['train_backend']))}</b> (tensor "
                 f"{par.get('tensor')} x pipeline {par.get('pipeline')} x data "
                 f"{par.get('data')}{experts}); engine backend "
                 f"<b>{html.escape(str(summary.get('engine_backend')))}</b></p>")  # fmt: skip
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Gyre run {name}</title>"
        f"<style>{STYLE}</style></head><body><h1>Gyre run {name}</h1>"
        f"{_header(data['meta'])}{cells}{paced}"
        + (f"<h2>Held-out during training</h2>{_in_run_table(points)}" if points else "")
        + f"<h2>Held-out evaluations</h2>{_evals_table(evals)}"
        f"<h2>Summary</h2><table class='summary'>{rows}</table>{imgs}"
        + (f"<h2>Held-out samples</h2>{_samples(points)}" if _samples(points) else "")
        + "</body></html>"
    )
