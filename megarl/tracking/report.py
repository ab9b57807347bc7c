"""Offline report of a run directory: one PNG per metric family plus `report.md`.

Reads the MLflow run recorded in `<run_dir>/tracking.json` (and its nested child runs, e.g. the
sft / reward_model / rl stages under a pipeline run) from the store it was logged to. Uses
matplotlib's object API with the Agg canvas, so no global pyplot/backend state is touched.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

from .delivery import PARENT_TAG
from .state import RunState
from .tracker import default_tracking_uri

# Ordered: the first matching rule names the family of a metric key.
_FAMILY_RULES = [
    ("system", re.compile(r"^system/")),
    ("eval", re.compile(r"^(eval|val|validation|test)[/_]")),
    ("loss", re.compile(r"loss|perplexity|ppl", re.I)),
    ("lr", re.compile(r"(^|[/_.])(lr|learning_rate)($|[/_.])", re.I)),
    ("grad_norm", re.compile(r"grad[_-]?norm", re.I)),
    ("reward", re.compile(r"reward|score|return", re.I)),
    ("kl", re.compile(r"(^|[/_.])kl($|[/_.])|entropy", re.I)),
    ("throughput", re.compile(r"tok(ens)?[_/]?(per[_/])?s(ec)?|throughput|samples_per|time|mfu", re.I)),
]
# Which way a metric improves, first match wins; a metric none names has no "best" (a reward
# model's reward_rejected, a KL, an entropy, a length, a memory figure: a trade-off or a fact).
_DIRECTIONS = [
    ("neither", re.compile(r"reward_(chosen|rejected)|reward/std|sq_mean|(^|/)kl|entropy|_len|memory|/ratio|"
                           r"clip_fraction|(^|/)minibatches$|lr$", re.I)),
    ("lower", re.compile(r"loss|perplexity|ppl|error|err\b|skipped|failed|overlong|padding_waste|(_s|time)$", re.I)),
    ("higher", re.compile(r"accuracy|pass_at|mean_at|exact_match|reward|return|explained_variance|per_s$|success",
                          re.I)),
]
_PARAM_HIGHLIGHTS = re.compile(
    r"(^|\.)(lr|learning_rate|min_lr|warmup\w*|weight_decay|seed|steps|max_steps|epochs|"
    r"\w*batch_size|seq_len\w*|max_seq\w*|tensor_model_parallel_size|pipeline_model_parallel_size|"
    r"tp|pp|dp|cp|ep|\w*parallel\w*|precision|dtype|bf16|fp16|num_layers|hidden_size|"
    r"num_attention_heads|algorithm|kl_coef|clip\w*|name|path|prompts_per_step|samples_per_prompt|ppo_epochs|"
    r"mini_batches)$", re.I)
# Config sections that only one kind of stage reads (its tag `megarl.stage`); a stage's table
# leaves out the others' sections, which hold nothing but defaults it never used, and RL's the
# SFT/RM data batch (RL's batch is rl.prompts_per_step x rl.samples_per_prompt).
_STAGE_SECTIONS = {"sft": ("sft",), "reward_model": ("reward_model",), "rl": ("rl", "roles"), "eval": ("rl",)}
_UNUSED = {"rl": ("data.global_batch_size", "data.micro_batch_size"), "eval": ("data.global_batch_size",
                                                                          "data.micro_batch_size")}
MIN_SPAN = 0.1  # a panel's y-range is at least this share of its largest |value|: flat stays flat


def metric_family(key: str) -> str:
    for family, rule in _FAMILY_RULES:
        if rule.search(key):
            if family == "system":
                return "system_memory" if key.endswith("_gib") else "system_utilization"
            return family
    return key.split("/", 1)[0] if "/" in key else "other"


def direction(key: str) -> str | None:
    """"higher" or "lower" when that way is better for metric `key`, else None (no "best")."""
    for way, rule in _DIRECTIONS:
        if rule.search(key):
            return None if way == "neither" else way
    return None


# What a panel's y axis measures, first match wins: values of different kinds never share an
# axis (a pair accuracy in [0, 1] is not drawn on a reward's scale).
_UNITS = [
    ("GiB", re.compile(r"_gib$")),
    ("tokens/s", re.compile(r"tokens_per_s")),
    ("seconds", re.compile(r"(_s|time)$")),
    ("share (0-1)", re.compile(r"accuracy|pass_at|fraction|exact_match|success|waste|stopped", re.I)),
    ("tokens", re.compile(r"_len(_|$)|tokens", re.I)),
]


def metric_unit(key: str) -> str | None:
    """The y-axis label `key` needs (GiB, seconds, a 0-1 share, ...), or None for a plain value."""
    for unit, rule in _UNITS:
        if rule.search(key):
            return unit
    return None


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    return f"{v:.4g}"


def scale_panels(series: dict[str, tuple[list, list]], ratio: float = 10.0) -> list[list[str]]:
    """Keys of `series` grouped into panels of like magnitude, smallest first: a key whose peak
    |value| is over `ratio` times its panel's smallest peak opens a new panel, so that pass@1
    (<= 1) is not flattened by a response length of 17 on the same axis."""
    def peak(key):
        finite = [abs(v) for v in series[key][1] if v is not None and math.isfinite(v)]
        return max(finite, default=0.0)

    panels, floor = [[]], 0.0  # floor: the smallest nonzero peak of the last panel
    for key in sorted(series, key=lambda k: (peak(k), k)):
        p = peak(key)
        if floor and p > ratio * floor:
            panels.append([])
            floor = 0.0
        floor = floor or p
        panels[-1].append(key)
    return [sorted(keys) for keys in panels]


def stage_params(params: dict[str, str], stage: str | None) -> dict[str, str]:
    """`params` without the sections that belong to other stages, the fields this stage does not
    read, and role fields left unset (None: the top-level value applies). All for an unknown stage."""
    own = _STAGE_SECTIONS.get(stage or "")
    if own is None:
        return dict(params)
    foreign = {sec for secs in _STAGE_SECTIONS.values() for sec in secs} - set(own)
    return {k: v for k, v in params.items() if k.split(".", 1)[0] not in foreign
            and k not in _UNUSED.get(stage, ()) and not (k.startswith("roles.") and v == "None")}


def same_series(a: tuple[list, list], b: tuple[list, list]) -> bool:
    """Same steps and values within float noise (a mean logged twice under two names)."""
    (sa, va), (sb, vb) = a, b
    return list(sa) == list(sb) and all(
        x == y or math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12) or (math.isnan(x) and math.isnan(y))
        for x, y in zip(va, vb))


def group_identical(series: dict[str, tuple[list, list]]) -> dict[str, tuple[list, list]]:
    """{legend label: series}: each distinct series once; several keys with the same values are
    one line whose label names them all, one per line, and says that they coincide (a constant
    is named: zero clip fraction and zero skipped mini-batches are two facts, not one metric)."""
    groups: list[list[str]] = []
    for key in sorted(series):
        for keys in groups:
            if same_series(series[keys[0]], series[key]):
                keys.append(key)
                break
        else:
            groups.append([key])
    out = {}
    for keys in groups:
        values = [v for v in series[keys[0]][1] if not math.isnan(v)]
        if len(keys) == 1:
            out[keys[0]] = series[keys[0]]
            continue
        same = f"all {_fmt(values[0])} throughout" if values and min(values) == max(values) else "identical values"
        out["\n".join(keys) + f"\n({len(keys)} metrics, {same})"] = series[keys[0]]
    return out


def plot_panels(series: dict[str, tuple[list, list]]) -> list[tuple[str | None, list[str]]]:
    """(y unit, keys) of each panel: keys (or group_identical labels) of one unit only
    (metric_unit), then of like magnitude (scale_panels); plain values first, then each unit."""
    by_unit: dict[str | None, dict] = {}
    for key, s in series.items():  # a group_identical label: its metrics' unit if they share one
        units = {metric_unit(k) for k in key.split("\n")[:-1] or [key]}
        by_unit.setdefault(units.pop() if len(units) == 1 else None, {})[key] = s
    order = [None] + [u for u, _ in _UNITS]
    return [(unit, keys) for unit in order if unit in by_unit for keys in scale_panels(by_unit[unit])]


def y_limits(values: list[float], min_span: float = MIN_SPAN) -> tuple[float, float] | None:
    """(low, high) for a panel whose values vary by less than `min_span` x their largest |value|
    (centred on them), else None (matplotlib's own limits): noise of 1e-4 on a loss of 0.69 is
    not drawn as a V that fills the axis."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    span = min_span * max(abs(lo), abs(hi))
    if hi - lo >= span or span == 0:
        return None
    mid = (lo + hi) / 2
    return mid - span / 2, mid + span / 2


def family_figure(title: str, series: dict[str, tuple[list, list]]):
    """One family's figure: a panel per unit and magnitude, each with its y label, the legend
    to the right of its panel (never over the lines, nor cut off: saved with a tight box)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = group_identical(series)
    panels = [(unit, {k: series[k] for k in keys}) for unit, keys in plot_panels(series)]
    fig = Figure(figsize=(7, 1.0 + 3.0 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    for i, (unit, group) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        for label, (steps, values) in group.items():
            ax.plot(steps, values, label=label, marker="o" if len(steps) < 20 else None, markersize=3)
        limits = y_limits([v for _, values in group.values() for v in values])
        if limits is not None:
            ax.set_ylim(*limits)
        if i == 0:
            ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(unit or _short_name(list(group)))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def _short_name(labels: list[str]) -> str:
    """A plain-value panel's y label: its metric's name without the section (`loss`), or `value`
    when the panel holds several."""
    names = {label.split("\n")[0].rsplit("/", 1)[-1] for label in labels if "\n" not in label}
    return names.pop() if len(names) == 1 and len(labels) == 1 else "value"


def _run_section(client, run, out_dir: Path, prefix: str) -> list[str]:
    """Plots for one run and its markdown section."""
    info, data = run.info, run.data
    lines = [f"## {info.run_name} (`{info.run_id}`)", "",
             f"- status: {info.status}", f"- experiment id: {info.experiment_id}"]
    if data.tags.get(PARENT_TAG):
        lines.append(f"- parent run: `{data.tags[PARENT_TAG]}`")
    if data.tags.get("checkpoint.latest"):
        lines.append(f"- latest checkpoint: `{data.tags['checkpoint.latest']}` "
                     f"(step {data.tags.get('checkpoint.latest_step', '?')})")
    params = stage_params(data.params, data.tags.get("megarl.stage"))
    highlights = {k: v for k, v in sorted(params.items()) if _PARAM_HIGHLIGHTS.search(k)}
    shown = highlights or dict(list(sorted(params.items()))[:30])  # nothing recognisable: the first ones
    if params:
        lines += ["", f"### Params ({len(data.params)} logged; {len(shown)} of this stage's shown)", "",
                  "| param | value |", "|---|---|"]
        for k, v in shown.items():
            lines.append(f"| `{k}` | `{v[:80]}` |")

    families: dict[str, dict[str, tuple[list, list]]] = defaultdict(dict)
    summary = []
    for key in sorted(data.metrics):
        hist = sorted(client.get_metric_history(info.run_id, key), key=lambda m: (m.step, m.timestamp))
        if not hist:
            continue
        steps, values = [m.step for m in hist], [m.value for m in hist]
        family = metric_family(key)
        families[family][key] = (steps, values)
        if family.startswith("system"):
            continue
        way = direction(key) if family not in ("lr", "throughput") else None  # schedules, speeds: no best
        finite = [(v, s) for v, s in zip(values, steps) if not math.isnan(v)]
        best = "-"
        if way and finite:
            sign = 1 if way == "higher" else -1  # the best value, first reached at its earliest step
            best_v, best_s = max(finite, key=lambda vs: (sign * vs[0], -vs[1]))
            best = f"{_fmt(best_v)} (step {best_s})"
        summary.append(f"| `{key}` | {_fmt(values[-1])} (step {steps[-1]}) | {way or '-'} | {best} | {len(values)} |")
    if summary:
        lines += ["", "### Metrics", "", "better: which way a metric improves; no best where neither way is better",
                  "", "| metric | final | better | best | points |", "|---|---|---|---|---|", *summary]
    if families:
        lines += ["", "### Plots", ""]
    for family in sorted(families):
        png = out_dir / f"{prefix}{family}.png"
        family_figure(f"{info.run_name}: {family}", families[family]).savefig(png, bbox_inches="tight")
        lines.append(f"![{family}]({png.name})")
    return lines + [""]


# The overview at the top of report.md: what a user of an RL run looks at first.
OVERVIEW = (("held-out pass@k", re.compile(r"^eval/pass_at_\d+$")), ("reward", re.compile(r"^reward/mean$")),
            ("KL to the reference", re.compile(r"^kl/mean$")),
            ("response length (tokens)", re.compile(r"^rollout/response_len_mean$")),
            ("entropy", re.compile(r"^actor/entropy$")))


def overview_panels(keys) -> list[tuple[str, list[str]]]:
    """(title, metric keys) of each overview panel the run has metrics for, in OVERVIEW's order;
    pass@1 first among the pass@k."""
    def order(k):
        tail = k.rsplit("_", 1)[-1]
        return (int(tail) if tail.isdigit() else 0, k)

    return [(title, sorted((k for k in keys if rule.search(k)), key=order)) for title, rule in OVERVIEW
            if any(rule.search(k) for k in keys)]


def _overview(client, runs, out: Path) -> list[str]:
    """overview.png of the first run with RL's figures (the rl stage of a pipeline) and its line."""
    rl = next((r for r in runs if overview_panels(r.data.metrics) and "reward/mean" in r.data.metrics), None)
    if rl is None:
        return []
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = overview_panels(rl.data.metrics)
    fig = Figure(figsize=(11, 3.2 * ((len(panels) + 1) // 2)), dpi=100)
    FigureCanvasAgg(fig)
    for i, (title, keys) in enumerate(panels):
        ax = fig.add_subplot((len(panels) + 1) // 2, 2, i + 1)
        for key in keys:
            hist = sorted(client.get_metric_history(rl.info.run_id, key), key=lambda m: (m.step, m.timestamp))
            steps = [m.step for m in hist]
            ax.plot(steps, [m.value for m in hist], label=key.split("/", 1)[1].replace("_at_", "@"),
                    marker="o" if len(steps) < 20 else None, markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"{rl.info.run_name} step")
        ax.set_ylabel(title.split(" (")[0] if "pass" not in title else "share of prompts (0-1)")
        ax.grid(True, alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "overview.png", bbox_inches="tight")
    return [f"![overview: {', '.join(t for t, _ in panels)}](overview.png)", ""]


def write_report(run_dir, out_dir=None, *, uri: str | None = None, include_children: bool = True) -> Path:
    """Write `<out_dir>/report.md` and `<out_dir>/*.png` (default out_dir: <run_dir>/report).

    uri defaults to the store recorded in tracking.json. Returns the path of report.md.
    """
    from mlflow.tracking import MlflowClient

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    state = RunState(run_dir).load()
    if not state.get("run_id"):
        raise FileNotFoundError(f"{run_dir}/tracking.json names no MLflow run (was tracking on?)")
    uri = uri or state.get("tracking_uri") or default_tracking_uri(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(state["run_id"])
    runs = [run]
    if include_children:
        children = client.search_runs(
            [run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{run.info.run_id}'",
            order_by=["attributes.start_time ASC"])
        runs += list(children)

    lines = [f"# Run report: {run.info.run_name}", "", f"- run dir: `{run_dir.resolve()}`",
             f"- tracking store: `{uri}`", f"- run id: `{run.info.run_id}`",
             f"- view: `mlflow ui --backend-store-uri {uri}`" if uri.startswith("sqlite") else
             f"- view: {uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}", ""]
    lines += _overview(client, runs, out)
    for i, r in enumerate(runs):
        prefix = "" if i == 0 else re.sub(r"[^\w.-]", "_", r.info.run_name or r.info.run_id) + "__"
        lines += _run_section(client, r, out, prefix)
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report
