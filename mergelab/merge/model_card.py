"""The model card (``README.md``) written into every merged folder, beside ``mergelab_merge.json``.

It says, for a person browsing the folder or a model hub, what was merged and how: the method, the
inputs (base first), the parameters (one table row per group of tensors that share them, when
they vary across tensors) and the config as it was written. Everything in it comes from the merge
record, so the card and ``mergelab_merge.json`` cannot disagree.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

MODEL_CARD_NAME = "README.md"


def _value(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def model_card(record: dict[str, Any], *, name: str, config_text: str | None = None) -> str:
    """Markdown with YAML front matter (``tags``, ``library_name``, hub ids of the inputs)."""
    front: dict[str, Any] = {"tags": ["mergelab", "merge"], "library_name": "transformers"}
    hub = record.get("hub_models") or []
    if hub:
        front["base_model"] = list(hub)
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", f"# {name}", ""]
    lines += ["This model is a merge of pre-trained language models made with mergelab.", ""]
    lines += ["## Method", ""]
    dialect = record.get("dialect")
    if dialect == "mergekit":
        fixed = ", ".join(f"{k}={v}" for k, v in (record.get("fixed_params") or {}).items())
        lines.append(
            f"`{record['mergekit_method']}`, read with mergekit's semantics and computed by "
            f"mergelab's `{record['method']}`" + (f" ({fixed})" if fixed else "") + "."
        )
    else:
        lines.append(f"`{record['method']}`.")
    lines.append("")
    lines += ["## Inputs", ""]
    as_given = record.get("as_given", {})
    if record.get("base"):
        lines.append(f"* base: `{as_given.get('base') or record['base']}`")
    for i, path in enumerate(as_given.get("models") or record.get("models") or []):
        lines.append(f"* model {i}: `{path}`")
    lines.append("")
    lines += ["## Parameters", ""]
    dtypes = f"compute dtype {record.get('compute_dtype')}"
    if record.get("input_dtype"):
        dtypes += f", inputs rounded to {record['input_dtype']}"
    lines.append(f"{dtypes}; seed {record.get('seed')}.")
    lines.append("")
    groups = record.get("tensor_groups")
    if groups:
        lines += ["| tensors | inputs | parameters |", "|---|---|---|"]
        for g in groups:
            params = {**g.get("params", {}), **g.get("per_model", {})}
            shown = ", ".join(f"{k}={_value(v)}" for k, v in params.items()) or "(none)"
            lines.append(f"| `{g['tensors']}` | {', '.join(g['inputs'])} | {shown} |")
    else:
        for key, value in {
            **record.get("params", {}),
            **record.get("per_model_params", {}),
        }.items():
            lines.append(f"* `{key}`: {_value(value)}")
    lines.append("")
    if config_text:
        lines += ["## Configuration", "", "```yaml", config_text.rstrip(), "```", ""]
    return "\n".join(lines)
