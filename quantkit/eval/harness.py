"""lm-eval on quantkit models: the adapter `QuantkitLM`, registered with lm-eval as the
model `quantkit` (any float model or checkpoint `quantkit.load` reads), and `run_tasks`,
which `quantkit eval --tasks` and the gates call.

lm-eval 0.4.13 offers no way for an installed package to add models to its own CLI, so
`python -m quantkit.eval.harness ARGS` is `lm_eval ARGS` with this adapter registered
and the built-in tasks (quantkit.eval.tasks) added to `--include_path` when named:

    python -m quantkit.eval.harness --model quantkit --model_args path=out/ckpt --tasks wiki_cloze
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from transformers import StoppingCriteria, StoppingCriteriaList

from quantkit.errors import QuantkitError
from quantkit.eval import tasks as builtin
from quantkit.progress import Track, no_progress

# lm-eval's own defaults (simple_evaluate), passed explicitly so reports can name them
SEEDS = {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}


class QuantkitLM(TemplateLM):
    """An lm-eval model over `quantkit.load(path)`, or over an already loaded `model` and
    `tokenizer`. Scores batches of right-padded rows (`batch_size` per forward pass, no
    longer than `max_length` tokens: default 2048 or the model's context if shorter);
    generates greedily (`until` strings and `max_gen_toks` honoured, sampling arguments
    ignored). Model arguments: path (or pretrained), batch_size, max_length,
    max_gen_toks, device, dtype."""

    def __init__(
        self,
        path: str | None = None,
        pretrained: str | None = None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        device: str | None = None,
        dtype: str | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it; unused
        *,
        model=None,
        tokenizer=None,
        track: Track = no_progress,
    ):
        super().__init__()
        from quantkit.eval.run import context_length, load_for_eval

        if model is None:
            if not (path or pretrained):
                raise QuantkitError("the quantkit lm-eval model needs path=MODEL_OR_CKPT in --model_args.")
            torch_dtype = None if dtype in (None, "auto") else getattr(torch, str(dtype))
            model, tokenizer = load_for_eval(path or pretrained, torch_dtype)
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise QuantkitError(f"batch_size must be a whole number of at least 1 for quantkit, got {batch_size!r}.")
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's CLI asks for cuda:0 by default; stay on the CPU without a GPU
        self.model = model.to(device).eval() if device else model.eval()
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or min(2048, context_length(model)))
        self.max_gen_toks = int(max_gen_toks)
        self.track = track
        if tokenizer.eos_token_id is None:
            raise QuantkitError("the model's tokenizer has no EOS token, which lm-eval needs; add one.")
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # as lm-eval's HFLM: BOS when there is one, else EOS
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens), verbose=False)["input_ids"]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        scores = self.score([(context, continuation) for _, context, continuation in requests])
        for (key, _, _), score in zip(requests, scores):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, score)
        return scores

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's total log-likelihood over lm-eval's rolling windows (as HFLM:
        context 1, `max_length` tokens per window, the prefix token before the first)."""
        pairs, owners = [], []
        for n, (string,) in enumerate(r.args for r in requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for pair in map(lm_utils.make_disjoint_window, windows):
                pairs.append(pair)
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self.score(pairs)):
            totals[n] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is the greedy one) per
        (context ids, continuation ids); contexts are cut on the left to fit `max_length`."""
        rows = [self._row(context, continuation) for context, continuation in pairs]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # longest first: less padding
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        results: list = [None] * len(rows)
        with torch.inference_mode():
            for batch in self.track(batches, "loglikelihood", len(batches)):
                logits = self._forward([rows[i][0] for i in batch])  # [b, T, vocab]
                for i, row_logits in zip(batch, logits):
                    inputs, target = rows[i]
                    n = len(target)
                    logprobs = row_logits[len(inputs) - n : len(inputs)].float().log_softmax(-1)  # [n, vocab]
                    target = torch.tensor(target, device=logprobs.device)
                    results[i] = (
                        logprobs.gather(1, target[:, None]).sum().item(),
                        bool((logprobs.argmax(-1) == target).all()),
                    )
        return results

    def _row(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        if len(continuation) > self.max_length:
            raise QuantkitError(
                f"a continuation of {len(continuation)} tokens is longer than max_length "
                f"{self.max_length}; raise max_length or shorten the task's targets."
            )
        whole = (context + continuation)[-(self.max_length + 1) :]
        return whole[:-1], continuation

    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        width = max(map(len, inputs))  # right padding: causal attention never sees it
        ids = torch.tensor([row + [self._pad] * (width - len(row)) for row in inputs], device=self.device)
        return self.model(ids).logits

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut before the first `until` string (and EOS), at most
        `max_gen_toks` tokens; requests with the same arguments run in batches."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        results: list = [None] * len(requests)
        for indices in groups.values():
            until, max_new = self._stop_args(requests[indices[0]].args[1])
            prompts = {i: self.tok_encode(requests[i].args[0]) or [self.prefix_token_id] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
            for batch in self.track(batches, "generate", len(batches)):
                for i, text in zip(batch, self.generate([prompts[i] for i in batch], until, max_new)):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _stop_args(self, kwargs: dict) -> tuple[list[str], int]:
        until = kwargs.get("until") or []
        return ([until] if isinstance(until, str) else list(until)), int(kwargs.get("max_gen_toks", self.max_gen_toks))

    def generate(self, prompts: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """Greedy text after each prompt (token ids; left-padded together, cut on the left to
        leave room for `max_new` tokens), stopped at EOS or an `until` string."""
        room = self.max_length - max_new
        if room < 1:
            raise QuantkitError(
                f"max_gen_toks {max_new} leaves no room for a prompt in max_length "
                f"{self.max_length}; lower max_gen_toks or raise max_length."
            )
        prompts = [p[-room:] for p in prompts]
        width = max(map(len, prompts))
        ids = torch.tensor([[self._pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        stop = StoppingCriteriaList([_StopStrings(self.tokenizer, until, width)] if until else [])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=self._pad,
                eos_token_id=self.eot_token_id,
                stopping_criteria=stop,
            )
        texts = []
        for row in out[:, width:].tolist():
            row = row[: row.index(self.eot_token_id)] if self.eot_token_id in row else row
            texts.append(cut_at(self.tokenizer.decode(row, skip_special_tokens=True), until))
        return texts


def cut_at(text: str, until: list[str]) -> str:
    """`text` up to the first occurrence of any of the `until` strings."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


