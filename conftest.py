"""
pytest's set-up for the test files: Triton's interpreter where there is no GPU, the Hypothesis
profiles `python -m pytest --hypothesis-profile NAME` chooses from, and torch's global generator
under Hypothesis's control. They live here, not in test_nanopaged.py: the interpreter must be
chosen before any test file imports kernel.py, and the Hypothesis plugin loads the named profile
while pytest configures itself, before it imports any test file. test_nanopaged.examples()
scales each test's examples by the active profile's max_examples against the default profile's
(100).
"""

import os

import torch
from hypothesis import register_random, settings

if not torch.cuda.is_available():
    # Triton's interpreter runs the kernels on the CPU. kernel.py's @triton.jit reads this when
    # it is imported, so it is set here, before any test file (yours too) imports kernel.py.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One torch thread, unless OMP_NUM_THREADS says otherwise: the tests' models are tiny, and
    # on cores another process is using, a second thread's spin-waits stretched tests up to 8x
    # (test_a_failure_anywhere_in_a_step_changes_nothing: 244 s on two threads, 29 s on one),
    # past what pyproject.toml's per-test limit allows.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

settings.register_profile("fast", max_examples=10)  # an edit-test loop: about 2 minutes
settings.register_profile("thorough", max_examples=1000)  # a night: 10x the default's examples
# tools/seeds.sh: the default's examples, and no example database, so that each seed's run is
# its own (the database would replay at every seed what failed at an earlier one)
settings.register_profile("seeds", database=None)


class TorchGlobalRandom:
    """torch's global generator, for Hypothesis to seed before each example and restore after, as
    it does Python's and numpy's: a request sampled without a seed draws its seed from it, so
    without this a test's verdict could follow whatever ran before it, and Hypothesis could not
    replay a case it found."""
    seed = staticmethod(torch.manual_seed)
    getstate = staticmethod(torch.get_rng_state)
    setstate = staticmethod(torch.set_rng_state)


TORCH_GLOBAL_RANDOM = TorchGlobalRandom()  # Hypothesis keeps only a weak reference
register_random(TORCH_GLOBAL_RANDOM)
