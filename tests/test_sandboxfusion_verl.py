"""veRL's own SandboxFusion scorer, unmodified from PyPI, scoring against dsec's /run_code
the way veRL's CPU test (tests/utils/reward_score/reward_score/test_sandbox_fusion_on_cpu.py)
does: its URL ends in /run_code, it sends up to max(32, 5 × cores) requests at once, and
it turns each response into True/False or an error code (-1 api or sandbox error, -2
runtime error, -3 time-out, -4 compile error).

The scorer module needs only `requests`, so veRL is installed without its dependencies
(`pip install --no-deps verl`, done by scripts/setup.sh) and the module is loaded from the
installed package's files without importing `verl` itself (which would pull in torch).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_sandboxfusion import Grader, grader  # noqa: F401 - the module's server fixture

# Building and importing the grader image on a fresh machine takes minutes.
pytestmark = pytest.mark.timeout(1800)


def _load_scorer() -> ModuleType:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("veRL is not installed: pip install --no-deps verl (scripts/setup.sh)")
    pkg = Path(next(iter(spec.submodule_search_locations))) / "utils/reward_score/sandbox_fusion"
    name = "verl_sandbox_fusion_under_test"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(
            name, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
        )
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    return sys.modules[f"{name}.utils"]


@pytest.fixture(scope="module")
def check(grader: Grader) -> Any:  # noqa: F811 - the imported fixture
    """veRL's `check_correctness`, pointed at dsec as veRL users point it."""
    grader.need_image()
    scorer = _load_scorer()
    url = f"{grader.url}/run_code"

    def check_correctness(in_outs: Any, code: str, **kw: Any) -> Any:
        return scorer.check_correctness(url, in_outs, code, **kw)

    return check_correctness


CODE_SUCCESS = """
import sys
data = sys.stdin.read()
if data == 'input1':
    print('output1\\n', end='')
elif data == 'input2':
    print('output2\\n', end='')
else:
    print('unexpected input', end='')
"""
VALID = {"inputs": ["input1", "input2"], "outputs": ["output1\n", "output2\n"]}


def test_correct_output(check: Any) -> None:
    results, meta = check(VALID, CODE_SUCCESS)
    assert results == [True, True]
    assert [m["status"] for m in meta] == ["success", "success"]
    assert meta[0]["stdout"] == "output1\n"


def test_wrong_output(check: Any) -> None:
    results, meta = check(VALID, "print('wrong_output\\n', end='')")
    assert results == [False, False]
    assert meta[0]["status"] == "wrong_answer"
    assert meta[0]["stdout"] == "wrong_output\n"


def test_compile_error(check: Any) -> None:
    results, meta = check(VALID, "a=b", language="cpp")
    assert results == [-4, -4]
    assert [m["status"] for m in meta] == ["compile_error", "compile_error"]


def test_runtime_error(check: Any) -> None:
    code = "import sys\nprint('About to raise', file=sys.stderr)\nraise ValueError('x')\n"
    results, meta = check({"inputs": ["input1"], "outputs": ["output1\n"]}, code)
    assert results == [-2]
    assert meta[0]["status"] == "runtime_error"


def test_runtime_timeout(check: Any) -> None:
    code = "import time\ntime.sleep(10)\n"
    results, meta = check({"inputs": ["input1"], "outputs": ["output1\n"]}, code, timeout=5)
    assert results == [-3]
    assert meta[0]["status"] == "timeout"


def test_none_and_empty_stdin(check: Any) -> None:
    code = (
        "import sys, select\n"
        "input_data, _, _ = select.select([sys.stdin], [], [], 5)\n"
        "print(f\"You said '{sys.stdin.readline().strip()}'\")\n"
    )
    in_outs = {
        "inputs": [None, "", "hello"],
        "outputs": ["You said ''", "You said ''", "You said 'hello'"],
    }
    results, _ = check(in_outs, code, timeout=5)
    assert results == [True, True, True]


def test_fn_name_leetcode_wrapper(check: Any) -> None:
    code = """
class Solution:
    def occurrencesOfElement(self, nums: List[int], queries: List[int], x: int) -> List[int]:
        positions = defaultdict(list)
        for idx, num in enumerate(nums):
            positions[num].append(idx)
        x_positions = positions[x]
        return [-1 if k > len(x_positions) else x_positions[k - 1] for k in queries]
"""
    in_outs = {
        "fn_name": "occurrencesOfElement",
        "inputs": ["[1, 3, 1, 7]\n[1, 3, 2, 4]\n1", "[1, 2, 3]\n[10]\n5"],
        "outputs": ["[0, -1, 2, -1]", "[-1]"],
    }
    results, meta = check(in_outs, code, timeout=5)
    assert results == [True, True]
    assert "error" not in meta[0]


def test_high_concurrency_mixed(check: Any) -> None:
    """veRL's 100-case test: 4 cases sleep past a 15 s limit, 3 expect a wrong answer."""
    wrong, slow = {10, 25, 50}, {5, 30, 60, 90}
    inputs, outputs, expected = [], [], []
    for i in range(100):
        if i in slow:
            inputs.append(f"input_timeout_{i}")
            outputs.append(f"output_{i}\n")
            expected.append(-3)
        else:
            inputs.append(f"input_{i}")
            outputs.append(f"wrong_output_{i}\n" if i in wrong else f"output_{i}\n")
            expected.append(i not in wrong)
    code = """
import sys, time
data = sys.stdin.read()
if data.startswith('input_timeout_'):
    time.sleep(20)
    print(f"output_{data.split('_')[-1]}\\n", end='')
elif data.startswith('input_'):
    print(f"output_{data.split('_')[-1]}\\n", end='')
"""
    results, meta = check({"inputs": inputs, "outputs": outputs}, code, timeout=15)
    assert results == expected
    assert meta[min(wrong)]["expected_output"] == f"wrong_output_{min(wrong)}\n"


def test_high_concurrency_all_time_out(check: Any) -> None:
    """veRL's all-timeout test: 100 CPU-bound cases with a 10 s limit all come back as
    time-outs, each within veRL's own HTTP timeout (compile + run + 10 s), with veRL's 32
    requests in flight on this 2-core machine. veRL's program allocates ~1 GB while it
    computes; 32 of those at once would need more memory than this machine has, so the
    program here only computes."""
    code = "def spin():\n    while True:\n        pass\n\nspin()\n"
    in_outs = {
        "inputs": ["324 384429"] * 100,
        "outputs": [f"output_{i}\n" for i in range(100)],
    }
    started = time.monotonic()
    results, meta = check(in_outs, code, timeout=10)
    elapsed = time.monotonic() - started
    assert results == [-3] * 100, [m for m in meta if m["status"] != "timeout"][:3]
    assert meta[0]["status"] == "timeout"
    # Ran 32 at a time: about four rounds of 10 s, far from 100 rounds.
    assert elapsed < 300, elapsed