class _StopStrings(StoppingCriteria):
    def __init__(self, tokenizer, until: list[str], start: int):
        self.tokenizer, self.until, self.start = tokenizer, until, start

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.start :], skip_special_tokens=True)
        return torch.tensor([any(s and s in t for s in self.until) for t in texts], device=input_ids.device)


class _Tasks(TaskManager):
    """lm-eval's task manager; a task whose data cannot be loaded is a `QuantkitError`."""

    def load(self, task_list):
        try:
            return super().load(task_list)
        except Exception as e:
            names = ", ".join(map(str, task_list if isinstance(task_list, list) else [task_list]))
            detail = (str(e).splitlines() or [""])[0][:200]
            raise QuantkitError(
                f"could not load the lm-eval task(s) {names} ({type(e).__name__}: {detail}); "
                "check the name and that its data is reachable."
            ) from None


def task_manager(tasks: list[str], include_path: str | None = None) -> TaskManager:
    """A task manager that knows every task in `tasks`: the built-in ones, those under
    `include_path`, and lm-eval's own (indexed only when needed; they need the hub)."""
    from quantkit.hub import hub_reachable

    if not tasks:
        raise QuantkitError("no tasks given; name at least one, e.g. --tasks wiki_cloze.")
    if include_path is not None and not Path(include_path).is_dir():
        raise QuantkitError(f"--include-path {include_path} is not a folder; give the folder of your task YAMLs.")
    paths = ([str(builtin.task_folder())] if set(tasks) & set(builtin.TASKS) else []) + (
        [str(include_path)] if include_path else []
    )
    manager = _Tasks(include_path=paths, include_defaults=False)
    others = [t for t in tasks if t not in manager.all_tasks]
    if not others:
        return manager
    if not hub_reachable():
        raise QuantkitError(
            f"task {others[0]!r} is not built in or under --include-path, and lm-eval's own tasks "
            "need the Hugging Face hub, which cannot be reached; use wiki_cloze, wiki_wordppl or "
            "a local task folder with --include-path."
        )
    manager = _Tasks(include_path=paths or None, include_defaults=True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise QuantkitError(
            f"unknown task {unknown[0]!r}; use wiki_cloze, wiki_wordppl, an lm-eval task name "
            "or a task YAML under --include-path."
        )
    return manager


def _configure(loaded: dict, num_fewshot: int | None) -> None:
    for task in loaded["tasks"].values():  # as lm-eval's simple_evaluate does
        default = task.get_config("num_fewshot")
        if num_fewshot is not None and default != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=SEEDS["fewshot"])


def _data_sha256(samples: list[dict]) -> str:
    hashes = {s["doc_id"]: s["doc_hash"] for s in samples}
    return hashlib.sha256("\n".join(hashes[k] for k in sorted(hashes)).encode()).hexdigest()


def run_tasks(
    lm,
    tasks: list[str],
    manager: TaskManager | None = None,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    include_path: str | None = None,
) -> dict:
    """lm-eval `tasks` on `lm`, with lm-eval's default seeds. Returns {"metrics":
    {"task/metric": value}, "higher_is_better": {"task/metric": bool}, "docs": {task: n},
    "data_sha256": {task: sha256 of the evaluated documents' lm-eval hashes}}."""
    import numpy as np
    from lm_eval.evaluator import evaluate

    manager = manager or task_manager(tasks, include_path)
    random.seed(SEEDS["random"])
    np.random.seed(SEEDS["numpy"])
    torch.manual_seed(SEEDS["torch"])
    loaded = manager.load(list(tasks))
    _configure(loaded, num_fewshot)
    out = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=True)
    report = {"metrics": {}, "higher_is_better": {}, "docs": {}, "data_sha256": {}}
    for task, values in out["results"].items():
        better = out.get("higher_is_better", {}).get(task, {})
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if metric not in better or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue  # stderr, sample_len, alias
            name = f"{task}/{metric}" + ("" if filt in ("", "none") else f",{filt}")
            report["metrics"][name] = float(value)
            report["higher_is_better"][name] = better[metric] is not False
    for task, samples in out.get("samples", {}).items():
        report["docs"][task] = len({s["doc_id"] for s in samples})
        report["data_sha256"][task] = _data_sha256(samples)
    return report


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the `quantkit` model registered and the built-in tasks
    added to its include path when they are named."""
    import sys

    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    named = {t for entry in (getattr(args, "tasks", None) or []) for t in str(entry).split(",")}
    if named & set(builtin.TASKS):
        args.include_path = [str(builtin.task_folder())] + ([args.include_path] if args.include_path else [])
    parser.execute(args)


def _register() -> None:
    import lm_eval.models  # noqa: F401  lm-eval's own models: its registry imports them only while empty
    from lm_eval.api.registry import model_registry, register_model

    if "quantkit" not in model_registry:
        register_model("quantkit")(QuantkitLM)


if __name__ == "__main__":
    from quantkit.eval.harness import main as _main  # the importable module registers the adapter

    _main()
else:
    _register()
