"""The model card (`README.md` in a checkpoint, the format the Hugging Face hub shows) and the
evaluation results a checkpoint carries in `quantkit.json`.

Every checkpoint quantkit writes gets a card made from its `config.json` and provenance:
the base model, the scheme of each config group and what stays in float, the calibration,
the recorded results and how to serve it. `quantkit eval` appends what it measured to the
provenance's `evaluations` and writes the card again, so results travel with the files.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from quantkit.atomic import write_atomic

CARD = "README.md"
PROVENANCE = "quantkit.json"


def _weights(args: dict | None) -> str:
    if not args:
        return "float"
    if args.get("type") == "float":
        return f"fp{args['num_bits']} ({args['strategy']})"
    kind = f"int{args['num_bits']}, " + (
        f"group {args['group_size']}" if args.get("strategy") == "group" else f"per {args.get('strategy')}"
    )
    kind += ", symmetric" if args.get("symmetric") else ", asymmetric"
    return kind + (f", act-order {args['actorder']}" if args.get("actorder") else "")


def _activations(args: dict | None) -> str:
    if not args:
        return "float"
    how = "dynamic" if args.get("dynamic") else "static"
    kind = "int" if args.get("type") == "int" else "fp"
    return f"{kind}{args['num_bits']} {how} per {args['strategy']}"


def _hub_id(name: str) -> str | None:
    """`name` when it reads like a hub id (org/name), not a local path or a built-in name."""
    if name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists():
        return name
    return None


def render(config: dict, provenance: dict, name: str) -> str:
    """The card's markdown for a checkpoint folder called `name`."""
    qc = config.get("quantization_config") or {}
    prov = provenance or {}
    model = str(prov.get("model") or "")
    method = prov.get("algorithm")
    scheme = prov.get("scheme") or qc.get("format") or "quantized"
    tags = ["quantkit", "compressed-tensors", *([scheme] if scheme else []), *([method] if method else [])]
    front = ["---"]
    if _hub_id(model):
        front.append(f"base_model: {model}")
    front += ["library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    front += [f"- {t}" for t in dict.fromkeys(tags)] + ["---", ""]
    made = f"quantkit {prov.get('quantkit_version', '')}".strip()
    lines = [f"# {name}", ""]
    lines.append(
        f"`{model or 'a model'}` quantized to **{scheme}**"
        + (f" with **{method.upper()}**" if method else "")
        + f" by {made}"
        + (f" on {prov['created'][:10]}." if prov.get("created") else ".")
    )
    lines += _scheme_section(qc) + _calibration_section(prov, method) + _results_section(prov) + _use_section(name)
    return "\n".join(front + lines)


def _scheme_section(qc: dict) -> list[str]:
    lines = ["", "## Scheme", "", "| modules | weights | input activations |", "|---|---|---|"]
    for group in (qc.get("config_groups") or {}).values():
        targets = ", ".join(f"`{t}`" for t in group.get("targets", []))
        lines.append(
            f"| {targets} | {_weights(group.get('weights'))} | {_activations(group.get('input_activations'))} |"
        )
    ignore = qc.get("ignore") or []
    if ignore:
        shown = ", ".join(f"`{m}`" for m in ignore[:8]) + (f" and {len(ignore) - 8} more" if len(ignore) > 8 else "")
        lines += ["", f"Kept in float: {shown}."]
    kv = qc.get("kv_cache_scheme")
    if kv:
        per = "KV head" if kv.get("strategy") == "attn_head" else "layer"
        lines += ["", f"KV cache: {kv.get('type', 'int').replace('float', 'fp')}{kv['num_bits']}, one scale per {per}."]
    return lines


def _calibration_section(prov: dict, method: str | None) -> list[str]:
    cal = prov.get("calibration")
    if not cal and not prov.get("options"):
        return []
    lines = ["", "## Calibration", ""]
    if cal:
        lines.append(f"- text: `{cal['dataset']}`, {cal['samples']} × {cal['seq_len']} tokens, seed {cal['seed']}")
    if prov.get("transforms"):
        lines.append(f"- before quantizing: {', '.join(prov['transforms'])}")
    if prov.get("options"):
        opts = ", ".join(f"{k}={v}" for k, v in prov["options"].items() if v is not None)
        lines.append(f"- {method} options: {opts or 'none'}")
    if prov.get("wall_time_s") is not None:
        lines.append(f"- wall time {prov['wall_time_s']:.0f} s, peak memory {prov.get('peak_rss_mib', 0):.0f} MiB")
    return lines


def _results_section(prov: dict) -> list[str]:
    lines = ["", "## Results", ""]
    evaluations = prov.get("evaluations") or []
    if not evaluations:
        lines.append(
            "None recorded yet: `quantkit eval CHECKPOINT --baseline BASE_MODEL` measures perplexity, KL "
            "divergence and top-1 agreement against the float model and records them here."
        )
        return lines
    lines += ["| date | data | metric | this checkpoint | baseline | change |", "|---|---|---|---|---|---|"]
    for e in evaluations:
        data = ", ".join([*([e["ppl"]] if e.get("ppl") else []), *(e.get("tasks") or [])])
        if e.get("limit"):
            data += f" (limit {e['limit']})"
        for row in e.get("rows", []):
            lines.append(
                f"| {e['created'][:10]} | {data} | {row['metric']} | {_number(row.get('candidate'))} "
                f"| {_number(row.get('baseline'))} | {_number(row.get('delta'), signed=True)} |"
            )
    baselines = sorted({e["baseline"] for e in evaluations if e.get("baseline")})
    if baselines:
        lines += ["", "Baseline: " + ", ".join(f"`{b}`" for b in baselines) + "."]
    return lines


def _use_section(name: str) -> list[str]:
    return [
        "",
        "## Use it",
        "",
        "```bash",
        f'quantkit generate {name} "Once upon a time"',
        f"quantkit serve {name}        # an OpenAI-compatible API",
        f"vllm serve {name}            # vLLM reads compressed-tensors checkpoints",
        "```",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM  # with compressed-tensors installed",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        "```",
        "",
        "`quantkit.json` holds the full provenance: every option, the recipe, and the recorded evaluations.",
        "",
    ]


def _number(v, signed: bool = False) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:+.4f}" if signed else f"{v:.4f}"
    return str(v)


def write_card(folder: Path, config: dict, provenance: dict, name: str | None = None) -> None:
    write_atomic(Path(folder) / CARD, render(config, provenance, name or Path(folder).name))


def record_evaluation(folder: Path, report: dict) -> bool:
    """Append what an evaluation measured to a quantkit checkpoint's `quantkit.json` and
    write its card again; False (nothing written) when `folder` is not a quantkit checkpoint
    (a float model or someone else's checkpoint)."""
    folder = Path(folder)
    if not (folder / PROVENANCE).is_file() or not (folder / "config.json").is_file():
        return False
    provenance = json.loads((folder / PROVENANCE).read_text())
    config = json.loads((folder / "config.json").read_text())
    keys = ("baseline", "ppl", "tasks", "limit", "seq_len", "num_fewshot", "thresholds", "rows", "failures")
    entry = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    entry |= {k: report.get(k) for k in keys if k in report}
    entry |= {
        "passed": report.get("passed"),
        "data_sha256": report.get("data_sha256"),
        "versions": report.get("versions"),
    }
    provenance["evaluations"] = [*provenance.get("evaluations", []), entry]
    try:
        write_atomic(folder / PROVENANCE, json.dumps(provenance, indent=2) + "\n")
        write_card(folder, config, provenance)
    except OSError:  # a read-only checkpoint: the results are still printed and returned
        return False
    return True
