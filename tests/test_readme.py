"""The README's worked example for adding a merge method runs as written."""

import re
from pathlib import Path

import torch

from mergelab.merge import list_merge_methods, unregister_merge_method

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_adding_a_merge_method_example_runs_as_written():
    code = _python_block_after("### Adding a merge method")
    torch.manual_seed(0)
    base = torch.nn.Linear(4, 3)
    experts = [torch.nn.Linear(4, 3) for _ in range(3)]
    namespace = {"base": base, "experts": experts}
    try:
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
        assert "median_task_vector" in list_merge_methods()
        merged = namespace["merged"]
        for name, b in base.state_dict().items():
            taus = torch.stack([e.state_dict()[name] - b for e in experts])
            expected = b + 0.5 * taus.median(dim=0).values
            torch.testing.assert_close(merged.state_dict()[name], expected, rtol=0, atol=0)
    finally:
        unregister_merge_method("median_task_vector")
