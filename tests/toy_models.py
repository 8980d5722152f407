"""The toy model set that the suite's orchestration tests run on, named here once.

The suite names its model instead of taking the shipped default (`default_model_dir()`): the default is chosen for
users (since issue #43 a 19M-parameter target), while the tests that drive servers, clients and benches only need
a real trained pair that is fast under TRITON_INTERPRET on CI's two cores. A test that checks the default itself
(the commands of docs/USAGE.md, `make demo`, tests/test_default_model.py) keeps calling default_model_dir().

The toy set lies in deploy/models/toy/{target,drafter,drafter-eagle,drafter-moa-tli0} (3.5M parameters, the default
until issue #43 replaced it with the compact recipe's models).
"""

from pathlib import Path

TOY_MODELS = Path(__file__).resolve().parents[1] / "deploy" / "models" / "toy"


def toy_model_dir(name: str = "target") -> Path:
    """The toy set's `name` folder: "target", "drafter" (MoA), "drafter-eagle" or "drafter-moa-tli0"."""
    return TOY_MODELS / name


def toy_model_flags(drafter: str = "drafter") -> list[str]:
    """--model and --drafter naming the toy set, for a command line (serve, warm, generate, a bench program)."""
    return ["--model", str(toy_model_dir()), "--drafter", str(toy_model_dir(drafter))]


def load_toy_pair():
    """The toy target (on the CPU), its tokenizer, its MoA drafter and the target's fingerprint, as a server loads."""
    from tether.server.model_loading import load
    from tether.shared.checkpoint import fingerprint
    from tether.shared.drafter_loading import load_drafter

    target, tok = load(toy_model_dir(), "cpu")
    fp = fingerprint(toy_model_dir())
    return target, tok, load_drafter(toy_model_dir("drafter"), target, target_fingerprint=fp), fp
