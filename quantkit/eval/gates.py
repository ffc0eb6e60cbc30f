"""Accuracy regression gates: score a baseline (the float model) and a candidate (a
quantized checkpoint) on the same data, one after the other, and compare metric by metric.

Recovery is candidate / baseline for metrics where higher is better (accuracy) and
baseline / candidate where lower is better (perplexities, bits per byte), so 1.0 means
nothing was lost. `max_ppl_increase` (a fraction: 0.02 is 2%) bounds every perplexity;
`min_recovery` bounds every other metric, and the perplexities too when
`max_ppl_increase` is not given. With a perplexity text the candidate is also compared
with the baseline token by token on the same windows (quantkit.eval.kld): `kld` (mean
KL(baseline ‖ candidate) per position, nats), `kld_p99` and `top1_agreement`, bounded by
`max_kld` and `min_top1`.
"""

from __future__ import annotations

import gc
import platform
import tempfile
import time
from importlib import metadata

from quantkit.errors import QuantkitError
from quantkit.formats.card import record_evaluation
from quantkit.models.loading import resolve_model
from quantkit.progress import Track, no_progress

PROBE = "Quantization keeps 4 bits per weight; naïve rounding loses ~1.5% — AWQ & GPTQ recover most of it.\n"


def _is_perplexity(metric: str) -> bool:
    return metric.rsplit("/", 1)[-1] in ("ppl", "perplexity") or metric.endswith("_perplexity")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else (1.0 if num == den else None)


def compare_metric(
    metric: str,
    candidate: float,
    baseline: float | None,
    higher_is_better: bool,
    max_ppl_increase: float | None = None,
    min_recovery: float | None = None,
) -> tuple[dict, str | None]:
    """({metric, baseline, candidate, delta, recovery, passed}, the failure sentence or None).
    `passed` is None where no threshold applies (or there is no baseline)."""
    row = {
        "metric": metric,
        "baseline": baseline,
        "candidate": candidate,
        "delta": None,
        "recovery": None,
        "passed": None,
    }
    if baseline is None:
        return row, None
    delta = candidate - baseline
    recovery = _ratio(candidate, baseline) if higher_is_better else _ratio(baseline, candidate)
    row.update(delta=delta, recovery=recovery)
    change, failure = f"({baseline:.4g} → {candidate:.4g})", None
    if max_ppl_increase is not None and _is_perplexity(metric):
        row["passed"] = candidate <= baseline * (1 + max_ppl_increase)
        failure = f"{metric} rose {delta / baseline:.2%} {change}, more than the allowed {max_ppl_increase:.2%}."
    elif min_recovery is not None:
        no_worse = candidate >= baseline if higher_is_better else candidate <= baseline
        row["passed"] = no_worse if recovery is None else recovery >= min_recovery
        shown = "n/a" if recovery is None else f"{recovery:.4f}"
        failure = f"{metric} recovered {shown} of the baseline {change}, below the required {min_recovery:g}."
    return row, (failure if row["passed"] is False else None)


def compare(
    candidate: dict, baseline: dict | None, max_ppl_increase: float | None = None, min_recovery: float | None = None
) -> tuple[list[dict], list[str]]:
    """Rows and failure sentences for the metrics of two `measure` results (baseline None: one model)."""
    rows, failures = [], []
    for metric, value in candidate["metrics"].items():
        base = None if baseline is None else baseline["metrics"].get(metric)
        row, failure = compare_metric(
            metric, value, base, candidate["higher_is_better"][metric], max_ppl_increase, min_recovery
        )
        rows.append(row)
        failures += [failure] if failure else []
    if baseline is not None and baseline["data_sha256"] != candidate["data_sha256"]:
        failures.append("the baseline and the candidate were scored on different data (their data sha256 differ).")
    return rows, failures


