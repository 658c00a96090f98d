"""ptq's import makes the process's first call into torch's vector math on one thread
(ptq/first_math_call.py: a first parallel cos or sin may be computed wrong; how often:
scripts/first_math_call.py)."""

import subprocess
import sys


def test_importing_ptq_settles_the_first_math_call():
    code = ("import ptq, ptq.first_math_call as f; "
            "print(f.settle.cache_info().currsize, f.settle.cache_info().hits)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "0"]  # called once, by the import itself
