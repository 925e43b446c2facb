"""Optional modules in the tests: why one does not import, and the variable that makes a
missing one fail its tests instead of skipping them (CI sets it). Its own module, so that
conftest.py and the tests import it by one name (tests/ops has a conftest.py of its own)."""

import importlib

REQUIRE_OPTIONAL_ENV = "LAT_REQUIRE_OPTIONAL"


def import_failure(module):
    """Why ``module`` does not import (a phrase), or None."""
    try:
        importlib.import_module(module)
    except Exception as error:  # (a package built for another Triton fails on import, not always ImportError)
        return f"{module} does not import ({type(error).__name__}: {error})"
    return None