def kld_rows(stats: dict, max_kld: float | None = None, min_top1: float | None = None) -> tuple[list[dict], list[str]]:
    """Rows (as `compare_metric`'s, with no baseline value: they compare the two models) and
    failure sentences for `kld`, `kld_p99` and `top1_agreement` of a `kld.Comparer` summary."""
    kld, top1 = stats["kld"], stats["top1_agreement"]
    gates = {
        "kld": None if max_kld is None else kld <= max_kld,
        "kld_p99": None,
        "top1_agreement": None if min_top1 is None else top1 >= min_top1,
    }
    rows = [
        {"metric": m, "baseline": None, "candidate": stats[m], "delta": None, "recovery": None, "passed": passed}
        for m, passed in gates.items()
    ]
    failures = []
    if gates["kld"] is False:
        failures.append(f"kld is {kld:.4g} nats per token, more than the allowed {max_kld:g}.")
    if gates["top1_agreement"] is False:
        failures.append(f"top1_agreement is {top1:.2%} of positions, below the required {min_top1:.2%}.")
    return rows, failures


def check_same_tokenizer(candidate: str, baseline: str) -> None:
    """A `QuantkitError` unless both models' tokenizers have the same vocabulary size and
    encode a fixed probe text to the same ids."""
    from quantkit.models.loading import load_tokenizer, resolve_model

    a, b = (load_tokenizer(resolve_model(m)) for m in (candidate, baseline))
    if len(a) != len(b) or a.encode(PROBE) != b.encode(PROBE):
        raise QuantkitError(
            f"the tokenizer of {candidate} differs from the baseline {baseline}'s (vocabulary "
            f"{len(a)} vs {len(b)} tokens, or another encoding of the same text); compare a "
            "checkpoint with the model it was made from."
        )


def measure(
    model_name: str,
    ppl: str | None,
    tasks,
    manager=None,
    *,
    limit=None,
    seq_len=None,
    num_fewshot=None,
    batch_size: int = 1,
    track: Track = no_progress,
    observe=None,
    dtype=None,
) -> dict:
    """Load one model (computing in `dtype`, default its own) and score it: {"metrics",
    "higher_is_better", "data_sha256", "ppl" (details or None), "docs", "eval_time_s"}; the
    model is freed on return. `observe` sees the perplexity logits (a `kld.Recorder` or
    `kld.Comparer`)."""
    from quantkit.eval.run import load_for_eval, text_perplexity, window_length

    model, tokenizer = load_for_eval(model_name, dtype)
    start = time.perf_counter()
    result = {"metrics": {}, "higher_is_better": {}, "data_sha256": {}, "ppl": None, "docs": {}}
    if ppl:
        details = text_perplexity(model, tokenizer, ppl, seq_len, limit, batch_size, track, observe)
        result["metrics"]["ppl"], result["higher_is_better"]["ppl"] = details["ppl"], False
        result["data_sha256"]["ppl"] = details["data_sha256"]
        result["ppl"] = {k: details[k] for k in ("dataset", "nll", "tokens", "windows", "seq_len")}
    if tasks:
        from quantkit.eval.harness import QuantkitLM, run_tasks

        lm = QuantkitLM(
            model=model,
            tokenizer=tokenizer,
            batch_size=batch_size,
            max_length=window_length(model, seq_len),
            track=track,
        )
        scores = run_tasks(lm, list(tasks), manager, limit=limit, num_fewshot=num_fewshot)
        for key in ("metrics", "higher_is_better", "data_sha256", "docs"):
            result[key].update(scores[key])
    result["eval_time_s"] = round(time.perf_counter() - start, 2)
    return result


def _versions() -> dict:
    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    from quantkit.version import __version__

    return {
        "quantkit": __version__,
        "torch": version("torch"),
        "transformers": version("transformers"),
        "lm_eval": version("lm_eval"),
        "python": platform.python_version(),
    }


