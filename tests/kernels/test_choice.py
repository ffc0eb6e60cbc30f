"""The chooser: candidates in order, each refusal's reason kept, backends that force a kind,
and an error that names every refusal when none can run the problem."""

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.kernels.choice import Candidate, Problem, always, choose, fixed


def refuses(why):
    return lambda p: (False, why)


def candidates():
    return [
        Candidate("gpu", always, fixed("gpu"), device="cuda", backend="triton"),
        Candidate("fast cpu", lambda p: (p.width % 16 == 0, "width % 16 != 0"), fixed("fast cpu"), device="cpu"),
        Candidate("any", refuses("never"), fixed("any")),
        Candidate("twin", always, fixed("twin"), backend="torch"),
    ]


def test_the_first_that_can_wins_and_says_what_it_passed_over():
    fast = choose("op", candidates(), Problem("cpu", torch.float32, width=64))
    assert (fast.op, fast.name, fast.fn, fast.passed_over, fast.why) == ("op", "fast cpu", "fast cpu", (), None)
    slow = choose("op", candidates(), Problem("cpu", torch.float32, width=7))
    assert slow.name == "twin" and slow.passed_over == (("fast cpu", "width % 16 != 0"), ("any", "never"))
    assert slow.why == "fast cpu: width % 16 != 0; any: never"


def test_a_twin_chosen_where_only_a_gpu_has_better_says_so():
    only = [candidates()[0], candidates()[-1]]
    assert choose("op", only, Problem("cpu", torch.float32)).why == "gpu: it needs a GPU"


def test_backends_force_a_kind():
    torch_ = choose("op", candidates(), Problem("cpu", torch.float32, "torch", width=64))
    assert (torch_.name, torch_.why) == ("twin", "backend torch")
    triton = choose("op", candidates(), Problem("cpu", torch.float32, "triton", width=64))
    assert triton.name == "gpu"  # runs where the tensors are: TRITON_INTERPRET=1 on a CPU
    with pytest.raises(QuantkitError, match="backend 'cuda' is unknown"):
        Problem("cpu", torch.float32, "cuda")


def test_nothing_can_run_it():
    with pytest.raises(QuantkitError, match=r"no kernel can run op here \(a: no; b: nor this\)"):
        choose(
            "op",
            [Candidate("a", refuses("no"), fixed(1)), Candidate("b", refuses("nor this"), fixed(2))],
            Problem("cpu", torch.float32),
        )
