"""
pytest's set-up for the test files: the Hypothesis profiles `python -m pytest
--hypothesis-profile NAME` chooses from. They are registered here, not in test_nanopaged.py,
because the Hypothesis plugin loads the named profile while pytest configures itself, before it
imports any test file. test_nanopaged.examples() scales each test's examples by the active
profile's max_examples against the default profile's (100).
"""

from hypothesis import settings

settings.register_profile("fast", max_examples=10)  # an edit-test loop: about 2 minutes
settings.register_profile("thorough", max_examples=1000)  # a night: 10x the default's examples