def _check_args(baseline, ppl, tasks, max_ppl_increase, min_recovery, max_kld, min_top1) -> None:
    if not ppl and not tasks:
        raise QuantkitError("nothing to evaluate: give a perplexity text (--ppl) or --tasks.")
    if baseline is None and any(v is not None for v in (max_ppl_increase, min_recovery, max_kld, min_top1)):
        raise QuantkitError(
            "--max-ppl-increase, --min-recovery, --max-kld and --min-top1 compare against a baseline; "
            "add --baseline MODEL."
        )
    if not ppl and (max_kld is not None or min_top1 is not None):
        raise QuantkitError("--max-kld and --min-top1 are measured on the perplexity windows; give --ppl TEXT.")
    if max_kld is not None and max_kld < 0:
        raise QuantkitError(f"--max-kld must be at least 0 (nats per token, e.g. 0.05), got {max_kld}.")
    if min_top1 is not None and not 0 < min_top1 <= 1:
        raise QuantkitError(f"--min-top1 is a fraction of positions above 0 and at most 1 (e.g. 0.9), got {min_top1}.")
    if max_ppl_increase is not None and max_ppl_increase < 0:
        raise QuantkitError(f"--max-ppl-increase must be at least 0, got {max_ppl_increase}.")
    if min_recovery is not None and min_recovery <= 0:
        raise QuantkitError(f"--min-recovery must be above 0 (e.g. 0.98), got {min_recovery}.")


def _task_manager(tasks, include_path):
    if not tasks:
        return None
    try:
        from quantkit.eval.harness import task_manager
    except ImportError as e:
        raise QuantkitError(
            f"--tasks needs lm-eval ({e.name} is missing); install it with pip install -e '.[eval]' -c constraints.txt."
        ) from None
    return task_manager(list(tasks), include_path)


def evaluate_gates(candidate: str, baseline: str | None = None, **options) -> dict:
    """Score `candidate` (and `baseline` first, on the same data) on perplexity of the
    text `ppl` (quantkit's protocol; None to skip) and the lm-eval `tasks` (built-in
    wiki_cloze and wiki_wordppl, folders under `include_path`, lm-eval's own), `limit`
    windows / documents each, and apply the thresholds (the keyword arguments of
    `evaluate_many`, whose one report this is). With a baseline and `ppl`, the
    baseline leaves its fp16 log-probabilities of every perplexity position in a temporary
    folder (removed afterwards; 2 bytes × vocabulary per position) and the candidate is
    compared with them: rows `kld`, `kld_p99`, `top1_agreement` after `ppl`, gated by
    `max_kld` (nats per token) and `min_top1` (a fraction).

    Returns {"candidate", "baseline", "ppl", "tasks", "limit", "seq_len", "num_fewshot",
    "thresholds", "rows": [{metric, baseline, candidate, delta, recovery, passed}],
    "failures": [one sentence per failed threshold], "passed", "results": {"candidate",
    "baseline": each model's `measure`, the candidate's with "kld" details}, "data_sha256",
    "versions", "seeds", "recorded"}. When the candidate is a quantkit checkpoint the report
    is also appended to its `quantkit.json` (`evaluations`) and its model card rewritten
    ("recorded": true).
    """
    return evaluate_many([candidate], baseline, **options)[0]


