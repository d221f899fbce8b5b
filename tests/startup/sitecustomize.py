"""Run by Python at start-up in a test's child process whose PYTHONPATH starts with this
directory (tests/injected_faults.py's `pausing`): installs the pause that BERTJAX_TEST_PAUSE
names before bertjax runs."""

import os
import sys

if os.environ.get("BERTJAX_TEST_PAUSE"):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    import injected_faults

    injected_faults.install(os.environ["BERTJAX_TEST_PAUSE"])