def evaluate_many(
    candidates: list[str],
    baseline: str | None = None,
    *,
    ppl: str | None = "wiki",
    tasks: list[str] = (),
    limit: int | None = None,
    seq_len: int | None = None,
    num_fewshot: int | None = None,
    include_path: str | None = None,
    max_ppl_increase: float | None = None,
    min_recovery: float | None = None,
    max_kld: float | None = None,
    min_top1: float | None = None,
    track: Track | None = None,
    batch_size: int = 1,
    dtype=None,
) -> list[dict]:
    """`evaluate_gates`' report for each of `candidates`, in order, against one `baseline`
    scored once: its log-probabilities are kept until the last candidate is compared. With
    `dtype` (a torch dtype) every model computes in it, whatever dtype its checkpoint names
    (checkpoints exported in fp16 or bf16 then compare with an fp32 baseline on one footing)."""
    from quantkit.runtime.qlinear import dtype_name

    tasks = [t for t in tasks if t]
    if not candidates:
        raise QuantkitError("nothing to evaluate: name at least one model.")
    _check_args(baseline, ppl, tasks, max_ppl_increase, min_recovery, max_kld, min_top1)
    for candidate in candidates if baseline is not None else ():
        check_same_tokenizer(candidate, baseline)
    manager = _task_manager(tasks, include_path)
    options = dict(limit=limit, seq_len=seq_len, num_fewshot=num_fewshot, batch_size=batch_size, dtype=dtype)
    options["track"] = track or no_progress
    scope = {"ppl": ppl, "tasks": tasks, "limit": limit, "seq_len": seq_len, "num_fewshot": num_fewshot}
    scope["dtype"] = None if dtype is None else dtype_name(dtype)
    scope["include_path"] = None if include_path is None else str(include_path)
    thresholds = {"max_ppl_increase": max_ppl_increase, "min_recovery": min_recovery}
    thresholds |= {"max_kld": max_kld, "min_top1": min_top1}
    reports = []
    for candidate, scored, comparer in _score(candidates, baseline, ppl, tasks, manager, options):
        rows, failures = compare(scored["candidate"], scored.get("baseline"), max_ppl_increase, min_recovery)
        if comparer is not None:
            scored["candidate"]["kld"] = comparer.summary()
            _add_kld_rows(rows, failures, scored["candidate"]["kld"], max_kld, min_top1)
        report = {"candidate": str(candidate), "baseline": None if baseline is None else str(baseline), **scope}
        report |= {"thresholds": thresholds, "rows": rows, "failures": failures, "passed": not failures}
        report |= {
            "results": {"candidate": scored["candidate"], "baseline": scored.get("baseline")},
            "data_sha256": scored["candidate"]["data_sha256"],
            "versions": _versions(),
            "seeds": _seeds(tasks),
        }
        report["recorded"] = record_evaluation(resolve_model(candidate), report)
        reports.append(report)
    return reports


def _score(candidates, baseline, ppl, tasks, manager, options):
    # yields (candidate, {"baseline"?, "candidate"}: each a `measure`, the kld.Comparer that saw
    # the candidate or None); the baseline is scored once, and its log-probabilities live in a
    # temporary folder until the last candidate is scored
    from quantkit.eval.kld import Comparer, Recorder

    base, full_from = None, None
    with tempfile.TemporaryDirectory(prefix="quantkit-kld-") as folder:
        if baseline is not None:
            recorder = Recorder(folder) if ppl else None
            base = measure(baseline, ppl, tasks, manager, **options, observe=recorder)
            gc.collect()
            if recorder is not None and recorder.full_from == 0:
                raise QuantkitError(
                    f"{folder} cannot hold the baseline's log-probabilities of one window (2 bytes per token of "
                    "the vocabulary per position, 1 GiB kept free); set TMPDIR to a larger disk."
                )
            full_from = None if recorder is None else recorder.full_from
        for candidate in candidates:
            comparer = Comparer(folder, full_from) if baseline is not None and ppl else None
            scored = {"baseline": base} if baseline is not None else {}
            scored["candidate"] = measure(candidate, ppl, tasks, manager, **options, observe=comparer)
            gc.collect()
            yield candidate, scored, comparer


def _add_kld_rows(rows: list, failures: list, stats: dict, max_kld, min_top1) -> None:
    # the kld rows go right after the ppl row (first when there is none)
    more_rows, more_failures = kld_rows(stats, max_kld, min_top1)
    after_ppl = 1 + next((i for i, row in enumerate(rows) if row["metric"] == "ppl"), -1)
    rows[after_ppl:after_ppl] = more_rows
    failures += more_failures


def _seeds(tasks: list[str]) -> dict:
    if not tasks:
        return {}
    from quantkit.eval import tasks as builtin
    from quantkit.eval.harness import SEEDS

    return {"lm_eval": SEEDS, **({"wiki_cloze": builtin.CLOZE_SEED} if "wiki_cloze" in tasks else {})}
